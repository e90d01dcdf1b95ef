"""`dspark train --shard-target` under torchrun (2 CPU processes, gloo): the frozen target's decoder layers sharded
with FSDP2, each process holding half of every layer, and the training the same as one process's (float32)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import ranks
from safetensors import safe_open
from test_train import tiny_pair  # noqa: F401 - the tiny target + data fixture
from typer.testing import CliRunner

from dspark_cli.cli import app

STEPS = 4
OPTIONS = ["--layers", "1", "--block-size", "4", "--markov-rank", "8", "--batch-size", "3", "--seq-len", "32",
           "--anchors", "6", "--lr", "2e-3", "--seed", "3", "--device", "cpu", "--tau-every", "0",
           "--dist-timeout", "60", "--steps", str(STEPS)]
TIMEOUT_S = 180


def _args(tiny_pair, out: Path, *extra: str) -> list[str]:  # noqa: F811
    return ["-m", "dspark_cli", "train", "--target", str(tiny_pair[0]), "--data", str(tiny_pair[1]), "-o", str(out),
            "--log-jsonl", str(out.parent / f"{out.name}.jsonl"), *OPTIONS, *extra]


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out.parent / f"{out.name}.jsonl").read_text().splitlines()]


def _half_of_every_layer(target: Path) -> int:
    """Weights of one process's shard when every decoder-layer tensor is split in two along its first dimension
    (FSDP2 pads the first dimension to a multiple of the process count; rank 0 holds the larger half)."""
    with safe_open(str(target / "model.safetensors"), framework="pt") as handle:
        shapes = [handle.get_slice(name).get_shape() for name in handle.keys() if ".layers." in name]
    return sum(math.ceil(shape[0] / 2) * math.prod(shape[1:]) for shape in shapes)


def test_sharded_target_trains_like_one_process(tiny_pair, tmp_path):  # noqa: F811
    """Two processes with the target sharded give the one-process run's losses over every step (the all-gathered
    weights are the whole ones bit for bit; the draft's data-parallel summation order is the only difference), and
    each process holds half of every decoder layer."""
    one = CliRunner().invoke(app, _args(tiny_pair, tmp_path / "one")[2:])  # in this process: no launcher needed
    assert one.exit_code == 0, one.output
    two = ranks.run(_args(tiny_pair, tmp_path / "two", "--shard-target"), 2, TIMEOUT_S)
    assert two.returncode == 0, two.stderr
    text = " ".join(two.stdout.split())
    local, total = (int(n.replace(",", "")) for n in re.search(
        r"target sharded across 2 processes \(FSDP2\): 3 decoder layers, ([\d,]+) of their ([\d,]+) weights", text
    ).groups())
    assert local == _half_of_every_layer(tiny_pair[0]) < total
    a, b = _log(tmp_path / "one"), _log(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b):
        for key in ("loss", "ce", "l1", "confidence"):
            assert y[key] == pytest.approx(x[key], rel=1e-6), (x["step"], key)


def test_shard_target_needs_many_processes(tiny_pair, tmp_path):  # noqa: F811
    result = CliRunner().invoke(app, ["train", "--target", str(tiny_pair[0]), "--data", str(tiny_pair[1]), "-o",
                                      str(tmp_path / "out"), "--shard-target", "--device", "cpu"])
    assert result.exit_code == 2
    assert "--shard-target shards the target across the processes of a torchrun job" in " ".join(result.output.split())
