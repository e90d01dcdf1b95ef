"""Benchmark `dspark quantize`: both NVFP4 engines on a [151936, 256] bf16 head, then the whole CLI.

    .venv/bin/python benchmarks/bench_quantize.py [--vocab 151936] [--rank 256] [--modelopt-cli]

Every measurement runs in its own subprocess; its peak RSS is that child's ru_maxrss, read through
getrusage(RUSAGE_CHILDREN) in a fresh wrapper process, so one measurement cannot hide another. Rows:
  - engine torch / modelopt: import of the engine, then quantize_nvfp4 / quantize_nvfp4_modelopt on the same
    seeded tensor; the two outputs are checked bit-identical (ModelOpt is the baseline);
  - bias screen bf16 / fp32: the 128-row bias-agreement sample with its screen matmul forced to each dtype,
    interleaved (bf16, fp32, bf16, ...) so load hits both alike; min and median wall and CPU of 3 runs each,
    plus the dtype the one-time calibration (runtime/quantize/matmul_dtype.py) picks on this CPU and its cost;
  - CLI: `dspark quantize --engine torch` (and with --modelopt-cli, `--engine modelopt`) on a fabricated
    2-shard draft whose Markov head has that shape: process start, imports, reading, quantizing, the bias
    sample, writing. Target: under 3 s and 1 GB for --engine torch. It runs with torch's default threads, with
    OMP_NUM_THREADS=1 (whose CPU seconds are the work itself) and with OMP_WAIT_POLICY=PASSIVE: on a machine
    other jobs keep busy, OpenMP threads that spin-wait inflate both the wall and the CPU time of the default run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI_TARGET_S, CLI_TARGET_MB = 3.0, 1024
SCREEN_REPS = 3


# Runs one command in a fresh Python whose only child it is, so RUSAGE_CHILDREN there is that command's own peak.
_MEASURE = """
import json, resource, subprocess, sys, time
started = time.perf_counter()
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - started
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": done.returncode, "wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
                  "peak_kib": usage.ru_maxrss, "stdout": done.stdout, "stderr": done.stderr}))
"""


def run_child(args: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """Run a command with extra environment `env`; (wall s, CPU s, peak RSS MiB, stdout). Exits if it fails."""
    env = {**os.environ, **(env or {})}
    measured = json.loads(subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True,
                                         check=True, env=env).stdout)
    if measured["rc"] != 0:
        raise SystemExit(f"{' '.join(args)} failed ({measured['rc']}):\n{measured['stderr']}")
    return measured["wall"], measured["cpu"], measured["peak_kib"] / 1024, measured["stdout"]


def engine_child(engine: str, vocab: int, rank: int) -> None:
    """In a fresh process: import the engine, quantize the seeded head, print timings and an output digest."""
    import hashlib
    import resource

    started = time.perf_counter()
    import torch

    from dspark_cli.kernels import nvfp4

    if engine == "modelopt":
        import warnings

        warnings.filterwarnings("ignore", category=UserWarning)
        from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: F401  (the ~10 s import)
    import_s = time.perf_counter() - started
    w = (torch.randn(vocab, rank, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    quantize = nvfp4.quantize_nvfp4 if engine == "torch" else nvfp4.quantize_nvfp4_modelopt
    started, started_cpu = time.perf_counter(), time.process_time()
    weight = quantize(w)
    quantize_s, quantize_cpu_s = time.perf_counter() - started, time.process_time() - started_cpu
    digest = hashlib.sha256()
    for tensor in (weight.packed, weight.scale, weight.global_scale):
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    print(json.dumps({"import_s": import_s, "quantize_s": quantize_s, "quantize_cpu_s": quantize_cpu_s,
                      "before_mb": before_mb, "digest": digest.hexdigest()}))


def screen_child(vocab: int, rank: int) -> None:
    """In a fresh process: the bias sample with each screen dtype, interleaved; print the timings as JSON."""
    import statistics

    import torch

    from dspark_cli.kernels.nvfp4 import quantize_nvfp4
    from dspark_cli.runtime.quantize import write as quantize
    from dspark_cli.runtime.quantize.matmul_dtype import fast_matmul_dtype

    started, started_cpu = time.perf_counter(), time.process_time()
    chosen = fast_matmul_dtype()
    calibration = (time.perf_counter() - started, time.process_time() - started_cpu)
    gen = torch.Generator().manual_seed(0)
    w2 = (torch.randn(vocab, rank, generator=gen) * 0.02).bfloat16()
    embeds = torch.randn(quantize.DEFAULT_SAMPLE_ROWS, rank, generator=gen)
    weight = quantize_nvfp4(w2)
    _, dequantized = quantize.weight_error(w2, weight)
    samples: dict[str, list[tuple[float, float]]] = {"bf16": [], "fp32": []}
    results = {}
    for _ in range(SCREEN_REPS):
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            quantize.fast_matmul_dtype = lambda dtype=dtype: dtype
            started, started_cpu = time.perf_counter(), time.process_time()
            results[name] = quantize.bias_agreement(embeds, w2, weight, dequantized)
            samples[name].append((time.perf_counter() - started, time.process_time() - started_cpu))
    summary = {name: {"min_s": min(w for w, _ in runs), "median_s": statistics.median(w for w, _ in runs),
                      "min_cpu_s": min(c for _, c in runs), "median_cpu_s": statistics.median(c for _, c in runs)}
               for name, runs in samples.items()}
    same = (results["bf16"].top1_agreement, results["bf16"].top16_overlap) == (
        results["fp32"].top1_agreement, results["fp32"].top16_overlap)
    print(json.dumps({"chosen": str(chosen).removeprefix("torch."), "calibration": calibration, "runs": summary,
                      "same_top": same, "relative_errors": [results[n].relative_error for n in ("bf16", "fp32")]}))


def bf16_flags() -> str:
    """The CPU flags that make a bf16 matmul native (AVX512-BF16, AMX), from /proc/cpuinfo; 'none' if absent."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return ", ".join(sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})) or "none"


def fabricate_checkpoint(folder: Path, vocab: int, rank: int) -> Path:
    """A 2-shard DeepSpec-format draft with a [vocab, rank] bf16 Markov head (small backbone)."""
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from ckpt_factory import DraftSpec, write_draft

    spec = DraftSpec(vocab_size=vocab, markov_rank=rank, mask_token_id=vocab - 1, own_embed=False, own_lm_head=False)
    return write_draft(folder / "draft", spec, shards=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--modelopt-cli", action="store_true", help="also time `dspark quantize --engine modelopt`")
    parser.add_argument("--child", choices=["torch", "modelopt", "screen"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "screen":
        screen_child(args.vocab, args.rank)
        return
    if args.child:
        engine_child(args.child, args.vocab, args.rank)
        return

    rows = []
    digests = {}
    for engine in ("torch", "modelopt"):
        _, _, peak_mb, stdout = run_child([sys.executable, __file__, "--child", engine,
                                           "--vocab", str(args.vocab), "--rank", str(args.rank)])
        result = json.loads(stdout)
        digests[engine] = result["digest"]
        note = f"import {result['import_s']:.2f} s; RSS before quantize {result['before_mb']:.0f} MiB"
        rows.append((f"engine {engine}: quantize only", result["quantize_s"], result["quantize_cpu_s"], peak_mb, note))
    identical = digests["torch"] == digests["modelopt"]
    _, _, peak_mb, stdout = run_child([sys.executable, __file__, "--child", "screen",
                                       "--vocab", str(args.vocab), "--rank", str(args.rank)])
    screen = json.loads(stdout)
    errors = screen["relative_errors"]
    for name, runs in screen["runs"].items():
        note = (f"median {runs['median_s']:.2f} s wall, {runs['median_cpu_s']:.2f} s CPU; top-1/16 same in both: "
                f"{screen['same_top']}; rel. err bf16 {errors[0]:.6f}, fp32 {errors[1]:.6f}")
        rows.append((f"bias screen {name} (min of {SCREEN_REPS})", runs["min_s"], runs["min_cpu_s"], peak_mb, note))
    calibration_s, calibration_cpu_s = screen["calibration"]
    rows.append(("bias screen calibration (once per process)", calibration_s, calibration_cpu_s, peak_mb,
                 f"picks {screen['chosen']} on this CPU"))

    with tempfile.TemporaryDirectory() as tmp:
        source = fabricate_checkpoint(Path(tmp), args.vocab, args.rank)
        size_mb = sum(p.stat().st_size for p in source.iterdir()) / 2**20
        runs = [("torch", {}), ("torch", {"OMP_NUM_THREADS": "1"}), ("torch", {"OMP_WAIT_POLICY": "PASSIVE"})]
        runs += [("modelopt", {})] if args.modelopt_cli else []
        for number, (engine, env) in enumerate(runs):
            out = Path(tmp) / f"out-{number}"
            command = [sys.executable, "-m", "dspark_cli", "quantize", str(source), "-o", str(out), "--engine", engine,
                       "--json", "-"]
            wall, cpu, peak_mb, stdout = run_child(command, env)
            report = json.loads(stdout)
            bias = report["bias"]
            name = f"CLI --engine {engine}" + "".join(f" {key}={value}" for key, value in env.items())
            rows.append((name, wall, cpu, peak_mb,
                         f"in-process {report['wall_s']:.2f} s; rel. err {report['relative_frobenius_error']:.4f}; "
                         f"bias top-1 {bias['top1_agreement']:.1%}, top-16 {bias['top16_overlap']:.1%} "
                         f"({bias['rows']} tokens); {report['bytes_before'] / 2**20:.1f} -> "
                         f"{report['bytes_after'] / 2**20:.1f} MiB"))

    print(f"markov_w2 [{args.vocab}, {args.rank}] bf16; checkpoint {size_mb:.0f} MiB; {os.cpu_count()} CPUs; "
          f"bf16 matmul flags: {bf16_flags()}")
    print(f"{'measurement':<50} {'wall s':>7} {'CPU s':>6} {'peak RSS MiB':>13}  notes")
    for name, seconds, cpu, peak_mb, note in rows:
        print(f"{name:<50} {seconds:>7.2f} {cpu:>6.2f} {peak_mb:>13.0f}  {note}")
    print(f"engines bit-identical: {identical}; load average {os.getloadavg()[0]:.1f}")
    for name, wall, _, peak_mb, _ in rows:
        if name.startswith("CLI --engine torch"):
            verdict = "meets" if wall < CLI_TARGET_S and peak_mb < CLI_TARGET_MB else "misses"
            print(f"{name}: {verdict} the target (< {CLI_TARGET_S:.0f} s, < {CLI_TARGET_MB} MiB)")


if __name__ == "__main__":
    main()
