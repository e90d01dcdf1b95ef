"""`dspark train` on two CPU processes (gloo): trains like one process with the same global batch, rank 0 alone
reports and writes, an interrupted run resumes in one process, and a failure on rank 1 stops both ranks.

The runs are real `dspark train` subprocesses: under torchrun (`python -m torch.distributed.run`), or started by
hand with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set per process, each in its own working folder, as two
nodes with their own disks would be (relative paths then differ between the ranks)."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
import ranks
import torch
from safetensors.torch import load_file
from test_train import tiny_pair  # noqa: F401 - the tiny target + data fixture

from dspark_cli.runtime.train.trainer import latest_checkpoint

STEPS = 16  # the interrupted run must still be running when rank 0 writes checkpoint-2
BLOCKS = 3 * 6  # batch x anchors: every row of the global batch is trained once per step
OPTIONS = ["--layers", "1", "--block-size", "4", "--markov-rank", "8", "--batch-size", "3", "--seq-len", "32",
           "--anchors", "6", "--lr", "2e-3", "--seed", "3", "--save-every", "2", "--device", "cpu",
           "--dist-timeout", "60"]
TIMEOUT_S = 180


def _train_args(target: Path, data: Path | str, out: Path | str, *extra: str, steps: int = STEPS) -> list[str]:
    return ["-m", "dspark_cli", "train", "--target", str(target), "--data", str(data), "-o", str(out),
            "--steps", str(steps), *OPTIONS, *extra]


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _assert_same_trajectory(one: list[dict], many: list[dict], rtol: float) -> None:
    assert [r["step"] for r in many] == [r["step"] for r in one]
    for a, b in zip(one, many):
        assert b["blocks"] == a["blocks"] == BLOCKS, (a["step"], b["blocks"])
        for key in ("loss", "ce", "l1", "confidence", "expected_length"):
            assert b[key] == pytest.approx(a[key], rel=rtol), (a["step"], key)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name].float(), a[name].float(), rtol=rtol, atol=atol, msg=name)


# bf16 output (model.safetensors): values that differ in the last fp32 bits may round to neighbouring bf16 values
BF16 = {"rtol": 2 ** -7, "atol": 1e-5}


@pytest.fixture(scope="module")
def one_process(tiny_pair, tmp_path_factory) -> Path:  # noqa: F811
    """The reference: the same training in one process."""
    out = tmp_path_factory.mktemp("one") / "out"
    args = _train_args(tiny_pair[0], tiny_pair[1], out, "--log-jsonl", str(out.parent / "log.jsonl"))
    result = ranks.run(args, 1, TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return out


def test_two_processes_train_like_one(tmp_path, tiny_pair, one_process):  # noqa: F811
    """torchrun with 2 processes: the same loss trajectory (every row once per step) and the same weights as one
    process with the same global batch of 3 (1 + 2 rows: the shares differ); rank 0 alone prints and writes."""
    out = tmp_path / "out"
    result = ranks.run(_train_args(tiny_pair[0], tiny_pair[1], out, "--log-jsonl", str(tmp_path / "log.jsonl")), 2,
                       TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("training tokens") == 1 and result.stdout.count("draft written to") == 1, \
        result.stdout
    assert result.stdout.count("training as 2 processes (backend gloo)") == 1, result.stdout
    _assert_same_trajectory(_log(one_process.parent / "log.jsonl"), _log(tmp_path / "log.jsonl"), rtol=1e-5)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in one_process.iterdir())
    for step in range(2, STEPS, 2):
        name = f"checkpoint-{step}/trainer_state.safetensors"
        _assert_same_weights(load_file(str(one_process / name)), load_file(str(out / name)), rtol=1e-5, atol=1e-6)
        state = json.loads((out / f"checkpoint-{step}/trainer_state.json").read_text())
        assert state["step"] == step
    _assert_same_weights(load_file(str(one_process / "model.safetensors")), load_file(str(out / "model.safetensors")),
                         **BF16)


def test_interrupted_two_process_run_resumes_in_one(tmp_path, tiny_pair, one_process):  # noqa: F811
    """Two ranks (separate working folders, `-o out` relative) are stopped with Ctrl-C once rank 0 has written a
    checkpoint: both exit non-zero without a traceback, rank 1 wrote nothing, and one process resumes from the
    checkpoint to the same end as the uninterrupted one-process run."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    processes = ranks.start_ranks(folders, _train_args(tiny_pair[0], tiny_pair[1], "out", steps=STEPS))
    checkpoint = folders[0] / "out" / "checkpoint-2" / "trainer_state.json"
    deadline = time.monotonic() + TIMEOUT_S
    while not checkpoint.exists() and time.monotonic() < deadline and processes[0].poll() is None:
        time.sleep(0.01)
    for process in processes:
        process.send_signal(signal.SIGINT)  # what Ctrl-C in a terminal does to every process of the job
    results = ranks.finish(processes, TIMEOUT_S)
    assert checkpoint.exists(), results[0][1]
    for code, stderr in results:
        assert code != 0 and "Traceback" not in stderr, stderr
    assert not (folders[1] / "out").exists()  # rank 1 writes nothing

    out = folders[0] / "out"
    resume_from = latest_checkpoint(out)
    start = int(resume_from.name.removeprefix("checkpoint-"))
    result = ranks.run(_train_args(tiny_pair[0], tiny_pair[1], out, "--resume", str(resume_from), "--log-jsonl",
                                   str(tmp_path / "log.jsonl")), 1, TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    reference = [r for r in _log(one_process.parent / "log.jsonl") if r["step"] > start]
    _assert_same_trajectory(reference, _log(tmp_path / "log.jsonl"), rtol=1e-4)
    _assert_same_weights(load_file(str(one_process / "model.safetensors")), load_file(str(out / "model.safetensors")),
                         **BF16)


def test_a_failure_on_rank_1_stops_both_ranks(tmp_path, tiny_pair):  # noqa: F811
    """Rank 1's node lacks the training data (a relative --data path): rank 1 says so, naming itself, rank 0 says
    it stopped because of rank 1, both exit with the error's code and neither waits for the other."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    shutil.copytree(tiny_pair[1], folders[0] / "data")
    results = ranks.finish(ranks.start_ranks(folders, _train_args(tiny_pair[0], "data", "out")), TIMEOUT_S)
    (code0, stderr0), (code1, stderr1) = results
    assert (code0, code1) == (2, 2), results
    assert _error_lines(stderr1) == ["error: rank 1 of 2: data: no such file or folder; pass text files, JSONL "
                                     "files or folders with --data."], stderr1
    assert len(_error_lines(stderr0)) == 1 and "rank 0 of 2: stopped because rank 1 failed" in stderr0, stderr0
    assert "Traceback" not in stderr0 + stderr1


AGREEMENT = """
import json
import torch
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.distributed import PeerFailed, context_from_env, start, stop

ctx = context_from_env()
start(ctx, torch.device("cpu"), 30)


def outcome(work):
    try:
        work()
        return "ok"
    except PeerFailed as error:
        return f"peer {error.exit_code}: {error.message}"
    except DsparkError as error:
        return f"own {error.exit_code}: {error.message}"


def fail_on_rank_1(error):
    def work():
        if ctx.rank == 1:
            raise error
    return work


report = {"rows": {size: [ctx.rows(size).start, ctx.rows(size).stop] for size in range(2, 8)},
          "sum": ctx.sum(torch.tensor([1.0 + ctx.rank])).item(),
          "same": outcome(lambda: ctx.same_everywhere([5, 7], "x")),
          "differ": outcome(lambda: ctx.same_everywhere([5, ctx.rank], "training data")),
          "bad_input": outcome(lambda: ctx.together(fail_on_rank_1(DsparkError("row 7 is bad.")), "step 3")),
          "crash": outcome(lambda: ctx.together(fail_on_rank_1(ValueError("boom")), "step 4")),
          "after": ctx.sum(torch.ones(1)).item()}
stop(ctx)
print(json.dumps(report))
"""


def test_ranks_share_rows_and_agree_on_failures(tmp_path):
    """The collective helpers on 2 gloo processes: the batch rows are shared without overlap or loss, differing
    runs are refused, and a failure on rank 1 in the middle of training (a bad input, a crash) stops both ranks at
    the same collective with the failing rank named and its exit code, after which collectives still line up."""
    processes = ranks.start_ranks([tmp_path, tmp_path], ["-c", AGREEMENT])
    outputs = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
        assert process.returncode == 0, stderr
        outputs.append(json.loads(stdout))
    rank0, rank1 = outputs
    for size in range(2, 8):
        (a, b), (c, d) = rank0["rows"][str(size)], rank1["rows"][str(size)]
        assert (a, b, c, d) == (0, size // 2, size // 2, size), size
    assert rank0["sum"] == rank1["sum"] == 3.0 and rank0["after"] == rank1["after"] == 2.0
    assert rank0["same"] == rank1["same"] == "ok"
    assert rank0["differ"] == ("own 2: rank 0 of 2: the 2 processes do not have the same training data; every "
                               "process must be started with the same options and read the same files.")
    assert rank1["differ"].startswith("peer 2: ")
    assert rank1["bad_input"] == "own 2: rank 1 of 2: row 7 is bad."
    assert rank0["bad_input"] == ("peer 2: rank 0 of 2: stopped because rank 1 failed during step 3 (its error is "
                                  "above).")
    assert rank1["crash"] == "own 1: rank 1 of 2 failed during step 4: ValueError: boom"
    assert rank0["crash"].startswith("peer 1: rank 0 of 2: stopped because rank 1 failed during step 4")
