"""`dspark calibrate`: Sequential Temperature Scaling fitted on the survival, left to right, scored on held-out
prompts; the file SGLang and TensorRT-LLM read; `--calibration` in generate and eval changes confidences, never
the output."""

import json
import math
import random

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure import calibration as sts
from dspark_cli.runtime.measure import evaluation as ev
from dspark_cli.runtime.measure.metrics import expected_calibration_error
from dspark_cli.runtime.rounds import RoundRecord

runner = CliRunner()


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _synthetic(count=3000, block=4, seed=0, scale=2.5, bias=0.5):
    """Rounds whose true per-slot acceptance is sigmoid(z_j), while the head says scale * z_j + bias
    (over-confident): the right temperatures are far from 1."""
    rng = random.Random(seed)
    data = sts.Rounds([], [], [])
    for _ in range(count):
        z = [rng.gauss(1.0 - 0.3 * j, 1.2) for j in range(block)]
        accepted = 0
        while accepted < block and rng.random() < _sigmoid(z[accepted]):
            accepted += 1
        data.logits.append([scale * v + bias for v in z])
        data.verified.append(block)
        data.accepted.append(accepted)
    return data


def _reference_fit(data, block):
    """The paper's objective written out by hand: position by position, the grid temperature whose survival ECE
    (earlier positions fixed) is lowest, ties to the one closest to 1."""
    temperatures, survival = [], [1.0] * len(data)
    for j in range(block):
        rows = [i for i in range(len(data)) if data.verified[i] > j]
        outcomes = [data.accepted[i] > j for i in rows]

        def error(t):
            return expected_calibration_error([survival[i] * _sigmoid(data.logits[i][j] / t) for i in rows], outcomes)

        best = min(sts.temperature_grid(), key=lambda t: (error(t), abs(math.log(t))))
        temperatures.append(best)
        survival = [s * _sigmoid(data.logits[i][j] / best) for i, s in enumerate(survival)]
    return temperatures


def test_fit_minimises_the_survival_ece_left_to_right():
    data = _synthetic(count=800, block=3)
    fitted = sts.fit_sts(data, 3)
    assert fitted == pytest.approx(_reference_fit(data, 3), rel=1e-12)
    assert all(t > 1.5 for t in fitted)  # the head is over-confident: every temperature softens it


def test_survival_and_per_slot_objectives_differ_and_the_survival_one_wins():
    """A head whose per-slot confidences are calibrated only on average (c_1 is right overall but its errors
    correlate with c_0): the per-slot fit leaves the survival miscalibrated, STS on the survival does not."""
    data = sts.Rounds([], [], [])
    rng = random.Random(1)
    for _ in range(4000):
        easy = rng.random() < 0.5
        c0, p1 = (0.9, 0.5) if easy else (0.3, 1.0)  # P(position 1 accepted | position 0 accepted)
        accepted = 0
        if rng.random() < c0:
            accepted = 1 + (rng.random() < p1)
        data.logits.append([math.log(c0 / (1 - c0)), math.log(0.9 / 0.1)])
        data.verified.append(2)
        data.accepted.append(accepted)
    fitted = sts.fit_sts(data, 2)
    after = sts.survival_calibration(data, fitted, 2)
    before = sts.survival_calibration(data, [1.0, 1.0], 2)
    assert after[1].ece < 0.5 * before[1].ece
    assert fitted[0] == pytest.approx(1.0, rel=0.05)  # position 0 was calibrated already


def test_held_out_ece_falls_and_the_split_is_by_prompt():
    keys = [("s", i, f"p{i}") for i in range(20)]
    fit, held = sts.split_prompts(keys, 0.3, 0)
    assert len(held) == 6 and not fit & held and fit | held == set(keys)
    assert sts.split_prompts(list(reversed(keys)), 0.3, 0) == (fit, held)  # the order of the runs does not matter
    with pytest.raises(DsparkError, match="at least 2 prompts"):
        sts.split_prompts(keys[:1])
    mixed = keys + [("t", i, f"q{i}") for i in range(10)]
    fit, held = sts.split_prompts(mixed, 0.3, 0)
    assert [sum(k[0] == name for k in held) for name in "st"] == [6, 3]  # each set held out in proportion
    assert not fit & held and fit | held == set(mixed)
    fit, held = sts.split_prompts([("a", 0, "x"), ("b", 0, "y")], 0.3, 0)  # sets of one prompt: still one held out
    assert len(held) == 1 and len(fit) == 1
    data = _synthetic()
    fitting = sts.Rounds(data.logits[:2000], data.verified[:2000], data.accepted[:2000])
    held_out = sts.Rounds(data.logits[2000:], data.verified[2000:], data.accepted[2000:])
    temperatures = sts.fit_sts(fitting, 4)
    before = sts.survival_calibration(held_out, [1.0] * 4, 4)
    after = sts.survival_calibration(held_out, temperatures, 4)
    for j in range(4):
        assert after[j].ece < before[j].ece, j
        assert after[j].auroc == pytest.approx(before[j].auroc, abs=0.02)  # a temperature mostly keeps the ranking


def test_ece_floor_is_what_a_calibrated_head_scores_on_that_many_pairs():
    assert sts.ece_floor([0.5] * 400) == pytest.approx(math.sqrt(0.25 / 400) * math.sqrt(2 / math.pi), rel=0.08)
    rng = random.Random(3)
    predicted = [rng.random() for _ in range(600)]
    scored = [expected_calibration_error(predicted, [rng.random() < p for p in predicted]) for _ in range(300)]
    assert sts.ece_floor(predicted) == pytest.approx(sum(scored) / len(scored), rel=0.1)
    assert sts.ece_floor(predicted * 16) < 0.3 * sts.ece_floor(predicted)  # 16x the pairs: about a quarter
    assert sts.ece_floor([]) is None


def test_only_verified_positions_are_pairs():
    data = sts.Rounds([[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]], verified=[1, 3], accepted=[1, 0])
    per_position = sts.survival_calibration(data, [1.0] * 3, 3)
    assert [c.count for c in per_position] == [2, 1, 1]
    with pytest.raises(DsparkError, match="position 2 of the block was never verified .*ended before it"):
        sts.fit_sts(sts.Rounds([[1.0, 1.0]], [1], [1]), 2)  # not blamed on a threshold the runs never used
    with pytest.raises(DsparkError, match="position 2 .*their confidence threshold cut every round"):
        sts.fit_sts(sts.Rounds([[1.0, 1.0]], [1], [1]), 2, threshold_cut=True)


def _run(prompts=10, block=2, seed=0):
    """An eval run of one set: prompt i has i + 2 full rounds with random logits and acceptances."""
    rng = random.Random(seed)
    results = []
    for i in range(prompts):
        rounds = []
        for _ in range(i + 2):
            accepted = rng.randrange(block + 1)
            rounds.append(RoundRecord(block, accepted, accepted + 1,
                                      confidence_logits=[rng.gauss(1.0, 2.0) for _ in range(block)]).__dict__)
        results.append(ev.PromptResult("s", i, f"p{i}", 3, 10, 0.01, 0.1, rounds, [], False))
    return ev.EvalRun({"block_size": block}, [ev.PromptSet("s", "s.txt", [f"p{i}" for i in range(prompts)])],
                      results)


def test_a_prompt_in_two_runs_stays_on_one_side_of_the_split():
    """Two runs of the same prompts: the split is of prompts, so the second run doubles every count on both sides
    and changes neither the prompts each side holds nor the temperatures."""
    one = sts.fit_runs([_run()], ["a"])
    two = sts.fit_runs([_run(), _run()], ["a", "b"])
    assert (two.fit_prompts, two.heldout_prompts) == (one.fit_prompts, one.heldout_prompts) == (7, 3)
    assert two.fit_rounds == 2 * one.fit_rounds
    assert [c.count for c in two.after] == [2 * c.count for c in one.after]
    assert two.temperatures == one.temperatures


def test_ece_before_and_after_score_the_same_held_out_pairs():
    """ece_before is the held-out survival at T = 1: the same pairs ece_after scores, none of the fitting ones."""
    run = _run()
    result = sts.fit_runs([run], ["a"])
    _, held = sts.split_prompts([(r.set_name, r.index, r.prompt) for r in run.results])
    held_rounds = sts.rounds_of([r for r in run.results if (r.set_name, r.index, r.prompt) in held], "a")
    assert result.before == sts.survival_calibration(held_rounds, [1.0, 1.0], 2)
    assert [c.count for c in result.before] == [c.count for c in result.after] == [len(held_rounds)] * 2


def test_positions_drafted_but_not_verified_have_no_outcome():
    """A confidence cut (2 of 4 positions scored) and an accepted stop token (proposed = its index + 1) leave the
    later drafted positions unverified: they are no pairs, not rejections."""
    logits = [1.0, 1.0, 1.0, 1.0]
    rounds = [RoundRecord(4, 1, 2, confidence_logits=logits),  # all 4 verified, 1 accepted
              RoundRecord(2, 2, 3, drafted=4, confidence_logits=logits),  # cut after 2, both accepted
              RoundRecord(2, 2, 2, drafted=4, confidence_logits=logits)]  # the 2nd token is an accepted stop
    result = ev.PromptResult("s", 0, "p", 3, 7, 0.01, 0.1, [r.__dict__ for r in rounds], [], True)
    data = sts.rounds_of([result], "run")
    assert data.verified == [4, 2, 2]
    per_position = sts.survival_calibration(data, [1.0] * 4, 4)
    assert [(c.count, c.positives) for c in per_position] == [(3, 3), (3, 2), (1, 0), (1, 0)]


def test_temperature_files_of_both_engines_load_and_bad_ones_are_one_sentence(tmp_path):
    path = tmp_path / "sts.json"
    path.write_text(json.dumps({"sts_temperatures": [1.5, 2]}))  # TensorRT-LLM's spelling
    assert sts.load_temperatures(path) == [1.5, 2.0]
    path.write_text(json.dumps({"temperatures": [0.5], "dataset": "x"}))  # SGLang's
    assert sts.load_temperatures(path) == [0.5]
    for bad in ({"temperatures": [1.0, 0.0]}, {"temperatures": []}, {"temperatures": ["1"]}, [1.0], {"t": [1]},
                {"temperatures": [1.0, True]}):
        path.write_text(json.dumps(bad))
        with pytest.raises(DsparkError, match="needs a 'temperatures' list of numbers above 0"):
            sts.load_temperatures(path)
    path.write_text('{"temperatures": [1.0, NaN]}')
    with pytest.raises(DsparkError, match="above 0"):
        sts.load_temperatures(path)
    with pytest.raises(DsparkError, match="has 1 temperatures but the block has 3"):
        sts.check_temperatures([1.0], 3, "f.json")


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """Two small eval runs of the demo pair, one per shipped set."""
    folder = tmp_path_factory.mktemp("runs")
    paths = []
    for prompt_set in ev.SHIPPED_SETS:
        path = folder / f"{prompt_set.stem}.json"
        result = runner.invoke(app, ["eval", "--data", str(prompt_set), "--limit", "6", "--max-new-tokens", "24",
                                     "--json", str(path)])
        assert result.exit_code == 0, result.output
        paths.append(path)
    return paths


def test_calibrate_writes_the_engine_file_and_refuses_to_overwrite(demo_runs, tmp_path):
    out = tmp_path / "sts.json"
    result = runner.invoke(app, ["calibrate", *map(str, demo_runs), "-o", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert len(doc["temperatures"]) == 7 and doc["temperatures"] == doc["sts_temperatures"]
    assert all(t > 0 for t in doc["temperatures"])
    assert len(doc["ece_before"]) == len(doc["ece_after"]) == 7 and doc["dataset"] == "eval_code,eval_prose"
    assert doc["num_samples"] > 0 and doc["holdout"]["heldout_prompts"] == 4  # 30% of 12 prompts
    assert "held-out" in result.output and "T_j" in result.output and "ECE floor" in result.output
    floors = doc["holdout"]["ece_floor"]
    assert len(floors) == 7 and all(0 < f < 1 for f in floors)
    rose = [j for j, (b, a) in enumerate(zip(doc["ece_before"], doc["ece_after"])) if a > b]
    assert rose  # 8 fitting prompts: some position's temperature does not carry over
    assert f"rose at position(s) {', '.join(map(str, rose))} " in " ".join(doc["notes"])
    other = tmp_path / "other.json"
    result = runner.invoke(app, ["calibrate", *map(str, demo_runs), "-o", str(other), "--holdout", "0.5",
                                 "--seed", "3"])
    assert result.exit_code == 0, result.output
    split = json.loads(other.read_text())["holdout"]
    assert (split["fraction"], split["seed"], split["heldout_prompts"]) == (0.5, 3, 6)  # the split that was used
    again = runner.invoke(app, ["calibrate", *map(str, demo_runs), "-o", str(out)])
    assert again.exit_code == 2 and "--force" in again.output
    over = runner.invoke(app, ["calibrate", str(demo_runs[0]), "-o", str(demo_runs[0]), "--force"])
    assert over.exit_code == 2 and "run file" in over.output


def test_the_written_line_names_the_readers_of_the_draft_s_family(demo_runs, tmp_path):
    """SGLang's and TensorRT-LLM's STS settings are named for a DSpark draft's runs; for a DFlash2 draft's (their
    settings say the selector ran) dspark alone reads the file: SGLang serves that draft with DFLASH, which reads
    none."""
    dspark = runner.invoke(app, ["calibrate", *map(str, demo_runs), "-o", str(tmp_path / "dspark.json")])
    assert dspark.exit_code == 0, dspark.output
    assert "SGLang: --speculative-dspark-confidence-sts-path" in " ".join(dspark.output.split())
    runs = []
    for path in demo_runs:
        doc = json.loads(path.read_text())
        doc["settings"].update(markov="selector", draft_topk=4, draft_kind="DFlash2 draft, path selector")
        runs.append(tmp_path / path.name)
        runs[-1].write_text(json.dumps(doc))
    dflash2 = runner.invoke(app, ["calibrate", *map(str, runs), "-o", str(tmp_path / "dflash2.json")])
    assert dflash2.exit_code == 0, dflash2.output
    written = " ".join(dflash2.output.split())
    assert "(dspark: --calibration; no engine reads an STS file for a DFlash2 draft" in written
    assert "--speculative-dspark-confidence-sts-path" not in written and "confidence_sts_path" not in written


def test_calibration_changes_confidences_never_tokens(demo_runs, tmp_path):
    table = tmp_path / "sts.json"
    table.write_text(json.dumps({"temperatures": [2.0] * 7}))
    args = ["--data", str(ev.SHIPPED_SETS[0]), "--limit", "2", "--max-new-tokens", "16", "--confidence-threshold",
            "0.5"]
    plain, calibrated = tmp_path / "a.json", tmp_path / "b.json"
    assert runner.invoke(app, ["eval", *args, "--json", str(plain)]).exit_code == 0
    result = runner.invoke(app, ["eval", *args, "--json", str(calibrated), "--calibration", str(table)])
    assert result.exit_code == 0, result.output
    a, b = json.loads(plain.read_text()), json.loads(calibrated.read_text())
    assert [r["tokens"] for r in a["results"]] == [r["tokens"] for r in b["results"]]
    assert b["settings"]["calibration"] == {"path": str(table), "temperatures": [2.0] * 7}
    round_ = b["results"][0]["rounds"][0]
    assert round_["confidences"] == pytest.approx([_sigmoid(x / 2.0) for x in round_["confidence_logits"]], rel=1e-5)
    assert [r["proposed"] for r in a["results"][0]["rounds"]] != [r["proposed"] for r in b["results"][0]["rounds"]]
    conflict = runner.invoke(app, ["eval", "--resume", str(calibrated), "--calibration", str(tmp_path / "c.json")])
    assert conflict.exit_code == 2 and "drop --calibration" in conflict.output


def test_generate_takes_the_calibration_and_keeps_its_tokens(tmp_path):
    table = tmp_path / "sts.json"
    table.write_text(json.dumps({"sts_temperatures": [0.5] * 7}))
    docs = []
    for extra in ([], ["--calibration", str(table)]):
        out = tmp_path / f"g{len(extra)}.json"
        result = runner.invoke(app, ["generate", "def f(x):", "--max-new-tokens", "16", "--confidence-threshold",
                                     "0.6", "--json", str(out), *extra])
        assert result.exit_code == 0, result.output
        docs.append(json.loads(out.read_text()))
    plain, calibrated = docs
    assert plain["prompts"][0]["tokens"] == calibrated["prompts"][0]["tokens"]
    first = calibrated["rounds"][0][0]
    assert first["confidences"] == pytest.approx([_sigmoid(x / 0.5) for x in first["confidence_logits"]], rel=1e-5)
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"temperatures": [1.0, 1.0]}))
    refused = runner.invoke(app, ["generate", "x", "--calibration", str(short)])
    assert refused.exit_code == 2 and "has 2 temperatures but the block has 7 positions" in refused.output


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("command", ["calibrate", "plan"])
def test_a_non_finite_confidence_logit_is_one_sentence_naming_the_round(demo_runs, tmp_path, bad, command):
    """A run file keeps a broken head's NaN / inf logits; fitting or replaying them is refused, naming file and
    round (was IndexError / 'cannot convert float NaN to integer', or a silent fit on inf)."""
    doc = json.loads(demo_runs[0].read_text())
    doc["results"][1]["rounds"][2]["confidence_logits"][3] = bad
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(doc))
    args = [command, str(broken)] + (["-o", str(tmp_path / "sts.json")] if command == "calibrate" else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    prompt = doc["results"][1]
    where = f"broken.json: round 3 of prompt {prompt['index'] + 1} of {prompt['set_name']} has a confidence logit"
    assert where in " ".join(result.output.split()) and "Traceback" not in result.output
