"""`dspark plan --concurrency`: the engines' batch verify schedulers replayed over recorded rounds, and the cost
tables they read (runtime/measure/schedule.py, costs.py)."""

import json
import math

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure import costs, replay, schedule
from dspark_cli.runtime.measure import evaluation as ev
from dspark_cli.runtime.measure.replay import Round, Rule

runner = CliRunner()
LOW, HIGH = math.log(0.01 / 0.99), math.log(0.99 / 0.01)  # c = 0.01, 0.99


def _round(logits, accepted=None, overhead=0.0):
    n = len(logits)
    return Round(tuple(logits), n, n, n if accepted is None else accepted, False, overhead)


def _scheduler(name):
    return schedule.schedulers_for([name], 2)[0]


def _sps(tokens, steps):
    return costs.SpsTable(tuple(tokens), tuple(float(s) for s in steps), tokens[-1])


def _lengths(name, rounds, cost, temperatures=None):
    return schedule.verify_lengths(_scheduler(name), rounds, rounds, cost, temperatures)


def test_appendix_a_early_stop_and_global_argmax_choose_different_budgets():
    """Two requests with survivals [0.5, 0.05]: the first candidate does not pay (Θ 200 -> 175), the second does
    (210); the paper's early stop keeps 0, SGLang's argmax takes 2 (one per request)."""
    table = _sps([2, 3, 5], [100, 70, 40])
    rows = [[0.5, 0.05], [0.5, 0.05]]
    assert schedule.thetas(rows, 0, table, 0.0) == pytest.approx([200, 175, 210, 3.05 * 40, 3.1 * 40])
    rounds = [_round([0.0, math.log(0.1 / 0.9)])] * 2  # c = 0.5, 0.1
    assert _lengths("paper", rounds, table) == [0, 0]
    assert _lengths("sglang", rounds, table) == [1, 1]


def _trt(gain=0.01):
    return costs.TrtTable(0.0, (1,), (0.0,), (2, 4, 6), (1.0, 2.0, 10.0), gain)


def test_sglang_floor_is_0_and_tensorrt_llm_floor_is_1_per_request():
    """c = 0.1, 0.1 per request: SGLang's Θ(0) = 2 / 1 ms beats 2.1 / 1.5; TensorRT-LLM must verify one draft per
    request (Θ = 2.2 / 2 ms, more does not pay)."""
    rounds = [_round([math.log(0.1 / 0.9)] * 2)] * 2
    assert _lengths("sglang", rounds, _trt()) == [0, 0]
    assert _lengths("trtllm", rounds, _trt()) == [1, 1]


def test_tensorrt_llm_keeps_the_full_block_unless_the_gain_beats_its_minimum():
    """c = 0.5 per position: Θ(1 per request) = 2 + 1 = 3 over 2 ms = 1.5 against the full block's 3.5 / 10 ms."""
    rounds = [_round([0.0, 0.0])] * 2
    assert _lengths("trtllm", rounds, _trt(gain=0.01)) == [1, 1]
    assert _lengths("trtllm", rounds, _trt(gain=4.0)) == [2, 2]  # 1.5 < 0.35 · (1 + 4): the full block
    assert _lengths("sglang", rounds, _trt(gain=4.0)) == [0, 0]  # SGLang has no such fallback


class _Seconds:
    """A cost table of given seconds per verified token count (one request), TensorRT-LLM's gain 0."""

    minimum_predicted_gain = 0.0

    def __init__(self, seconds):
        self.table = seconds

    def seconds(self, requests, tokens):
        return self.table[tokens]


def test_tensorrt_llm_breaks_an_exact_tie_toward_the_larger_budget():
    """One request, survivals 1, 0.5, 0.25 past nothing and 2, 2.5, 4 s for 2, 3, 4 tokens: Θ(0) = 2 / 2 and
    Θ(1) = 2.5 / 2.5 tie exactly at 1.0, Θ(2) = 0.6875. TensorRT-LLM takes the larger budget (1 past its floor of
    1); SGLang's argmax the first (Θ over 1 + its floor of 0: 1 / s(1))."""
    rows = [[1.0, 0.5, 0.25]]
    cost = _Seconds({2: 2.0, 3: 2.5, 4: 4.0})
    assert schedule.thetas(rows, 1, cost, 0.0) == [1.0, 1.0, 0.6875]
    assert schedule.budget(_scheduler("trtllm"), rows, cost, 0.0) == 1
    logit = [math.inf, 0.0, math.log(0.25 / 0.75)]  # survivals 1, 0.5, 0.25 (sigmoid(inf) = 1)
    rounds = [_round(logit)]
    assert schedule.verify_lengths(_scheduler("trtllm"), rounds, rounds, cost) == [2]
    sglang = _Seconds({1: 1.0, 2: 2.0, 3: 2.5, 4: 4.0})  # Θ: 1, 1, 1, 0.6875: the first of three ties
    assert schedule.budget(_scheduler("sglang"), rows, sglang, 0.0) == 0


def test_the_budget_comes_from_lagged_confidences():
    """One request, rounds of c = 0.01, 0.01, 0.99, all accepted; SPS 100, 60, 50 at 1, 2, 3 tokens. Survival 1
    (no history) verifies both drafts (Θ 100, 120, 150); c = 0.01 none (100, 60.6, 50.5); c = 0.99 both (100, 119.4,
    148.5). Lag 0 (paper): 0, 0, 2;
    lag 1 (vLLM): 2, 0, 0; lag 2 (SGLang, paper-production): 2, 2, 0."""
    prompt = [_round([LOW, LOW]), _round([LOW, LOW]), _round([HIGH, HIGH])]
    table = _sps([1, 2, 3], [100, 60, 50])
    emitted = {"paper": 1 + 1 + 3, "vllm": 3 + 1 + 1, "sglang": 3 + 3 + 1, "paper-production": 3 + 3 + 1}
    for name, total in emitted.items():
        row = schedule.simulate([prompt], _scheduler(name), 1, table)
        assert row.tau == pytest.approx(total / 3), name


STS_LOGITS = [math.log(4.0), 0.0]  # c = 0.8, 0.5; survival 0.8, 0.4
STS_TABLE = ([1, 2, 3], [100, 60, 48])  # Θ: 100, 1.8 · 60 = 108, 2.2 · 48 = 105.6 -> one draft


def test_sts_is_applied_to_each_logit_before_the_product():
    """T_1 = 4: c_1 = sigmoid(ln 4 / 4) = 0.586, Θ 100, 95.1, 90.2 -> none. T_2 on a zero logit changes nothing
    (c_2 = 0.5 at any T), which a temperature applied to the product would not respect (T_2 = 10 would lift the
    survival 0.4 to 0.49, Θ(2) to 110 > 108)."""
    table = _sps(*STS_TABLE)
    rounds = [_round(STS_LOGITS)]
    assert _lengths("sglang", rounds, table) == [1]
    assert _lengths("sglang", rounds, table, [4.0, 1.0]) == [0]
    assert _lengths("sglang", rounds, table, [1.0, 10.0]) == [1]
    assert schedule.survivals(STS_LOGITS, [4.0, 10.0]) == pytest.approx([0.5858, 0.2929], abs=1e-4)


def test_vllm_uses_raw_confidences_even_with_an_sts_file():
    table = _sps(*STS_TABLE)
    rounds = [_round(STS_LOGITS)]
    assert _lengths("vllm", rounds, table, [4.0, 1.0]) == [1]  # the raw survivals, as without temperatures
    assert _lengths("trtllm", rounds, table, [4.0, 1.0]) == [1]  # its floor; T_1 keeps it from more


def test_a_request_joins_when_one_finishes_and_the_step_costs_the_batch():
    table = _sps([1, 2, 3, 4, 5, 6], [100, 90, 80, 70, 60, 50])
    prompts = [[_round([HIGH, HIGH], overhead=0.001)] * 2, [_round([HIGH, HIGH], accepted=1)], [_round([LOW, LOW])]]
    row = schedule.simulate(prompts, _scheduler("fixed-k"), 2, table)  # k = 1
    # step 1: prompts 0 and 1, step 2: prompts 0 and 2 (prompt 2 joins when prompt 1 is done); k = 1 verifies
    # 2 tokens per request and each round emits 2; a step costs the mean draft time plus 1 / SPS(4)
    assert row.steps == 2 and row.verify_tokens_per_step == 4 and row.tau == pytest.approx(8 / 4)
    step = 0.0005 + 1 / 70
    assert row.tokens_per_s == pytest.approx(8 / (2 * step))
    assert row.per_request_tokens_per_s == pytest.approx((4 / (2 * step) + 2 / step + 2 / step) / 3)


def test_cost_tables_are_read_and_checked(tmp_path):
    path = tmp_path / "table.json"
    good = [({"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100, 50], "max_batch_tokens": 64},
             lambda t: t.seconds(3, 9) == pytest.approx(1 / 50) and t.seconds(3, 7) == pytest.approx(1 / 100)),
            ({"bias_seconds": 0.001, "bs_probes": [1, 3], "alpha_seconds": [0.0, 0.002], "m_probes": [2, 6],
              "theta_seconds": [0.01, 0.03]}, lambda t: t.seconds(2, 4) == pytest.approx(0.001 + 0.001 + 0.02)),
            ({"token_counts": [2, 6], "step_time_ms": [10, 30], "batch_sizes": [1], "batch_overhead_ms": [1],
              "fixed_overhead_ms": 2, "minimum_predicted_gain": 0.05},
             lambda t: t.seconds(1, 4) == pytest.approx(0.023) and t.minimum_predicted_gain == 0.05),
            ({"tokens": [1, 2], "ms": [4.0, 5.0]}, lambda t: t.seconds(1, 2) == pytest.approx(0.005) and t.batch_one)]
    for doc, check in good:
        path.write_text(json.dumps(doc))
        assert check(costs.read_cost_table(path)), doc
    bad = [({"sample_batch_tokens": [8, 1], "sample_steps_per_sec": [1, 1]}, "'sample_batch_tokens' must be"),
           ({"sample_batch_tokens": [1], "sample_steps_per_sec": [float("inf")]}, "'sample_steps_per_sec' must be"),
           ({"sample_batch_tokens": [4], "sample_steps_per_sec": [1], "max_batch_tokens": 2}, "'max_batch_tokens'"),
           ({"bias_seconds": 0, "bs_probes": [1], "alpha_seconds": [0], "m_probes": [1], "theta_seconds": [1]},
            "'bias_seconds' must be"),
           ({"token_counts": [1, 2], "step_time_ms": [1.0]}, "'step_time_ms' must be a list of 2"),
           ({"token_counts": [1], "step_time_ms": [1.0], "batch_sizes": [1], "batch_overhead_ms": [-1]},
            "'batch_overhead_ms'"),
           ({"tokens": [1], "ms": [0]}, "needs 'tokens'"), ({"other": 1}, "none of the keys"), ([1], "not an object")]
    for doc, message in bad:
        path.write_text(json.dumps(doc))
        with pytest.raises(DsparkError, match=message):
            costs.read_cost_table(path)


# --- the demo pair: at concurrency 1 the fixed-k rows are today's batch-1 plan -------------------------------------

@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("schedule") / "full.json"
    result = runner.invoke(app, ["eval", "--data", str(ev.SHIPPED_SETS[0]), "--limit", "4", "--max-new-tokens", "24",
                                 "--json", str(path)])
    assert result.exit_code == 0, result.output
    return path


def test_fixed_k_at_concurrency_1_is_the_batch_1_plan_row(real_run):
    run = ev.EvalRun.load(real_run)
    prompts = [replay.rounds_of_result(result) for result in run.results]
    ms = {t: 1.0 + 0.5 * t for t in range(1, 9)}
    for k in (1, 3, 7):
        batch_one = replay.replay(prompts, Rule("fixed", k), costs=ms)
        row = schedule.simulate(prompts, schedule.schedulers_for(["fixed-k"], 7)[k - 1], 1, costs.sps_table_of(ms))
        assert row.tau == pytest.approx(batch_one.tau) and row.tokens_per_s == pytest.approx(batch_one.tokens_per_s)
        assert row.verify_tokens_per_step == pytest.approx(batch_one.verified_per_round)


def test_plan_at_concurrency_prints_a_table_per_load_and_json(real_run, tmp_path):
    table = tmp_path / "sps.json"
    table.write_text(json.dumps({"bias_seconds": 0.002, "bs_probes": [1, 32], "alpha_seconds": [0.0, 0.004],
                                 "m_probes": [1, 256], "theta_seconds": [0.001, 0.05]}))
    result = runner.invoke(app, ["plan", str(real_run), "--concurrency", "1,4", "--costs", str(table), "--json", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [load["concurrency"] for load in doc["loads"]] == [1, 4]
    names = {row["scheduler"] for row in doc["loads"][1]["rows"]}
    assert names == set(schedule.SCHEDULERS)
    assert all(row["tokens_per_s"] > 0 for load in doc["loads"] for row in load["rows"])
    shown = runner.invoke(app, ["plan", str(real_run), "--concurrency", "2", "--scheduler", "sglang", "--costs",
                                str(table)], env={"COLUMNS": "300"})
    assert shown.exit_code == 0 and "concurrency 2" in shown.output and "SGLANG_RAGGED_VERIFY_MODE" in shown.output
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"tokens": list(range(1, 9)), "ms": [1.0] * 8}))
    refused = runner.invoke(app, ["plan", str(real_run), "--concurrency", "1,8", "--costs", str(bench)])
    assert refused.exit_code == 2 and "batch 1" in refused.output
    refused = runner.invoke(app, ["plan", str(real_run), "--concurrency", "0"])
    assert refused.exit_code == 2 and "--concurrency" in refused.output
