"""The options every command shares (cli/options.py), the byte formatter, the free-memory reading and the
ValueError -> exit 2 mapping."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import typer
from ckpt_factory import write_target_config
from typer.testing import CliRunner

from dspark_cli.cli import app, options, render
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.devices import available_memory, resolve_device, resolve_dtype
from dspark_cli.runtime.units import format_bytes

runner = CliRunner()
wide = CliRunner(env={"COLUMNS": "250"})  # click's usage errors print in a box as wide as the terminal
SEED_MAX = 2**64 - 1


# --- --seed: 0 to 2^64 - 1, the same check in every command -------------------------------------------------------

def _bench(*args: str):
    return wide.invoke(app, ["bench", "markov", "--device", "cpu", *args])


def _train(tmp_path, *args: str):
    return wide.invoke(app, ["train", "--target", str(tmp_path / "no-target"), "--data", str(tmp_path / "no-data"),
                               "--out", str(tmp_path / "out"), "--device", "cpu", *args])


@pytest.mark.parametrize("seed, bound", [("-1", "greater than or equal to 0"),
                                         (str(SEED_MAX + 1), f"less than or equal to {SEED_MAX}")])
def test_bench_refuses_a_seed_out_of_range(seed, bound):
    result = _bench("--seed", seed)
    assert result.exit_code == 2
    assert "Invalid value for '--seed'" in result.output and bound in result.output


@pytest.mark.parametrize("seed, bound", [("-1", "greater than or equal to 0"),
                                         (str(SEED_MAX + 1), f"less than or equal to {SEED_MAX}")])
def test_train_refuses_a_seed_out_of_range(tmp_path, seed, bound):
    result = _train(tmp_path, "--seed", seed)
    assert result.exit_code == 2
    assert "Invalid value for '--seed'" in result.output and bound in result.output
    assert not (tmp_path / "out").exists()


def test_train_accepts_the_largest_seed(tmp_path):
    """2^64 - 1 passes the option check; the run then stops on the missing target, not on the seed."""
    result = _train(tmp_path, "--seed", str(SEED_MAX))
    assert result.exit_code == 2
    assert "Invalid value" not in result.output and "no-target" in result.output


def test_bench_accepts_the_largest_seed():
    result = _bench("--seed", str(SEED_MAX), "--vocab", "64", "--rank", "16", "--block", "2", "--batch", "1",
                    "--topk", "16", "--format", "bf16", "--temperature", "0", "--reps", "1", "--warmup", "0")
    assert result.exit_code == 0, result.output


# --- --json PATH, '-' meaning stdout --------------------------------------------------------------------------

def test_validate_json_file_holds_the_stdout_document(draft_dir, tmp_path):
    on_stdout = runner.invoke(app, ["validate", str(draft_dir), "--json", "-"])
    path = tmp_path / "report.json"
    to_file = runner.invoke(app, ["validate", str(draft_dir), "--json", str(path)])
    assert on_stdout.exit_code == to_file.exit_code == 0
    assert json.loads(path.read_text()) == json.loads(on_stdout.stdout)
    assert "vLLM can load this draft" in to_file.stdout  # a file leaves stdout to the report
    assert "vLLM can load this draft" not in on_stdout.stdout


def test_validate_json_file_may_not_overwrite_the_checkpoint(draft_dir):
    config = draft_dir / "config.json"
    before = config.read_bytes()
    result = runner.invoke(app, ["validate", str(draft_dir), "--json", str(config)])
    assert result.exit_code == 2 and "is inside the checkpoint" in result.stderr
    assert config.read_bytes() == before


def test_serve_json_file_is_a_dry_run(draft_dir, tmp_path, spec):
    target = write_target_config(tmp_path / "target", spec)
    path = tmp_path / "serve.json"
    args = ["serve", "--target", str(target), "--draft", str(draft_dir)]
    on_stdout = runner.invoke(app, [*args, "--json", "-"])
    to_file = runner.invoke(app, [*args, "--json", str(path)])
    assert on_stdout.exit_code == to_file.exit_code == 0
    document = json.loads(path.read_text())
    assert document == json.loads(on_stdout.stdout)
    assert to_file.stdout.strip() == document["command"]  # the command is printed, vLLM is not started


def test_json_needs_a_path(draft_dir):
    result = runner.invoke(app, ["validate", str(draft_dir), "--json"])
    assert result.exit_code == 2 and "--json" in result.output


# --- --device / --dtype -------------------------------------------------------------------------------------

def test_device_names():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="'gpu0' is not a device"):
        resolve_device("gpu0")
    with pytest.raises(DsparkError, match=r"^--device 'gpu0' is not a device; use auto, cpu, cuda or cuda:N\.$"):
        options.torch_device("gpu0")


def test_dtype_names():
    cpu = resolve_device("cpu")
    assert str(resolve_dtype("auto", cpu)) == "torch.float32"
    assert str(resolve_dtype("bf16", cpu)) == "torch.bfloat16"
    with pytest.raises(DsparkError, match=r"^--dtype must be auto, float32, bfloat16 or float16, got 'int8'\.$"):
        options.torch_dtype("int8", cpu)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/meminfo")
def test_free_host_memory_is_in_bytes_for_a_device_name_or_object():
    """bench passes "cpu", train a torch.device; both get the host's MemAvailable (kB in /proc) in bytes."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    by_name, by_device = available_memory("cpu"), available_memory(torch.device("cpu"))
    assert total // 64 < by_name <= total
    assert abs(by_name - by_device) < total // 64


def test_bench_refuses_an_unknown_device():
    result = runner.invoke(app, ["bench", "markov", "--device", "tpu"])
    assert result.exit_code == 2 and "--device 'tpu' is not a device" in result.stderr


# --- one byte formatter -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_bytes, text", [(0, "0 B"), (1023, "1,023 B"), (1000.4, "1,000 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                           (3 * 2**19, "1.5 MiB"), (2**30, "1.0 GiB"), (2**40, "1,024.0 GiB")])
def test_format_bytes(n_bytes, text):
    assert format_bytes(n_bytes) == text


@pytest.mark.parametrize("n_bytes, text", [(999, "999 B"), (1000, "1.0 kB"), (1536, "1.5 kB"),
                                           (2_500_000, "2.5 MB"), (3 * 10**12, "3.0 TB"), (2 * 10**18, "2,000.0 PB")])
def test_format_bytes_decimal(n_bytes, text):
    assert format_bytes(n_bytes, decimal=True) == text


# --- a runtime ValueError is one sentence and exit 2 --------------------------------------------------------

def _raising_app(message: str) -> typer.Typer:
    small = typer.Typer()

    @small.command()
    @render.handle_errors
    def run() -> None:
        raise ValueError(message)

    return small


@pytest.mark.parametrize("message", ["temperature must be >= 0, got -1", "temperature must be >= 0, got -1."])
def test_value_error_is_one_sentence_and_exit_2(message):
    result = runner.invoke(_raising_app(message), [])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: temperature must be >= 0, got -1."
    assert "Traceback" not in result.output


def test_value_error_traceback_with_verbose(monkeypatch):
    monkeypatch.setattr(render.state, "verbose", True)
    result = runner.invoke(_raising_app("bad value"), [])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "error: bad value." in result.stderr


def test_name_flags_prints_the_flag_of_each_setting_the_runtime_names():
    from dspark_cli.cli.render import name_flags

    assert name_flags("out exists; pass the force option to replace it, or the block-size option 2.") == (
        "out exists; pass --force to replace it, or --block-size 2.")
    assert name_flags("the target option's depth; an option of the model") == "--target's depth; an option of the model"
