"""`dspark plan`: the recorded rounds replayed for other verify lengths and thresholds (exact per round), against
real runs of the demo pair; the cost table of `dspark bench verify`; `dspark serve --from-plan`."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure import evaluation as ev
from dspark_cli.runtime.measure import replay
from dspark_cli.runtime.measure.replay import Round, Rule, replay_round
from dspark_cli.runtime.rounds import scored_length
from dspark_cli.runtime.demo import demo_pair

runner = CliRunner()


def _round(accepted, verified=4, drafted=4, stop=False, logits=None, overhead=0.0):
    return Round(logits, drafted, verified, accepted, stop, overhead)


def test_a_round_truncated_to_n_accepts_min_of_accepted_and_n():
    full = _round(accepted=2)  # positions 0, 1 accepted, 2 rejected, 3 verified but after the rejection
    assert [replay_round(full, n).accepted for n in range(5)] == [0, 1, 2, 2, 2]
    assert [replay_round(full, n).emitted for n in range(5)] == [1, 2, 3, 3, 3]
    assert [replay_round(full, n).verified for n in range(5)] == [0, 1, 2, 3, 4]
    everything = _round(accepted=4)
    assert [replay_round(everything, n).emitted for n in range(5)] == [1, 2, 3, 4, 5]
    assert not any(replay_round(everything, n).censored for n in range(5))


def test_verifying_past_the_record_is_censored_unless_a_rejection_was_seen():
    cut = _round(accepted=2, verified=2, drafted=4)  # a threshold cut at 2 and both accepted: 2, 3 unknown
    outcome = replay_round(cut, 4)
    assert (outcome.verified, outcome.accepted, outcome.emitted, outcome.censored) == (2, 2, 3, True)
    rejected = _round(accepted=1, verified=2, drafted=4)  # the rejection at position 1 is known
    outcome = replay_round(rejected, 4)
    assert (outcome.accepted, outcome.emitted, outcome.censored) == (1, 2, False)


def test_a_round_that_ended_on_a_stop_token_ends_again():
    stopped = _round(accepted=3, verified=3, drafted=4, stop=True)  # recorded: proposed = accepted = emitted = 3
    assert [replay_round(stopped, n).emitted for n in range(5)] == [1, 2, 3, 3, 3]


def test_threshold_rules_use_the_recorded_logits_raw_or_calibrated():
    import math

    logits = (math.log(9), math.log(4), 0.0, 2.0)  # sigmoid: 0.9, 0.8, 0.5, 0.88
    r = _round(accepted=4, logits=logits)
    confidences = [0.9, 0.8, 0.5, 1 / (1 + math.exp(-2.0))]
    for kind in ("survival", "per-slot"):
        for x in (0.3, 0.6, 0.75):
            assert Rule(kind, x).verify_length(r, None) == scored_length(confidences, x, kind)
    hot = [1 / (1 + math.exp(-v / 4.0)) for v in logits]  # T = 4 pulls every confidence toward 0.5
    assert Rule("survival", 0.3, True).verify_length(r, [4.0] * 4) == scored_length(hot, 0.3, "survival")
    assert Rule("survival", 0.3, True).verify_length(r, [4.0] * 4) != Rule("survival", 0.3).verify_length(r, None)


def test_replay_tau_and_tokens_per_s_from_a_cost_table():
    prompts = [[_round(4, overhead=0.001), _round(0, overhead=0.001)], [_round(2, overhead=0.001)]]
    costs = {t: 1.0 + t for t in range(1, 6)}  # ms of a pass over t tokens
    same = replay.replay(prompts, Rule("fixed", 4), costs=costs)
    assert same.tau == pytest.approx((5 + 1 + 3) / 3) and same.verified_per_round == 5
    assert same.round_ms == pytest.approx(1.0 + 6.0) and same.tokens_per_s == pytest.approx(9 / 0.021)
    two = replay.replay(prompts, Rule("fixed", 2), costs=costs)
    assert two.tau == pytest.approx((3 + 1 + 3) / 3) and two.accepted_per_round == pytest.approx(4 / 3)
    assert two.tokens_per_s == pytest.approx(7 / (3 * 0.001 + 3 * 0.004))
    assert two.tau_ci[0] <= two.tau <= two.tau_ci[1]
    best = replay.recommend([same, two])
    assert best is two and replay.speculative_fields(two, 4) == {"num_speculative_tokens": 2}
    threshold = replay.replay([[_round(4, logits=(3.0,) * 4)]], Rule("survival", 0.5), costs=costs)
    assert replay.speculative_fields(threshold, 4) == {"num_speculative_tokens": 4,
                                                       "dspark_confidence_threshold": 0.5}
    assert replay.recommend([replay.replay(prompts, Rule("fixed", 2))]) is None  # no costs: nothing to rank by
    assert "the block-size option 2" in replay.recommendation_notes(two, 4)[0]  # a k below the block: measure it for real
    assert replay.recommendation_notes(same, 4) == replay.recommendation_notes(threshold, 4) == []


def test_the_recommendation_is_a_row_vllm_can_deploy():
    """vLLM takes a verify length or an uncalibrated survival threshold: a faster STS-calibrated or per-slot row is
    never recommended."""
    def row(rule, tokens_per_s):
        return replay.Row(rule, 2.0, [1.9, 2.1], 1.0, 5.0, 0, 10, tokens_per_s=tokens_per_s)

    plain = row(Rule("survival", 0.5), 100.0)
    rows = [row(Rule("fixed", 4), 90.0), plain, row(Rule("survival", 0.5, calibrated=True), 130.0),
            row(Rule("per-slot", 0.5), 120.0)]
    assert replay.recommend(rows) is plain
    assert replay.recommend(rows, kinds=("fixed",)).rule == Rule("fixed", 4)


def test_cost_tables_are_checked(tmp_path):
    path = tmp_path / "costs.json"
    for bad in ({"tokens": [1, 2], "ms": [1.0]}, {"tokens": [1, 1], "ms": [1.0, 2.0]}, {"tokens": [0], "ms": [1.0]},
                {"tokens": [1], "ms": [-1.0]}, {"tokens": [1], "ms": ["1"]}, [1, 2], {}):
        path.write_text(json.dumps(bad))
        with pytest.raises(DsparkError, match="needs 'tokens'"):
            replay.read_costs(path)
    path.write_text(json.dumps({"tokens": [1, 2], "ms": [1.0, 2.5]}))
    assert replay.read_costs(path) == {1: 1.0, 2: 2.5}


# --- the demo pair: the replay against real runs ---------------------------------------------------------------

PROMPTS = ["--data", str(ev.SHIPPED_SETS[0]), "--limit", "6", "--max-new-tokens", "32"]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """The demo pair on the same 6 prompts: the full block (recorded), --block-size 3, and a survival threshold
    0.5."""
    folder = tmp_path_factory.mktemp("replay")
    runs = {}
    for name, extra in (("full", []), ("k3", ["--block-size", "3"]), ("x05", ["--confidence-threshold", "0.5"])):
        path = folder / f"{name}.json"
        result = runner.invoke(app, ["eval", *PROMPTS, "--json", str(path), *extra])
        assert result.exit_code == 0, result.output
        runs[name] = path
    return runs


def test_replayed_tau_lies_within_the_real_runs_intervals(real_runs):
    block, rows, _ = replay.replay_runs([ev.EvalRun.load(real_runs["full"])])
    by_label = {row.rule.label: row for row in rows}
    for label, name in (("verify k = 3", "k3"), ("survival >= 0.5", "x05")):
        real = json.loads(real_runs[name].read_text())["statistics"]["all"]
        low, high = real["tau_ci"]
        replayed = by_label[label]
        assert low <= replayed.tau <= high, (label, replayed.tau, real["tau"], low, high)
        assert replayed.censored_rounds == 0
    full = json.loads(real_runs["full"].read_text())["statistics"]["all"]
    assert by_label[f"verify k = {block}"].tau == pytest.approx(full["tau"])  # replaying the recorded rule


def same_overhead(run: ev.EvalRun, seconds: float = 0.001) -> ev.EvalRun:
    """The run with every round's draft, Markov and bookkeeping time set to `seconds`: the two runs were timed at
    different moments, so their measured overheads differ with the machine's load, not with the rule."""
    for result in run.results:
        for round_ in result.rounds:
            round_.update(draft_backbone=seconds, markov=0.0, other=0.0)
    return run


def test_a_run_of_a_smaller_block_is_measured_and_stands_in_for_that_k(real_runs, tmp_path):
    full, k3 = (same_overhead(ev.EvalRun.load(real_runs[name])) for name in ("full", "k3"))
    costs = {t: (1.0 if t <= 4 else 50.0) for t in range(1, 9)}  # passes over more than 4 tokens are slow: k = 3 wins
    block, rows, _ = replay.replay_runs([k3, full], costs)
    assert block == 7
    by_label = {row.rule.label: row for row in rows}
    measured, replayed = by_label["block 3 (measured)"], by_label["verify k = 3"]
    real = json.loads(real_runs["k3"].read_text())["statistics"]["all"]
    assert measured.tau == pytest.approx(real["tau"]) and measured.tau != replayed.tau  # the run itself, not a replay
    assert measured.rounds == sum(len(r.rounds) for r in k3.results)
    best = replay.recommend(rows)
    assert best is measured and replay.speculative_fields(best, block) == {"num_speculative_tokens": 3}
    assert replay.recommendation_notes(best, block) == []  # measured: nothing left to check
    slow = [dataclasses.replace(row, tokens_per_s=1.0) if row is measured else row for row in rows]
    assert replay.recommend(slow).rule.label not in ("verify k = 3", "block 3 (measured)")  # no replay stands in
    x05 = ev.EvalRun.load(real_runs["x05"])
    with pytest.raises(DsparkError, match="block size 3 hold other prompts"):
        replay.replay_runs([full, ev.EvalRun(k3.settings, k3.sets, k3.results[:-1])])
    cut = ev.EvalRun({**x05.settings, "block_size": 3}, x05.sets, x05.results)
    with pytest.raises(DsparkError, match="block size 3 cut verification with a confidence threshold"):
        replay.replay_runs([full, cut])
    for key, other in (("target", "/elsewhere/target"), ("draft", "./another-draft"), ("temperature", 1.0),
                       ("top_p", 0.9), ("max_new_tokens", 7)):  # another pair or sampling may not stand in
        foreign = ev.EvalRun({**k3.settings, key: other}, k3.sets, k3.results)
        with pytest.raises(DsparkError, match=f"block size 3 were made with {key} "):
            replay.replay_runs([full, foreign])
    slash = ev.EvalRun({**k3.settings, "draft": k3.settings["draft"] + "/"}, k3.sets, k3.results)
    assert len(replay.replay_runs([full, slash])[1]) == len(rows)  # the same folder spelled with a slash


def test_bench_verify_then_plan_then_serve_from_plan(real_runs, tmp_path):
    costs = tmp_path / "costs.json"
    result = runner.invoke(app, ["bench", "verify", "--tokens", "8", "--context", "16", "--reps", "2", "--warmup",
                                 "0", "--json", str(costs)])
    assert result.exit_code == 0, result.output
    table = json.loads(costs.read_text())
    assert table["tokens"] == list(range(1, 9)) and all(ms > 0 for ms in table["ms"])
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"tokens": [1, 2, 3], "ms": [1.0, 1.1, 1.2]}))
    refused = runner.invoke(app, ["plan", str(real_runs["full"]), "--costs", str(short)])
    assert refused.exit_code == 2 and "no time for a pass over 4 tokens" in refused.output

    plan_file = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", str(real_runs["full"]), "--costs", str(costs), "-o", str(plan_file)])
    assert result.exit_code == 0, result.output
    plan = json.loads(plan_file.read_text())
    fields = plan["speculative_config"]
    assert "recommended:" in result.output and json.dumps(fields) in " ".join(result.output.split())
    best = max((r for r in plan["rows"] if r["rule"] in ("fixed", "survival") and not r["calibrated"]),
               key=lambda r: r["tokens_per_s"])
    assert plan["recommended"]["label"] == best["label"]
    assert plan["best_fixed"]["rule"] == "fixed" and plan["best_threshold"]["rule"] == "survival"
    assert best["tokens_per_s"] == max(plan["best_fixed"]["tokens_per_s"], plan["best_threshold"]["tokens_per_s"])
    target, draft = map(str, demo_pair())
    served = runner.invoke(app, ["serve", "-t", target, "-d", draft, "--from-plan", str(plan_file), "--json", "-"])
    assert served.exit_code == 0, served.output
    spec = json.loads(served.output)["speculative_config"]
    assert {k: spec[k] for k in fields} == fields
    clash = runner.invoke(app, ["serve", "-t", target, "-d", draft, "--from-plan", str(plan_file), "--block-size",
                                str(fields["num_speculative_tokens"] % 7 + 1), "--dry-run"])
    assert clash.exit_code == 2 and "contradicts the plan" in clash.output
    plan_file.write_text(json.dumps({**plan, "speculative_config": {"num_speculative_tokens": "7"}}))
    bad = runner.invoke(app, ["serve", "-t", target, "-d", draft, "--from-plan", str(plan_file), "--dry-run"])
    assert bad.exit_code == 2 and "must be an integer" in bad.output


def test_plan_with_calibration_adds_calibrated_rows_and_without_costs_recommends_nothing(real_runs, tmp_path):
    table = tmp_path / "sts.json"
    table.write_text(json.dumps({"temperatures": [1.5] * 7}))
    result = runner.invoke(app, ["plan", str(real_runs["full"]), "--calibration", str(table), "--json", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["speculative_config"] is None and doc["recommended"] is None
    calibrated = [r for r in doc["rows"] if r["calibrated"]]
    assert len(calibrated) == 2 * len(replay.THRESHOLDS)
    assert any(a["tau"] != b["tau"] for a, b in zip(calibrated, [r for r in doc["rows"] if r["rule"] != "fixed"
                                                                 and not r["calibrated"]]))


def test_runs_without_logits_replay_fixed_lengths_only_and_cannot_be_calibrated(real_runs, tmp_path):
    doc = json.loads(real_runs["full"].read_text())
    doc["format"] = "dspark-eval/1"  # an older run file: no raw logits, no calibration setting
    doc["settings"].pop("calibration")
    for result in doc["results"]:
        for r in result["rounds"]:
            del r["confidence_logits"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    result = runner.invoke(app, ["plan", str(old), "--json", "-"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert {r["rule"] for r in plan["rows"]} == {"fixed"} and any("no raw confidence logits" in n for n in plan["notes"])
    refused = runner.invoke(app, ["calibrate", str(old), "-o", str(tmp_path / "sts.json")])
    assert refused.exit_code == 2 and "without raw confidence logits" in refused.output
    assert not (tmp_path / "sts.json").exists()
