"""One short check of dspark's Triton kernels and `dspark bench markov` on a CUDA machine (under 10 minutes).

    python scripts/gpu_check.py [--out DIR]      # DIR defaults to $OUT, else ./gpu_check_out

Needs torch with CUDA, triton, typer and rich (not ModelOpt); dspark is imported from src/ when not installed.
1. Every Triton kernel against its torch twin at full size (V = Vd = 151936, r = 256, k = 64, N = 7,
   B = 1, 2, 4, 8, 16, 32): quantize_nvfp4 on CUDA vs CPU (bit-identical), dequantize_rows_triton,
   nvfp4_gathered_bias (plain and strided logit rows, and k = 4096), markov_walk_triton (bf16 and NVFP4 W2,
   greedy and Gumbel, with and without d2t), a CUDA-graph replay of the walk, and the gated and RNN heads'
   walks through nvfp4_gathered_bias (their latents u_k = head.step(...) instead of W1[prev]) against the torch twin.
2. `dspark bench markov --device cuda --batch 1,8,32,128 --topk 64 --format bf16,nvfp4 --temperature 0,1` with
   --json and --plot into DIR, then the fused walk against the graphed per-position NVFP4 path and its lower bound;
   then the same bench with a random gated and a random RNN head (B = 1, 8, 32, greedy; no fused rows).
Prints everything; exit code 1 if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402

from dspark_cli.kernels.markov import (  # noqa: E402
    markov_walk_reference,
    markov_walk_triton,
    nvfp4_gathered_bias,
    nvfp4_gathered_bias_reference,
)
from dspark_cli.kernels.nvfp4 import dequantize_rows_nvfp4, dequantize_rows_triton, quantize_nvfp4  # noqa: E402
from dspark_cli.runtime.bench.run import BenchConfig, capture_graph, check_tokens, make_inputs, random_heads  # noqa: E402
from dspark_cli.runtime.decode.markov import markov_walk  # noqa: E402
from dspark_cli.runtime.settings import SamplingParams  # noqa: E402
from dspark_cli.runtime.model.heads import HEADS  # noqa: E402

VOCAB, RANK, TOPK, BLOCK = 151936, 256, 64, 7
HIDDEN = 4096  # the draft hidden size the gated / RNN heads read
BATCHES = (1, 2, 4, 8, 16, 32)
BENCH_TIMEOUT_S = 360
HEAD_BENCH_TIMEOUT_S = 90  # each of the gated and RNN head benches
failures: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def within_one_bf16_step(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= torch.finfo(torch.bfloat16).eps * torch.maximum(a.abs(), b.abs())).all())


def check_quantize(w2: torch.Tensor):
    weight = quantize_nvfp4(w2)
    on_cpu = quantize_nvfp4(w2.cpu())
    same = (torch.equal(weight.packed.cpu(), on_cpu.packed)
            and torch.equal(weight.scale.view(torch.uint8).cpu(), on_cpu.scale.view(torch.uint8))
            and torch.equal(weight.global_scale.cpu(), on_cpu.global_scale))
    report("quantize_nvfp4 CUDA == CPU (bit-identical)", same)
    return weight


def check_dequantize(weight, gen: torch.Generator) -> None:
    rows = torch.randint(0, VOCAB, (max(BATCHES) * BLOCK * TOPK,), generator=gen, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        ours, theirs = dequantize_rows_triton(weight, rows, dtype), dequantize_rows_nvfp4(weight, rows, dtype)
        report(f"dequantize_rows_triton == reference, {dtype}, {rows.numel()} rows", torch.equal(ours, theirs))


def check_gathered_bias(weight, gen: torch.Generator) -> None:
    for batch, topk in [(batch, TOPK) for batch in BATCHES] + [(2, 4096)]:
        embed = torch.randn(batch, RANK, generator=gen, device="cuda").bfloat16()
        values = torch.randn(batch, topk, generator=gen, device="cuda").bfloat16()
        index = torch.rand(batch, VOCAB, generator=gen, device="cuda").topk(topk, dim=-1).indices  # distinct ids
        values_before = values.clone()
        buffer = torch.full((batch, BLOCK, VOCAB), float("-inf"), dtype=torch.bfloat16, device="cuda")
        for name, ours in (("row", torch.full((batch, VOCAB), float("-inf"), dtype=torch.bfloat16, device="cuda")),
                           ("strided buf[:, 3]", buffer[:, 3])):
            theirs = torch.full((batch, VOCAB), float("-inf"), dtype=torch.bfloat16, device="cuda")
            nvfp4_gathered_bias(embed, weight, values, index, ours, 0.75)
            nvfp4_gathered_bias_reference(embed, weight, values, index, theirs, 0.75)
            selected = torch.zeros(batch, VOCAB, dtype=torch.bool, device="cuda").scatter_(1, index, True)
            ok = (within_one_bf16_step(ours[selected], theirs[selected])
                  and bool((ours[~selected] == float("-inf")).all())
                  and torch.equal(values, values_before))
            report(f"nvfp4_gathered_bias B={batch} k={topk} {name}", ok)
        report(f"nvfp4_gathered_bias B={batch} k={topk} leaves other rows of the buffer at -inf",
               bool((buffer[:, [0, 1, 2, 4, 5, 6]] == float("-inf")).all()))


def check_walk(heads: dict, gen: torch.Generator) -> None:
    permutation = torch.randperm(VOCAB, generator=gen, device="cuda")
    d2t = permutation - torch.arange(VOCAB, device="cuda")  # target id = permutation[draft id]
    for batch in BATCHES:
        for temperature in (0.0, 0.8):
            x = make_inputs(heads["bf16"], batch, BLOCK, TOPK, temperature, gen)
            for fmt, head in heads.items():
                for with_d2t in (False, True):
                    w = dataclasses.replace(head.weights, d2t=d2t if with_d2t else None)
                    w2 = w.w2_nvfp4 if fmt == "nvfp4" else w.w2
                    args = (x.values, x.cand_ids, x.first_prev, w.w1, w2, w.scale, w.d2t, x.gumbel, temperature)
                    tokens, corrected = markov_walk_triton(*args)
                    ref_tokens, ref_corrected = markov_walk_reference(*args)
                    name = f"markov_walk_triton B={batch} {fmt} T={temperature:g} d2t={with_d2t}"
                    if torch.equal(tokens, ref_tokens):
                        close = torch.allclose(corrected, ref_corrected, rtol=1e-4, atol=1e-4)
                        report(name, close, "tokens equal" + ("" if close else ", corrected logits differ"))
                    else:
                        check = check_tokens(w, x, tokens, ref_tokens)
                        report(name, check.ok, f"tokens differ: {check.label()} {check.mismatch or ''}")
    x = make_inputs(heads["nvfp4"], 8, BLOCK, TOPK, 0.8, gen)
    w = heads["nvfp4"].weights
    walk = lambda: markov_walk_triton(x.values, x.cand_ids, x.first_prev, w.w1, w.w2_nvfp4, w.scale, None,  # noqa: E731
                                      x.gumbel, 0.8)[0]
    replay = capture_graph(walk)
    report("markov_walk_triton in a CUDA graph: replay == eager", torch.equal(replay(), walk()))


def check_head_walks(nvfp4_head, gen: torch.Generator, batches=(1, 8, 32), device: str = "cuda") -> None:
    """Gated and RNN heads (random projections, bf16) walked with the NVFP4 gather kernel and with its torch twin
    on the same inputs. Equal tokens pass when the logit rows agree to a bf16 step; at a first differing token the
    two paths have the same prefix, so their rows must still agree and the two picks must be a near tie."""
    for type_name in ("gated", "rnn"):
        head = HEADS[type_name](1, 1, RANK, HIDDEN).to(device, torch.bfloat16)  # only its projections are used
        weights = dataclasses.replace(nvfp4_head.weights, head=head)
        for batch in batches:
            for temperature in (0.0, 0.8):
                x = make_inputs(nvfp4_head, batch, BLOCK, TOPK, temperature, gen)
                hidden = torch.randn(batch, BLOCK, HIDDEN, generator=gen, device=device).bfloat16()  # [B, N, H]
                params = SamplingParams(temperature=temperature)
                ours, ref = (markov_walk("nvfp4", weights, x.base, x.first_prev, params, x.noise, TOPK,
                                         triton=use_kernel, hidden=hidden) for use_kernel in (True, False))
                name = f"{type_name} head walk, nvfp4 kernel vs twin, B={batch} T={temperature:g}"
                report(name, *_walks_agree(ours, ref, x))


def _walks_agree(ours, ref, x) -> tuple[bool, str]:
    """(ok, detail) for two walks of the same inputs x (a head without d2t: tokens are draft ids)."""
    finite = torch.isfinite(ref.logits)
    if torch.equal(ours.tokens, ref.tokens):
        same_rows = torch.equal(finite, torch.isfinite(ours.logits)) and within_one_bf16_step(ours.logits[finite],
                                                                                              ref.logits[finite])
        return same_rows, "tokens equal" + ("" if same_rows else ", logit rows differ")
    b, i = (ours.tokens != ref.tokens).nonzero()[0].tolist()
    row_ours, row_ref = ours.logits[b, i], ref.logits[b, i]
    keep = torch.isfinite(row_ref)
    score = row_ref if x.noise is None else row_ref / x.temperature + x.noise[b, i]  # what each pick maximised
    near_tie = within_one_bf16_step(score[ours.tokens[b, i]], score[ref.tokens[b, i]])
    ok = within_one_bf16_step(row_ours[keep], row_ref[keep]) and near_tie
    return ok, f"tokens first differ at block {b} position {i}" + (" (a near tie)" if ok else "")


def run_bench(out: Path) -> None:
    json_path, png_path = out / "bench_markov.json", out / "bench_markov.png"
    if bench_command(["--batch", "1,8,32,128", "--topk", "64", "--format", "bf16,nvfp4", "--temperature", "0,1",
                      "--json", str(json_path), "--plot", str(png_path)], BENCH_TIMEOUT_S) and json_path.exists():
        summarize(json.loads(json_path.read_text()))
    for head_type in ("gated", "rnn"):  # methods 1-3 with a head's latents, CUDA graphs included
        bench_command(["--head-type", head_type, "--hidden", str(HIDDEN), "--batch", "1,8,32", "--topk", "64",
                       "--format", "bf16,nvfp4", "--temperature", "0", "--json",
                       str(out / f"bench_markov_{head_type}.json")], HEAD_BENCH_TIMEOUT_S)


def bench_command(args: list[str], timeout_s: int) -> bool:
    """`dspark bench markov --device cuda ARGS`, printed and reported; True when it exited 0."""
    command = [sys.executable, "-m", "dspark_cli", "bench", "markov", "--device", "cuda", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "200"}
    print("$", " ".join(command), flush=True)
    began = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as timeout:
        print((timeout.stdout or b"").decode() + (timeout.stderr or b"").decode(), flush=True)
        report(f"dspark bench markov {' '.join(args[:2])} finished within {timeout_s} s", False)
        return False
    print(done.stdout + done.stderr, flush=True)
    name = f"dspark bench markov {' '.join(args[:2])} (exit {done.returncode}, {time.perf_counter() - began:.0f} s)"
    report(name, done.returncode == 0)
    return done.returncode == 0


def summarize(doc: dict) -> None:
    """The issue's goal: fused walk >= 5x faster than the graphed per-position NVFP4 path, within 2x of its bound."""
    rows = {(r["format"], r["temperature"], r["batch"], r["method"], r["mode"]): r for r in doc["rows"] if r["timing"]}
    print(f"\nfused walk vs graphed top-k NVFP4 (peak {doc['peak_gbps']:.0f} GB/s, {doc['peak_source']}; "
          f"launch {doc['launch_us']:.1f} us)")
    print(f"{'T':>4} {'B':>4} {'nvfp4 graph us':>15} {'fused graph us':>15} {'speedup':>8} {'bound us':>9} "
          f"{'x bound':>8}")
    for (fmt, temperature, batch, method, mode), row in sorted(rows.items()):
        if fmt != "nvfp4" or method != "fused" or mode != "graph":
            continue
        nvfp4 = rows.get((fmt, temperature, batch, "nvfp4", "graph"))
        fused_us = row["us_per_step"]
        nvfp4_us = nvfp4["us_per_step"] if nvfp4 else float("nan")
        print(f"{temperature:>4g} {batch:>4} {nvfp4_us:>15.1f} {fused_us:>15.1f} {nvfp4_us / fused_us:>7.1f}x "
              f"{row['lower_bound_us']:>9.1f} {fused_us / row['lower_bound_us']:>7.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device: this script checks the GPU path only")
        return 1
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    began = time.perf_counter()
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.inference_mode():
        heads = random_heads(BenchConfig(device="cuda", topks=(TOPK,)), VOCAB, VOCAB, RANK)  # bf16 + NVFP4 W2
        weight = check_quantize(heads["bf16"].weights.w2)
        report("bench's NVFP4 head is quantize_nvfp4 of its bf16 W2",
               torch.equal(weight.packed, heads["nvfp4"].weights.w2_nvfp4.packed))
        check_dequantize(weight, gen)
        check_gathered_bias(weight, gen)
        check_walk(heads, gen)
        check_head_walks(heads["nvfp4"], gen)
    print(f"kernel checks: {time.perf_counter() - began:.0f} s", flush=True)
    del heads, weight
    torch.cuda.empty_cache()
    run_bench(args.out)
    print(f"\n{len(failures)} failure(s){': ' + ', '.join(failures) if failures else ''}; "
          f"total {time.perf_counter() - began:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
