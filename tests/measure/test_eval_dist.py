"""`dspark eval` on two CPU processes (gloo): prompts shared without overlap or loss, the merged run equal to a
one-process run prompt for prompt, an interrupted two-process run resumed in one process, a failure on rank 1
stopping both with one sentence naming it. Real `dspark eval` subprocesses (torchrun, or ranks started by hand in
separate working folders as on two nodes)."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import ranks

from dspark_cli.runtime.measure import evaluation as ev
from dspark_cli.runtime.measure.run_file import ROUND_TIMES

TIMEOUT_S = 240
TIMES = ("ttft_s", "total_s")


def _eval_args(data: str, out: str, *extra: str, limit: int = 6, tokens: int = 16) -> list[str]:
    return ["-m", "dspark_cli", "eval", "--data", data, "--limit", str(limit), "--max-new-tokens", str(tokens),
            "--device", "cpu", "--dist-timeout", "60", "--json", out, *extra]


def _by_prompt(path: Path) -> dict:
    """Each prompt's result without wall-clock fields, keyed (set, index)."""
    doc = json.loads(path.read_text())
    merged = {}
    for r in doc["results"]:
        rounds = [{k: v for k, v in x.items() if k not in ROUND_TIMES} for x in r["rounds"]]
        merged[r["set_name"], r["index"]] = {**{k: v for k, v in r.items() if k not in TIMES}, "rounds": rounds}
    return merged


def _assert_same_prompts(one: dict, many: dict) -> None:
    assert one.keys() == many.keys()
    for key in one:
        a, b = one[key], many[key]
        assert a["tokens"] == b["tokens"] and a["prompt"] == b["prompt"], key
        assert [(r["proposed"], r["accepted"], r["emitted"]) for r in a["rounds"]] == \
               [(r["proposed"], r["accepted"], r["emitted"]) for r in b["rounds"]], key
        for x, y in zip(a["rounds"], b["rounds"]):  # same math; float32 sums may differ in the last bit
            assert y["confidence_logits"] == pytest.approx(x["confidence_logits"], rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "run.json"
    result = ranks.run(_eval_args(str(ev.SHIPPED_SETS[0]), str(out)), 1, TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return out


def test_prompts_are_shared_without_overlap_or_loss():
    items = list(range(11))
    shares = [ev.shard(items, rank, 3) for rank in range(3)]
    assert sorted(i for share in shares for i in share) == items  # no loss
    assert sum(len(share) for share in shares) == len(set(i for share in shares for i in share))  # no overlap
    assert shares[1] == [1, 4, 7, 10]  # prompt i on rank i mod N, as DeepSpec's evaluator


def test_two_processes_give_the_one_process_run(one_process, tmp_path):
    out = tmp_path / "run.json"
    result = ranks.run(_eval_args(str(ev.SHIPPED_SETS[0]), str(out)), 2, TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("τ per prompt set") == 1  # rank 0 alone prints the table
    _assert_same_prompts(_by_prompt(one_process), _by_prompt(out))
    doc = json.loads(out.read_text())
    assert doc["statistics"]["all"]["prompts"] == 6 and len(doc["results"]) == 6  # each prompt once


def test_interrupted_two_process_run_resumes_in_one(one_process, tmp_path):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    data = str(ev.SHIPPED_SETS[0])
    processes = ranks.start_ranks(folders, _eval_args(data, "run.json"))
    run_file = folders[0] / "run.json"
    deadline = time.monotonic() + TIMEOUT_S
    finished = 0
    while time.monotonic() < deadline and processes[0].poll() is None:
        try:
            finished = len(json.loads(run_file.read_text())["results"])
        except (OSError, ValueError):
            finished = 0
        if finished >= 2:
            break
        time.sleep(0.01)
    for process in processes:
        process.send_signal(signal.SIGINT)  # Ctrl-C in a terminal reaches every process of the job
    results = ranks.finish(processes, TIMEOUT_S)
    for code, stderr in results:
        assert "Traceback" not in stderr, stderr
    assert results[0][0] == 130 and "finished prompts are saved in run.json" in results[0][1], results[0][1]
    assert results[1][0] != 0
    assert not (folders[1] / "run.json").exists()  # rank 1 writes nothing
    kept = len(json.loads(run_file.read_text())["results"])
    assert 2 <= kept < 6
    resumed = ranks.run(["-m", "dspark_cli", "eval", "--resume", "run.json", "--dist-timeout", "60"], 1, TIMEOUT_S,
                        cwd=folders[0])
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_prompts(_by_prompt(one_process), _by_prompt(run_file))


def test_a_failure_on_rank_1_stops_both_ranks(tmp_path):
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    shutil.copy(ev.SHIPPED_SETS[0], folders[0] / "set.jsonl")  # rank 1's node lacks the prompt set
    (code0, stderr0), (code1, stderr1) = ranks.finish(
        ranks.start_ranks(folders, _eval_args("set.jsonl", "run.json")), TIMEOUT_S)
    assert (code0, code1) == (2, 2), (stderr0, stderr1)
    errors1 = [line for line in stderr1.splitlines() if line.startswith("error:")]
    assert len(errors1) == 1 and errors1[0].startswith("error: rank 1 of 2: cannot read the prompt set set.jsonl")
    assert "rank 0 of 2: stopped because rank 1 failed during reading the inputs" in " ".join(stderr0.split())
    assert "Traceback" not in stderr0 + stderr1
    assert not (folders[0] / "run.json").exists()


def test_an_unusable_dist_timeout_is_refused_alike_on_every_rank(tmp_path):
    """--dist-timeout inf overflowed torch's timedelta on every rank (a traceback each); it is checked before any
    rank joins, so each says one sentence and exits 2."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
        shutil.copy(ev.SHIPPED_SETS[0], folder / "set.jsonl")
    args = [*_eval_args("set.jsonl", "run.json"), "--dist-timeout", "inf"]
    (code0, stderr0), (code1, stderr1) = ranks.finish(ranks.start_ranks(folders, args), TIMEOUT_S)
    assert (code0, code1) == (2, 2), (stderr0, stderr1)
    for stderr in (stderr0, stderr1):
        assert "--dist-timeout must be a number of seconds above 0" in stderr and "Traceback" not in stderr
