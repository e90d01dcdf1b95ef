"""`dspark bench markov`: every Markov method emits the reference walk's tokens (CPU; Triton kernels under the
interpreter), the token check catches wrong walks, and the command runs end to end with --json and --plot."""

import json
import os
import struct
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ckpt_factory import write_draft
from typer.testing import CliRunner

import dspark_cli
from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.decode import markov as runtime_markov
from dspark_cli.runtime.bench.run import (
    BenchConfig,
    WalkInputs,
    check_tokens,
    make_inputs,
    method_walk,
    random_heads,
    reference_walk,
    weight_bytes,
)
from dspark_cli.runtime.settings import SamplingParams

VOCAB, RANK, BLOCK, BATCH, TOPK = 512, 32, 4, 3, 16
runner = CliRunner()


def heads(dtype: torch.dtype, draft_vocab: int, formats=("bf16", "nvfp4")):
    """Random heads with a logit scale of 0.75 (random_heads draws 1), so a walk that drops the scale is caught."""
    config = BenchConfig(formats=formats, topks=(TOPK,), dtype=dtype, seed=1)
    drawn = random_heads(config, VOCAB, draft_vocab, RANK)
    return {fmt: replace(head, weights=replace(head.weights, scale=0.75)) for fmt, head in drawn.items()}


def inputs(head, temperature: float, seed: int = 0, block: int = BLOCK) -> WalkInputs:
    return make_inputs(head, BATCH, block, TOPK, temperature, torch.Generator().manual_seed(seed))


def every_method(head, x: WalkInputs) -> dict[str, torch.Tensor]:
    """Tokens [B, N] of every way the bench walks x, the Triton kernels included (interpreter on CPU)."""
    w = head.weights
    tokens = {
        "dense": method_walk("dense", w, x),
        "topk": method_walk("topk", w, x),
        "fused twin": method_walk("fused", w, x, triton=False),
        "fused kernel": method_walk("fused", w, x, triton=True),
    }
    if head.fmt == "nvfp4":
        tokens["nvfp4 twin"] = method_walk("nvfp4", w, x, triton=False)
        tokens["nvfp4 kernel"] = method_walk("nvfp4", w, x, triton=True)
    return tokens


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draft_vocab", [VOCAB, 384], ids=["no-d2t", "d2t"])
def test_every_method_emits_the_reference_tokens_in_float32(fmt, temperature, draft_vocab):
    head = heads(torch.float32, draft_vocab, formats=(fmt,))[fmt]
    assert (head.weights.d2t is not None) == (draft_vocab < VOCAB)
    x = inputs(head, temperature)
    reference = reference_walk(head.weights, x)
    for method, tokens in every_method(head, x).items():
        assert torch.equal(tokens, reference), method
        assert check_tokens(head.weights, x, tokens, reference).exact


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_method_agrees_in_bf16_up_to_rounding_near_ties(temperature):
    for head in heads(torch.bfloat16, 384).values():
        x = inputs(head, temperature, seed=3)
        reference = reference_walk(head.weights, x)
        for method, tokens in every_method(head, x).items():
            check = check_tokens(head.weights, x, tokens, reference)
            assert check.ok, (head.fmt, method, check.mismatch)


HIDDEN = 24


def head_typed(head_type: str, dtype: torch.dtype, fmt: str):
    config = BenchConfig(formats=(fmt,), topks=(TOPK,), dtype=dtype, seed=1)
    head = random_heads(config, VOCAB, VOCAB, RANK, head_type, HIDDEN)[fmt]
    return replace(head, weights=replace(head.weights, scale=0.75))


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gated_and_rnn_heads_walk_every_method_but_fused_to_the_reference(head_type, fmt, temperature):
    head = head_typed(head_type, torch.float32, fmt)
    assert head.head_type == head_type and head.hidden_size == HIDDEN
    x = inputs(head, temperature)
    assert x.hidden.shape == (BATCH, BLOCK, HIDDEN)
    reference = reference_walk(head.weights, x)
    methods = ["dense", "topk"] + (["nvfp4"] if fmt == "nvfp4" else [])
    for method in methods:
        tokens = method_walk(method, head.weights, x)
        assert torch.equal(tokens, reference), method
        assert check_tokens(head.weights, x, tokens, reference).exact
    if fmt == "nvfp4":
        assert torch.equal(method_walk("nvfp4", head.weights, x, triton=True), reference)  # the kernel (interpreter)
    vanilla = replace(head.weights, head=None)  # the same W1, W2 without the head: another walk
    assert not torch.equal(reference_walk(vanilla, x), reference)
    check = check_tokens(head.weights, x, reference_walk(vanilla, x), reference)
    assert not check.ok  # the vanilla tokens are not the best along the head's latents


def test_a_gated_head_bench_has_no_fused_rows_and_counts_its_projections(tmp_path):
    out_json = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", "--vocab", "256", "--rank", "16",
                                 "--head-type", "gated", "--hidden", "32", "--block", "3", "--batch", "2", "--topk",
                                 "8", "--temperature", "0", "--reps", "1", "--warmup", "0", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out_json.read_text())
    assert (doc["head_type"], doc["hidden_size"], doc["tokens_ok"]) == ("gated", 32, True)
    assert {r["method"] for r in doc["rows"]} == {"dense", "select", "topk", "nvfp4"}
    assert "gated head H=32" in " ".join(result.output.split())
    vanilla = head_typed("gated", torch.bfloat16, "bf16")
    plain = replace(vanilla, weights=replace(vanilla.weights, head=None))
    projections = (HIDDEN + RANK) * RANK * 2 + RANK * 2  # gate_proj weight and bias, bf16
    assert weight_bytes("topk", vanilla, 2, BLOCK, TOPK) - weight_bytes("topk", plain, 2, BLOCK, TOPK) == \
        BLOCK * projections


def test_the_walk_depends_on_the_previous_token():
    """Guards the test inputs: the Markov bias must change picks, or a walk that ignores W1 would pass."""
    head = heads(torch.float32, VOCAB, formats=("bf16",))["bf16"]
    x = inputs(head, 0.0)
    no_markov = x.values.argmax(-1)  # [B, N] candidate index of the best base logit
    picked = x.cand_ids.gather(-1, no_markov[..., None])[..., 0]
    assert not torch.equal(picked, reference_walk(head.weights, x))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_batched_methods_match_the_runtime_strategies_per_request(temperature):
    head = heads(torch.float32, 384, formats=("nvfp4",))["nvfp4"]
    x = inputs(head, temperature)
    params = SamplingParams(temperature=temperature)
    batched = method_walk("dense", head.weights, x)
    for b in range(BATCH):
        noise = None if x.noise is None else x.noise[b : b + 1]
        for strategy in ("dense", "topk", "nvfp4", "fused"):
            result = runtime_markov.markov_walk(strategy, head.weights, x.base[b : b + 1], x.first_prev[b : b + 1],
                                                params, noise=noise, draft_topk=TOPK)
            assert torch.equal(result.tokens[0], batched[b]), (b, strategy)


def test_check_tokens_flags_a_wrong_walk():
    head = heads(torch.float32, VOCAB, formats=("bf16",))["bf16"]
    x = inputs(head, 0.0)
    reference = reference_walk(head.weights, x)
    shifted = WalkInputs(x.base, x.values, x.cand_ids, x.first_prev.roll(1), x.temperature, None, None)
    wrong_prev = reference_walk(head.weights, shifted)  # a walk started from other anchors
    check = check_tokens(head.weights, x, wrong_prev, reference)
    assert not check.ok and "position" in check.mismatch
    not_a_candidate = reference.clone()
    not_a_candidate[0, 1] = int(torch.isin(torch.arange(VOCAB), x.cand_ids[0, 1], invert=True).nonzero()[0])
    assert "not a candidate" in check_tokens(head.weights, x, not_a_candidate, reference).mismatch


def test_check_tokens_accepts_a_tie_broken_the_other_way():
    head = heads(torch.float32, VOCAB, formats=("bf16",))["bf16"]
    x = inputs(head, 0.0, block=1)
    w2 = head.weights.w2
    first, second = x.cand_ids[0, 0, 0], x.cand_ids[0, 0, 1]
    w2[second] = w2[first]
    x.values[0, 0, 1] = x.values[0, 0, 0] = x.values[0, 0].max() + 50  # the two best, exactly tied
    reference = reference_walk(head.weights, x)
    other = reference.clone()
    other[0, 0] = second if reference[0, 0] == first else first
    check = check_tokens(head.weights, x, other, reference)
    assert check.ok and not check.exact and check.near_ties == 1


def test_weight_bytes_per_method():
    head = heads(torch.bfloat16, VOCAB)["nvfp4"]
    w1 = BLOCK * BATCH * RANK * 2
    assert weight_bytes("dense", head, BATCH, BLOCK, TOPK) == w1 + BLOCK * VOCAB * RANK * 2
    assert weight_bytes("topk", head, BATCH, BLOCK, TOPK) == w1 + BLOCK * BATCH * TOPK * RANK * 2
    nvfp4 = w1 + BLOCK * BATCH * TOPK * (RANK // 2 + RANK // 16)  # nibbles + one e4m3 scale per 16
    assert weight_bytes("nvfp4", head, BATCH, BLOCK, TOPK) == weight_bytes("fused", head, BATCH, BLOCK, TOPK) == nvfp4


def read_png(path) -> tuple[int, int, bytes]:
    """Validate signature, chunk CRCs and the IDAT stream of an 8-bit RGB PNG -> width, height, raw scanlines."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    position, chunks = 8, {}
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind, body = data[position + 4 : position + 8], data[position + 8 : position + 8 + length]
        (crc,) = struct.unpack(">I", data[position + 8 + length : position + 12 + length])
        assert crc == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        position += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + 3 * width)
    return width, height, raw


def test_bench_command_end_to_end_on_cpu(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", "--vocab", "512", "--draft-vocab", "384",
                                 "--rank", "32", "--block", "3", "--batch", "1,2", "--topk", "8", "--reps", "2",
                                 "--warmup", "0", "--json", str(out_json), "--plot", str(out_png)])
    assert result.exit_code == 0, result.output
    assert "4 fused walk" in result.output and "not timed" in result.output
    doc = json.loads(out_json.read_text())
    assert doc["tokens_ok"] and doc["d2t"] and (doc["vocab"], doc["draft_vocab"], doc["rank"]) == (512, 384, 32)
    rows = doc["rows"]
    for fmt in ("bf16", "nvfp4"):
        for temperature in (0.0, 1.0):
            for batch in (1, 2):
                here = {(r["method"], r["mode"]) for r in rows
                        if (r["format"], r["temperature"], r["batch"]) == (fmt, temperature, batch)}
                expected = {("dense", "eager"), ("select", "eager"), ("topk", "eager"), ("fused", "eager"),
                            ("fused", "interpreter")}
                if fmt == "nvfp4":
                    expected |= {("nvfp4", "eager"), ("nvfp4", "interpreter")}
                assert here == expected
    for row in rows:
        timed = row["mode"] != "interpreter"
        assert (row["timing"] is not None) == timed
        if row["method"] != "select":
            assert row["tokens"]["ok"]
        if timed and row["method"] != "select":
            assert row["weight_bytes"] > 0 and row["lower_bound_us"] > 0 and row["speedup_vs_dense"] > 0
    width, height, raw = read_png(out_png)
    assert height == 4 * 420  # one panel per (format, temperature)
    blue = bytes((31, 119, 180))  # the first series' colour
    assert blue in raw


def test_bench_command_from_a_checkpoint(tmp_path, spec):
    draft = write_draft(tmp_path / "draft", spec.with_(draft_vocab_size=200))
    out_json = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "markov", "--draft", str(draft), "--device", "cpu", "--block", "2",
                                 "--batch", "2", "--topk", "8", "--temperature", "0", "--reps", "1", "--warmup", "0",
                                 "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out_json.read_text())
    assert (doc["vocab"], doc["draft_vocab"], doc["rank"], doc["d2t"]) == (spec.vocab_size, 200, spec.markov_rank, True)
    assert doc["tokens_ok"] and str(draft) in doc["source"]
    assert {r["format"] for r in doc["rows"]} == {"bf16", "nvfp4"}


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
def test_bench_command_from_a_gated_or_rnn_checkpoint(tmp_path, spec, head_type):
    draft = write_draft(tmp_path / "draft", spec.with_(markov_head_type=head_type))
    out_json = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "markov", "--draft", str(draft), "--device", "cpu", "--block", "2",
                                 "--batch", "2", "--topk", "8", "--temperature", "0,1", "--reps", "1", "--warmup", "0",
                                 "--format", "bf16", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out_json.read_text())
    assert (doc["head_type"], doc["hidden_size"], doc["tokens_ok"]) == (head_type, spec.hidden_size, True)
    assert f"{head_type} head over hidden size {spec.hidden_size}" in doc["source"]
    assert "fused" not in {r["method"] for r in doc["rows"]}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft", "somewhere", "--vocab", "100"], "--draft takes the shapes"),
        (["--draft", "somewhere", "--head-type", "gated"], "--draft takes the shapes and the head type"),
        (["--vocab", "64", "--rank", "16", "--head-type", "lstm"], "--head-type must be one of vanilla, gated, rnn"),
        (["--vocab", "64", "--rank", "16", "--hidden", "64"], "--hidden sizes the hidden states"),
        (["--vocab", "64", "--rank", "16", "--topk", "100"], "exceeds the draft vocabulary"),
        (["--vocab", "64", "--rank", "24"], "multiple of 16"),
        (["--vocab", "64", "--rank", "16", "--format", "fp8"], "--format takes"),
        (["--vocab", "64", "--rank", "16", "--batch", "0,2"], "--batch takes positive integers"),
        (["--vocab", "64", "--rank", "16", "--temperature", "-1"], "--temperature takes"),
        (["--vocab", "64", "--rank", "16", "--temperature", "nan"], "--temperature takes finite numbers"),
        (["--vocab", "64", "--rank", "16", "--temperature", "0,inf"], "--temperature takes finite numbers"),
        (["--vocab", "64", "--rank", "16", "--peak-gbps", "inf"], "--peak-gbps must be a finite number"),
        (["--vocab", "64", "--rank", "16", "--seed", str(2**64)], "--seed"),
        (["--vocab", "64", "--rank", "16", "--seed", "-1"], "--seed"),
        (["--vocab", "10000000000", "--rank", "16"], "GiB of Markov weights for V=10000000000"),
        (["--batch", "100000"], "of logit rows for batch 100000 x block 7"),
        (["--vocab", "64", "--rank", "16", "--topk", "8", "--block", "1000000000"], "x block 1000000000"),
    ],
)
def test_bad_options_are_one_sentence_and_exit_2(args, message):
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split()) and "Traceback" not in result.output


def test_a_method_with_wrong_tokens_is_not_timed_and_the_command_exits_1(tmp_path, monkeypatch):
    from dspark_cli.runtime.bench import run as bench

    walk = bench.method_walk  # dense swaps the requests' tokens; the other methods are the runtime's

    def swapped_dense(method, w, x, triton=None):
        tokens = walk(method, w, x, triton)
        return tokens.flip(0) if method == "dense" else tokens

    monkeypatch.setattr(bench, "method_walk", swapped_dense)
    out_json = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", "--vocab", "256", "--rank", "16", "--block",
                                 "2", "--batch", "3", "--topk", "8", "--format", "bf16", "--temperature", "0",
                                 "--reps", "1", "--warmup", "0", "--json", str(out_json)])
    assert result.exit_code == 1 and "MISMATCH" in result.output
    doc = json.loads(out_json.read_text())
    assert not doc["tokens_ok"]
    for row in doc["rows"]:
        if row["method"] == "dense":
            assert not row["tokens"]["ok"] and row["timing"] is None
        elif row["method"] != "select":
            assert row["tokens"]["ok"] and (row["timing"] is not None or row["mode"] == "interpreter")


def test_bench_from_a_checkpoint_runs_as_a_fresh_process_on_cpu(tmp_path, spec):
    """The README example in a new process: torch imports triton (from torch._dynamo, while the draft is
    built) before dspark's kernels are imported, so the interpreter must be chosen before that import."""
    draft = write_draft(tmp_path / "draft", spec)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(Path(dspark_cli.__file__).parents[1]), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-m", "dspark_cli", "bench", "markov", "--draft", str(draft), "--device",
                             "cpu", "--block", "2", "--batch", "1", "--topk", "8", "--temperature", "0", "--reps",
                             "1", "--warmup", "0", "--format", "bf16"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 fused walk" in result.stdout and "kernel*" in result.stdout


def test_the_memory_check_compares_the_estimate_with_the_free_memory(monkeypatch):
    from dspark_cli.runtime.bench import inputs as bench_inputs  # where the memory check looks up available_memory

    config = BenchConfig(batches=(1, 8), block=7, formats=("bf16",))
    weights, inputs = bench_inputs.memory_needed(config, 1000, 500, 64)
    assert weights == (1000 + 500) * 64 * 6 + 500 * 64 * 6
    assert inputs == 8 * 7 * 500 * bench_inputs.INPUT_BYTES_PER_LOGIT
    monkeypatch.setattr(bench_inputs, "available_memory", lambda device: weights + inputs)
    bench_inputs.random_heads(config, 1000, 500, 64)  # fits exactly
    monkeypatch.setattr(bench_inputs, "available_memory", lambda device: weights + inputs - 1)
    with pytest.raises(DsparkError, match="needs about"):
        bench_inputs.random_heads(config, 1000, 500, 64)


def test_a_seed_near_two_to_the_64_runs(tmp_path):
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", "--vocab", "64", "--rank", "16", "--block",
                                 "2", "--batch", "3", "--topk", "8", "--format", "bf16", "--temperature", "0,1",
                                 "--reps", "1", "--warmup", "0", "--seed", str(2**64 - 1)])
    assert result.exit_code == 0, result.output


def test_a_checkpoint_whose_markov_head_holds_nan_is_one_sentence(tmp_path, spec):
    def poison(tensors):
        w2 = tensors["markov_head.markov_w2.weight"].clone()
        w2[3, 0] = float("nan")
        return {**tensors, "markov_head.markov_w2.weight": w2}

    draft = write_draft(tmp_path / "draft", spec, mutate=poison)
    result = runner.invoke(app, ["bench", "markov", "--draft", str(draft), "--device", "cpu", "--block", "2",
                                 "--batch", "1", "--topk", "8", "--reps", "1", "--warmup", "0"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "markov_w2 hold NaN or inf values" in " ".join(result.stderr.split())


def test_a_dflash2_checkpoint_is_refused_naming_its_path_selector(tmp_path, spec):
    """bench markov times Markov heads; a DFlash2 draft has a path selector instead (not "a DFlash draft")."""
    draft = write_draft(tmp_path / "draft", spec.with_(family="dflash2", markov_rank=0, confidence=False))
    result = runner.invoke(app, ["bench", "markov", "--draft", str(draft), "--device", "cpu", "--reps", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"{draft} is a DFlash2 draft: its path selector, not a Markov head, picks the block's tokens, and bench "
            "markov times Markov heads only") in " ".join(result.stderr.split())


# --- interleaved timing (a fake clock: no timing asserts) ---------------------------------------------------------


def test_interleaved_order_rotates_the_start_every_round():
    from dspark_cli.runtime.bench.run import interleaved_order

    assert interleaved_order(3, 4) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert interleaved_order(1, 2) == [[0], [0]]


def test_time_interleaved_rotates_calls_and_reports_min_median_and_spread():
    from dspark_cli.runtime.bench.run import SPREAD_LIMIT, time_interleaved

    now = [0.0]
    calls: list[str] = []
    durations = {"a": iter([9.0, 1e-3, 2e-3, 3e-3]), "b": iter([9.0, 1e-3, 1e-3, 1e-3])}  # seconds; warm-up first

    def fake(name):
        def run():
            calls.append(name)
            now[0] += next(durations[name])

        return run

    noisy, steady = time_interleaved([fake("a"), fake("b")], "cpu", reps=3, warmup=1, clock=lambda: now[0])
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up round, then rounds starting at 0, 1, 0
    assert (noisy.min_us, noisy.median_us, noisy.reps) == (pytest.approx(1000), pytest.approx(2000), 3)
    assert noisy.p90_us == pytest.approx(2800) and noisy.spread == pytest.approx(1.8) and noisy.too_noisy
    assert steady.spread == pytest.approx(0) and not steady.too_noisy
    assert 0 < SPREAD_LIMIT < 1.8


def test_timing_flags_a_spread_over_the_limit():
    from dspark_cli.runtime.bench.run import SPREAD_LIMIT, Timing

    at_limit = Timing(median_us=110, p10_us=100, p90_us=100 * (1 + SPREAD_LIMIT), reps=10, min_us=100)
    over = Timing(median_us=110, p10_us=100, p90_us=100 * (1 + SPREAD_LIMIT) + 1, reps=10, min_us=100)
    assert not at_limit.too_noisy and over.too_noisy
    assert over.to_dict()["too_noisy"] and over.to_dict()["min_us"] == 100


def test_both_formats_of_a_batch_are_timed_in_one_interleaved_call(monkeypatch, tmp_path):
    from dspark_cli.runtime.bench import run as bench
    from dspark_cli.runtime.bench.run import Timing

    calls: list[int] = []

    def fake_time_interleaved(fns, device, reps, warmup):
        calls.append(len(fns))
        number = len(calls)  # a noisy timing (spread 100 %), its median numbered by the call that produced it
        return [Timing(median_us=number, p10_us=index + 1, p90_us=2 * (index + 1), reps=reps, min_us=index + 1)
                for index in range(len(fns))]

    monkeypatch.setattr(bench, "time_interleaved", fake_time_interleaved)
    out_json = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "markov", "--device", "cpu", "--vocab", "256", "--rank", "16", "--block",
                                 "2", "--batch", "1,2", "--topk", "8", "--temperature", "0,1", "--reps", "3",
                                 "--warmup", "0", "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out_json.read_text())["rows"]
    assert sum(n > 1 for n in calls) == 4  # one per (temperature, batch)
    for temperature in (0.0, 1.0):
        for batch in (1, 2):
            timed = [r for r in rows if (r["temperature"], r["batch"]) == (temperature, batch) and r["timing"]]
            assert {r["format"] for r in timed} == {"bf16", "nvfp4"}
            assert len({r["timing"]["median_us"] for r in timed}) == 1  # all from the same interleaved call
            assert len(timed) == calls[int(timed[0]["timing"]["median_us"]) - 1]
            for row in timed:  # speedups are ratios of the min times
                if row["method"] != "select":
                    dense = next(r for r in timed if r["method"] == "dense" and r["format"] == row["format"])
                    assert row["speedup_vs_dense"] == dense["timing"]["min_us"] / row["timing"]["min_us"]
    assert [r["format"] for r in rows] == sorted((r["format"] for r in rows), key=("bf16", "nvfp4").index)
    assert all(r["timing"]["too_noisy"] and r["timing"]["spread"] == 1.0 for r in rows if r["timing"])
    assert "100% !" in result.output and "too noisy to compare" in result.output
