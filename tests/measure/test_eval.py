"""`dspark eval` and its runtime half: prompt sets, the bootstrap, the length and confidence rules, the run file
(resume), --compare, --markdown, and the CLI on the shipped demo pair."""

import json
import math
import random
import statistics

import pytest
import torch
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.measure import evaluation as ev
from dspark_cli.runtime.demo import DEMO_PROMPTS
from dspark_cli.runtime.rounds import RoundRecord, scored_length

runner = CliRunner()

# --- prompt sets ------------------------------------------------------------------------------------------------


def test_jsonl_sets_take_the_first_turn_or_the_prompt(tmp_path):
    path = tmp_path / "mt.jsonl"
    path.write_text('{"turns": ["first turn", "second turn"], "id": 3}\n\n{"prompt": "plain"}\n"a string"\n')
    assert ev.read_prompt_set(path).prompts == ["first turn", "plain", "a string"]
    assert ev.read_prompt_set(path).name == "mt"
    path.write_text('{"turns": []}\n')
    with pytest.raises(DsparkError, match="line 1.*turns"):
        ev.read_prompt_set(path)
    path.write_text("{not json\n")
    with pytest.raises(DsparkError, match="line 1 is not JSON"):
        ev.read_prompt_set(path)
    with pytest.raises(DsparkError, match=r"\.jsonl file .* or a \.txt"):
        ev.read_prompt_set(tmp_path / "x.csv")


def test_txt_sets_are_paragraphs_when_there_are_blank_lines_else_lines(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("one\ntwo\n\nthree\n")
    assert ev.read_prompt_set(path).prompts == ["one\ntwo", "three"]
    path.write_text("one\ntwo\nthree\n")
    assert ev.read_prompt_set(path).prompts == ["one", "two", "three"]
    path.write_text("\n\n")
    with pytest.raises(DsparkError, match="no prompts"):
        ev.read_prompt_set(path)


def test_limit_takes_deepspecs_seeded_shuffle(tmp_path):
    path = tmp_path / "n.txt"
    path.write_text("\n".join(f"prompt {i}" for i in range(20)) + "\n")
    expected = [f"prompt {i}" for i in range(20)]
    random.Random(7).shuffle(expected)
    assert ev.read_prompt_set(path, limit=5, seed=7).prompts == expected[:5]
    assert ev.read_prompt_set(path, limit=50, seed=7).prompts == [f"prompt {i}" for i in range(20)]


def test_shipped_sets_use_deepspecs_layout():
    for path in ev.SHIPPED_SETS:
        lines = path.read_text().splitlines()
        assert all(isinstance(json.loads(line)["turns"], list) for line in lines)
        assert len(ev.read_prompt_set(path).prompts) == len(lines) >= 12


# --- statistics -------------------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 4.0, 8.0]
    assert ev.percentile(values, 0.0) == 1.0 and ev.percentile(values, 1.0) == 8.0
    assert ev.percentile(values, 0.5) == 3.0  # numpy.percentile([1, 2, 4, 8], 50)
    assert math.isclose(ev.percentile(values, 0.25), 1.75)


def test_bootstrap_interval_of_a_known_sample():
    rng = random.Random(3)
    values = [rng.gauss(3.0, 1.0) for _ in range(400)]
    interval = ev.bootstrap_ratio(values, [1.0] * len(values))
    mean = statistics.fmean(values)
    half_width = 1.959964 * statistics.stdev(values) / math.sqrt(len(values))  # normal theory for the mean
    assert interval.estimate == pytest.approx(mean)
    # 2000 resamples pin the 2.5% / 97.5% quantiles to a few percent of the half-width (the 1.25% / 98.75% ones
    # would sit 14% further out)
    assert interval.low == pytest.approx(mean - half_width, abs=0.07 * half_width)
    assert interval.high == pytest.approx(mean + half_width, abs=0.07 * half_width)
    assert ev.bootstrap_ratio(values, [1.0] * len(values)) == interval  # fixed bootstrap seed
    constant = ev.bootstrap_ratio([6.0, 9.0], [2.0, 3.0])  # every resample has ratio 3
    assert (constant.estimate, constant.low, constant.high) == pytest.approx((3.0, 3.0, 3.0))
    assert ev.bootstrap_ratio([], []).low is None


def test_paired_difference_sees_what_unpaired_cannot():
    rng = random.Random(5)
    prompt_effect = [rng.uniform(1.0, 6.0) for _ in range(40)]
    old = ([e * 10 for e in prompt_effect], [10.0] * 40)
    new = ([(e + 0.2 + rng.gauss(0, 0.05)) * 10 for e in prompt_effect], [10.0] * 40)
    paired = ev.bootstrap_ratio_difference(new, old, paired=True)
    unpaired = ev.bootstrap_ratio_difference(new, old, paired=False)
    assert paired.estimate == pytest.approx(unpaired.estimate) and 0.15 < paired.estimate < 0.25
    assert paired.low > 0  # significant by prompt
    assert unpaired.low < 0 < unpaired.high  # drowned in the spread between prompts


def _result(name, index, prompt, accepted, block=4):
    rounds = [RoundRecord(proposed=block, accepted=a, emitted=a + 1).__dict__ for a in accepted]
    return ev.PromptResult(name, index, prompt, 5, 1 + sum(a + 1 for a in accepted), 0.01, 0.1, rounds, [], False)


def test_compare_pairs_by_prompt_and_judges_significance():
    old = [_result("s", i, f"p{i}", [i % 3, 1, 0]) for i in range(30)]
    same = ev.compare_tau(old, old)
    assert same["paired"] and same["difference"] == 0 and same["significant"] is False
    better = [_result("s", i, f"p{i}", [i % 3 + 1, 2, 1]) for i in range(30)]
    result = ev.compare_tau(better, old)
    assert result["paired"] and result["difference"] == pytest.approx(1.0) and result["significant"] is True
    drop = ev.compare_tau(old, better)  # a drop is as significant as a rise
    assert drop["difference"] == pytest.approx(-1.0) and drop["ci"][1] < 0 and drop["significant"] is True
    other = [_result("s", i, f"q{i}", [i % 3, 1, 0]) for i in range(30)]
    assert ev.compare_tau(other, old)["paired"] is False


def test_set_statistics_counts_the_extra_round_and_both_calibrations():
    # max_new_tokens 6: rounds emit 2 + 3 -> 1 + 5 = 6 committed, so DeepSpec runs a third round
    extra = _result("s", 0, "p", [1, 2, 3])
    plain = _result("s", 1, "q", [0, 0])
    assert ev.extra_rounds(extra, 6) == 1 and ev.extra_rounds(plain, 6) == 0
    stats = ev.set_statistics([extra, plain], block_size=4, max_new_tokens=6)
    assert stats["tau"] == pytest.approx((2 + 3 + 4 + 1 + 1) / 5)
    assert stats["tau_within_limit"] == pytest.approx((2 + 3 + 1 + 1) / 4) and stats["extra_rounds"] == 1
    assert stats["verify_rate"] == pytest.approx(11 / (5 * 4 + 5))
    assert stats["calibration_per_position_mean"] is None  # no confidences recorded
    scored = [_result("s", i, f"p{i}", [i % 4, (i + 1) % 4]) for i in range(8)]
    for r in scored:
        for record in r.rounds:
            record["confidences"] = [0.9, 0.6, 0.4, 0.2]
        r.rounds[0]["proposed"] = max(r.rounds[0]["accepted"], 1)  # cut proposals: positions get unequal counts
    calibrated = ev.set_statistics(scored, block_size=4, max_new_tokens=100)
    per_position = calibrated["summary"]["calibration"]["survival_per_position"]
    mean = calibrated["calibration_per_position_mean"]
    weights = [p["count"] for p in per_position]
    assert len(set(weights)) > 1
    assert mean["ece"] == pytest.approx(sum(p["ece"] * w for p, w in zip(per_position, weights)) / sum(weights))
    assert mean["auroc"] == 0.5  # one score per position: no ranking within a position (all ties)
    assert calibrated["summary"]["calibration"]["survival"]["auroc"] > 0.5  # pooled: position alone separates


def test_confidence_rules_cut_where_documented():
    confidences = torch.tensor([0.9, 0.8, 0.9, 0.9])
    assert scored_length(confidences, 0.7, "survival") == 2  # 0.9, 0.72, 0.648
    assert scored_length(confidences, 0.7, "per-slot") == 4  # no slot below 0.7
    assert scored_length(torch.tensor([0.9, 0.5, 0.95]), 0.6, "per-slot") == 1


# --- the runtime on the demo pair: length rule and seeds --------------------------------------------------------


@pytest.fixture(scope="module")
def demo_models():
    from dspark_cli.runtime.pair import Pair

    pair = Pair.load(device="cpu", dtype="float32")  # the demo pair
    return pair.target, pair.draft, pair.tokenizer


def test_deepspec_length_rule_runs_one_more_round_at_exactly_the_limit(demo_models):
    from dspark_cli.runtime.settings import SamplingParams
    from loop import generate

    target, draft, tokenizer = demo_models
    ids = tokenizer(DEMO_PROMPTS[0])["input_ids"]

    def run(limit, rule):
        return generate(target, draft, ids, SamplingParams(), block_size=7, max_new_tokens=limit,
                                    length_rule=rule)

    long = run(40, "stop")
    exact = 1 + sum(r.emitted for r in long.stats.rounds[:3])  # committed after 3 rounds
    stop, deepspec = run(exact, "stop"), run(exact, "deepspec")
    assert len(stop.stats.rounds) == 3 and len(deepspec.stats.rounds) == 4
    assert stop.tokens == deepspec.tokens == long.tokens[:exact]  # the extra round's tokens are trimmed
    over = run(exact - 1, "deepspec")  # the third round overshoots: no extra round
    assert len(over.stats.rounds) == 3


# --- the CLI ----------------------------------------------------------------------------------------------------


def eval_cli(*args):
    return runner.invoke(app, ["eval", *args])


def test_demo_run_prints_the_table_and_writes_json_and_markdown(tmp_path):
    run_file, table = tmp_path / "run.json", tmp_path / "table.md"
    result = eval_cli("--limit", "2", "--max-new-tokens", "20", "--json", str(run_file), "--markdown", str(table))
    assert result.exit_code == 0, result.output
    for text in ("eval_code", "eval_prose", "95% CI", "accept_rate@j", "per-position mean (DeepSpec)", "pooled"):
        assert text in result.output
    doc = json.loads(run_file.read_text())
    assert doc["format"] == ev.RUN_FORMAT and doc["settings"]["block_size"] == 7
    assert len(doc["results"]) == 4 and set(doc["statistics"]) == {"eval_code", "eval_prose", "all"}
    stats = doc["statistics"]["all"]
    low, high = stats["tau_ci"]
    assert low <= stats["tau"] <= high and stats["prompts"] == 4
    rounds = [r for p in doc["results"] for r in p["rounds"]]
    assert stats["summary"]["rounds"] == len(rounds)
    assert stats["tau"] == pytest.approx(sum(r["emitted"] for r in rounds) / len(rounds))  # recomputable
    assert all(len(r["confidences"]) == 7 and r["verify"] > 0 for r in rounds)
    markdown = table.read_text().splitlines()
    assert markdown[0].startswith("| dataset | prompts | τ | 95% CI | acc@0")
    assert [line.split(" | ")[0] for line in markdown[2:5]] == ["| eval_code", "| eval_prose", "| all"]


def test_resume_keeps_finished_prompts_and_runs_only_the_missing(tmp_path):
    run_file = tmp_path / "run.json"
    args = ["--data", str(ev.SHIPPED_SETS[0]), "--limit", "3", "--max-new-tokens", "12"]
    assert eval_cli(*args, "--json", str(run_file)).exit_code == 0
    doc = json.loads(run_file.read_text())
    kept = doc["results"][:2]
    doc["results"] = kept  # as if interrupted during the third prompt
    del doc["statistics"]
    run_file.write_text(json.dumps(doc))
    result = eval_cli("--resume", str(run_file))
    assert result.exit_code == 0, result.output
    resumed = json.loads(run_file.read_text())
    assert resumed["results"][:2] == kept and len(resumed["results"]) == 3  # timings of kept prompts untouched
    assert resumed["results"][2]["index"] not in {r["index"] for r in kept}
    conflict = eval_cli("--resume", str(run_file), "--temperature", "1.0")
    assert conflict.exit_code == 2 and "--temperature" in conflict.output


def test_resume_accepts_the_command_line_that_made_the_run(tmp_path):
    """--resume with the original flags resumes, although the run stored resolved values (auto -> dense, cpu,
    float32; a path with a trailing slash), and so does a flag giving the value the run resolved to (--block-size 7
    where the default resolved to 7, --device cpu where auto chose cpu); a different flag is one sentence naming
    it, a default worded as the default (was 'None')."""
    from dspark_cli.runtime.demo import demo_pair

    target, draft = map(str, demo_pair())
    run_file = tmp_path / "run.json"
    original = ["--target", target + "/", "--draft", draft, "--data", str(ev.SHIPPED_SETS[0]), "--limit", "2",
                "--max-new-tokens", "8", "--markov", "auto", "--device", "auto", "--dtype", "auto",
                "--confidence-rule", "survival", "--top-p", "1.0"]
    assert eval_cli(*original, "--json", str(run_file)).exit_code == 0
    doc = json.loads(run_file.read_text())
    assert (doc["settings"]["markov"], doc["settings"]["dtype"]) == ("dense", "float32")  # resolved
    assert doc["settings"]["requested"]["markov"] == "auto"  # as asked
    doc["results"] = doc["results"][:1]
    run_file.write_text(json.dumps(doc))
    same = eval_cli(*[a.rstrip("/") if a == target + "/" else a for a in original], "--resume", str(run_file))
    assert same.exit_code == 0, same.output
    assert len(json.loads(run_file.read_text())["results"]) == 2
    run_file.write_text(json.dumps(doc))
    resolved = ["--block-size", "7", "--device", "cpu", "--markov", "dense", "--dtype", "float32"]
    pinned = eval_cli(*[a for a in original if a not in ("--device", "--markov", "--dtype", "auto")], *resolved,
                      "--resume", str(run_file))
    assert pinned.exit_code == 0, pinned.output
    assert len(json.loads(run_file.read_text())["results"]) == 2
    for flag, value, was in (("--markov", "topk", "--markov 'auto' (resolved to 'dense')"),
                             ("--block-size", "3", "the default --block-size (resolved to 7)"),
                             ("--top-k", "5", "--top-k 0"), ("--dtype", "bfloat16", "--dtype 'auto' (resolved to "
                                                                                   "'float32')")):
        changed = eval_cli(*original, flag, value, "--resume", str(run_file))
        message = " ".join(changed.output.split())
        assert changed.exit_code == 2 and f"was run with {was}, not {flag} " in message, (flag, message)
        assert "None" not in message


def test_a_run_file_from_before_the_sampling_requests_resumes(tmp_path):
    """Run files of dspark 0.1 lack settings.requested, draft_topk, top_p and top_k: EvalRun.load gives them the
    library's defaults (one place), so resume and the resolution read them as any run."""
    run_file = tmp_path / "run.json"
    args = ["--data", str(ev.SHIPPED_SETS[0]), "--limit", "2", "--max-new-tokens", "4"]
    assert eval_cli(*args, "--json", str(run_file)).exit_code == 0
    doc = json.loads(run_file.read_text())
    for key in ("requested", "draft_topk", "top_p", "top_k"):
        del doc["settings"][key]
    doc["results"] = doc["results"][:1]
    run_file.write_text(json.dumps(doc))
    assert ev.EvalRun.load(run_file).settings["top_p"] == 1.0
    resumed = eval_cli("--resume", str(run_file), "--top-k", "0")
    assert resumed.exit_code == 0, resumed.output
    assert len(json.loads(run_file.read_text())["results"]) == 2


def test_the_largest_seed_runs_every_prompt(tmp_path):
    """Prompt i draws with seed + i: at the documented maximum seed, 2^64 - 1, prompt 1 wraps to 0 (was an
    overflow traceback)."""
    run_file = tmp_path / "run.json"
    result = eval_cli("--data", str(ev.SHIPPED_SETS[0]), "--limit", "2", "--max-new-tokens", "4", "--seed",
                      str(2**64 - 1), "--temperature", "1.0", "--json", str(run_file))
    assert result.exit_code == 0, result.output
    assert len(json.loads(run_file.read_text())["results"]) == 2


def test_resume_with_data_may_add_sets_but_not_drop_one_with_results(tmp_path):
    run_file = tmp_path / "run.json"
    code, prose = map(str, ev.SHIPPED_SETS)
    assert eval_cli("--data", code, "--limit", "1", "--max-new-tokens", "4", "--json", str(run_file)).exit_code == 0
    before = run_file.read_text()
    dropped = eval_cli("--resume", str(run_file), "--data", prose)
    assert dropped.exit_code == 2 and "finished prompts of the set eval_code" in dropped.output
    assert run_file.read_text() == before  # untouched
    added = eval_cli("--resume", str(run_file), "--data", code, "--data", prose)
    assert added.exit_code == 0, added.output
    run = ev.EvalRun.load(run_file)  # still a run file dspark reads
    assert [s.name for s in run.sets] == ["eval_code", "eval_prose"] and len(run.results) == 2


def test_a_finished_prompt_counts_only_for_the_same_prompt_text():
    """A result belongs to (set, index, prompt): a set whose prompt at that index changed runs it again and does
    not report the old result (resuming by set and index alone would keep an answer to another prompt)."""
    run = ev.EvalRun({}, [ev.PromptSet("s", "s.txt", ["a", "b"])], [_result("s", 0, "a", [1])])
    changed = ev.PromptSet("s", "s.txt", ["x", "b"])
    assert ev.pending_prompts(run, [changed]) == [("s", 0, "x"), ("s", 1, "b")]
    assert run.results_of(changed) == []
    ran = []
    assert ev.run_set(run, changed, lambda i, text: ran.append(text) or _result("s", i, text, [0])) == 2
    assert ran == ["x", "b"] and [r.prompt for r in run.results_of(changed)] == ["x", "b"]


def test_run_file_is_saved_after_each_prompt(tmp_path, monkeypatch):
    run_file = tmp_path / "run.json"
    calls = []
    original = ev.EvalRun.save

    def save(self, path, statistics=None, replace=True):
        calls.append(len(self.results))
        original(self, path, statistics, replace)
        if calls == [1, 2]:
            raise KeyboardInterrupt  # Ctrl-C during the second prompt's save

    monkeypatch.setattr(ev.EvalRun, "save", save)
    monkeypatch.setattr(ev, "SAVE_SPACING", 0)  # a save after every prompt, whatever a save costs on this machine
    result = eval_cli("--data", str(ev.SHIPPED_SETS[1]), "--limit", "3", "--max-new-tokens", "8", "--json",
                      str(run_file))
    assert result.exit_code == 130 and "--resume" in result.output
    assert calls == [1, 2, 2]  # the interrupted save is written again on the way out
    assert len(json.loads(run_file.read_text())["results"]) == 2  # nothing finished was lost


def test_saves_encode_each_result_once_and_write_what_a_fresh_run_writes(tmp_path):
    sets = [ev.PromptSet("s", "s.txt", [f"p{i}" for i in range(3)])]
    run = ev.EvalRun({"block_size": 4}, sets, [_result("s", 0, "p0", [1, 2])])
    run.save(tmp_path / "a.json")
    run.results.append(_result("s", 1, "p1", [3]))
    run.save(tmp_path / "b.json")
    assert [r for r, _ in run.encoded] == run.results  # both lines cached
    fresh = ev.EvalRun(run.settings, sets, list(run.results))
    fresh.save(tmp_path / "c.json")
    assert (tmp_path / "b.json").read_bytes() == (tmp_path / "c.json").read_bytes()
    run.results[0] = _result("s", 0, "p0", [0, 0, 0])  # a result replaced, not appended: encoded anew
    run.save(tmp_path / "d.json")
    assert [r["rounds"][0]["accepted"] for r in json.loads((tmp_path / "d.json").read_text())["results"]] == [0, 3]


def test_the_saver_keeps_saving_under_a_twentieth_of_the_time(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(ev.time, "perf_counter", lambda: clock[0])
    written = []
    run = ev.EvalRun({"block_size": 4}, [])

    def save(path, replace=True):
        written.append(len(run.results))
        clock[0] += 2.0  # a save takes 2 s

    monkeypatch.setattr(run, "save", save)
    saver = ev.RunSaver(run, tmp_path / "run.json")
    for i in range(4):
        run.results.append(_result("s", i, f"p{i}", [1]))
        saver()
        clock[0] += 10.0  # a prompt takes 10 s; a save 2 s, so the next save waits 40 s after it
    assert written == [1]  # saved at once, then waiting 40 s
    saver()
    assert written == [1, 4] and not saver.unsaved
    saver.flush()
    assert written == [1, 4]  # nothing unsaved: no write
    run.results.append(_result("s", 4, "p4", [1]))
    saver()
    saver.flush()  # what the waiting left unsaved
    assert written == [1, 4, 5]
    ev.RunSaver(run, None)()  # no --json: never writes


def test_compare_and_seeds_follow_the_prompt_index(tmp_path):
    prompts = tmp_path / "twice.txt"
    prompts.write_text(f"{DEMO_PROMPTS[1].splitlines()[0]}\n" * 2)
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    args = ["--data", str(prompts), "--max-new-tokens", "16", "--temperature", "1.0"]
    assert eval_cli(*args, "--json", str(first)).exit_code == 0
    doc = json.loads(first.read_text())
    a, b = doc["results"]
    assert a["prompt"] == b["prompt"] and a["tokens"] != b["tokens"]  # seed + index: duplicates draw differently
    result = eval_cli(*args, "--json", str(second), "--compare", str(first))
    assert result.exit_code == 0, result.output
    assert "paired by prompt" in result.output and "not significant" in result.output
    compared = json.loads(second.read_text())["statistics"]["compare"]["twice"]
    assert compared["difference"] == 0 and compared["paired"]  # same seeds: the same draws


def test_bad_inputs_are_one_sentence(tmp_path):
    missing = eval_cli("--data", str(tmp_path / "none.jsonl"))
    assert missing.exit_code == 2 and "cannot read the prompt set" in missing.output
    half = eval_cli("--target", "x")
    assert half.exit_code == 2 and "both --target and --draft" in half.output
    rule = eval_cli("--confidence-rule", "max")
    assert rule.exit_code == 2 and "survival or per-slot" in rule.output
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for folder in ("a", "b"):
        (tmp_path / folder / "same.txt").write_text("x\n")
    twice = eval_cli("--data", str(tmp_path / "a" / "same.txt"), "--data", str(tmp_path / "b" / "same.txt"))
    assert twice.exit_code == 2 and "share the name" in twice.output
    prompts = tmp_path / "a" / "same.txt"
    over_input = eval_cli("--data", str(prompts), "--json", str(prompts))
    assert over_input.exit_code == 2 and "--json file" in over_input.output and prompts.read_text() == "x\n"


def test_generate_json_carries_rounds_and_the_tau_interval(tmp_path):
    out = tmp_path / "gen.json"
    result = runner.invoke(app, ["generate", "--max-new-tokens", "16", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert len(doc["rounds"]) == len(doc["prompts"])  # one list of round records per prompt
    rounds = [r for prompt_rounds in doc["rounds"] for r in prompt_rounds]
    assert len(rounds) == doc["summary"]["rounds"] and {"accepted", "confidences", "verify"} <= set(rounds[0])
    low, high = doc["tau_ci"]
    assert low <= doc["summary"]["tau"] <= high


def test_thinking_reaches_the_chat_template_only_when_asked():
    from dspark_cli.runtime.decode import chat

    class Template:
        def __init__(self):
            self.options = []

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **options):
            self.options.append(options)
            return messages[0]["content"]

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    tokenizer = Template()
    chat.encode_prompt(tokenizer, "hi", True, "T", thinking=False)
    chat.encode_prompt(tokenizer, "hi", True, "T", thinking=True)
    chat.encode_prompt(tokenizer, "hi", True, "T")  # dspark generate: the template's own default
    assert tokenizer.options == [{"enable_thinking": False}, {"enable_thinking": True}, {}]
