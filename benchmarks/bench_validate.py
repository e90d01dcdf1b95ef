"""Benchmark `dspark validate` on a fabricated multi-GB sharded draft of real Qwen3-8B geometry.

    .venv/bin/python benchmarks/bench_validate.py [--shards 4] [--runs 7] [--keep DIR]

The checkpoint is written as sparse files: each shard gets its real safetensors header, then is truncated to its
full size, so the data section reads as zeros and takes (almost) no disk. Geometry (DeepSpec's
dspark_qwen3_8b_block7): 5 layers, hidden 4096, 32/8 heads of 128, intermediate 12288, vocab 151936, Markov rank
256, fc [4096, 20480], own embed_tokens + lm_head, confidence head on [hidden; markov]: 4.6 GB of bf16.

Rows (medians of --runs):
  - in-process: open_checkpoint + validate_checkpoint (config + headers + every rule), Python already warm;
  - baseline in-process: the safetensors library opening every shard and listing its tensors (Rust header parse);
  - CLI: `dspark validate DIR --json` as a subprocess (interpreter start + imports + validation);
  - baseline CLI: a bare `python -c pass`, and `dspark --help`.
Target: the CLI well under 1 s, because no tensor data is read.

    .venv/bin/python benchmarks/bench_validate.py --hostile-headers

instead times `dspark validate` (subprocess, report and --json) on the same draft, unsharded, plus one extra shard of
tiny unknown tensors: just under the tensor cap (MAX_TENSORS - 100 entries; one DSP205 finding each) and far above it
(1.2 M entries in a 96 MB header, refused while the header streams in). Peak memory is the child's max RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

H, I, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 5, 32, 8, 128
VOCAB, RANK, TARGET_LAYERS = 151936, 256, (1, 9, 17, 25, 33)
TARGET_S = 1.0


def draft_config() -> dict:
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "attention_bias": False, "max_position_embeddings": 40960, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "num_target_layers": 36, "target_layer_ids": list(TARGET_LAYERS), "mask_token_id": 151669, "block_size": 7,
        "num_anchors": 512, "layer_types": ["full_attention"] * LAYERS, "markov_rank": RANK,
        "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
        "torch_dtype": "bfloat16",
    }


def target_config() -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": H,
            "num_hidden_layers": 36}


def tensor_shapes() -> dict[str, list[int]]:
    hq, hkv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes: dict[str, list[int]] = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": [hq, H], p + "self_attn.k_proj.weight": [hkv, H],
            p + "self_attn.v_proj.weight": [hkv, H], p + "self_attn.o_proj.weight": [H, hq],
            p + "self_attn.q_norm.weight": [HEAD_DIM], p + "self_attn.k_norm.weight": [HEAD_DIM],
            p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H], p + "mlp.down_proj.weight": [H, I],
            p + "input_layernorm.weight": [H], p + "post_attention_layernorm.weight": [H],
        })
    shapes.update({
        "norm.weight": [H], "hidden_norm.weight": [H], "fc.weight": [H, len(TARGET_LAYERS) * H],
        "embed_tokens.weight": [VOCAB, H], "lm_head.weight": [VOCAB, H],
        "markov_head.markov_w1.weight": [VOCAB, RANK], "markov_head.markov_w2.weight": [VOCAB, RANK],
        "confidence_head.proj.weight": [1, H + RANK], "confidence_head.proj.bias": [1],
    })
    return shapes


def write_sparse_shard(path: Path, shapes: dict[str, list[int]]) -> int:
    """A real safetensors header for bf16 tensors, then a hole up to the full size. Returns the file size."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 2
        for dim in shape:
            size *= dim
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)
    return 8 + len(raw) + offset


def fabricate(folder: Path, shards: int) -> tuple[int, int]:
    """Write the sharded draft; returns (apparent bytes, bytes really allocated on disk)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(draft_config(), indent=2))
    (folder / "target").mkdir(exist_ok=True)
    (folder / "target" / "config.json").write_text(json.dumps(target_config()))
    names = list(tensor_shapes().items())
    total = sum(2 * _numel(shape) for _, shape in names)
    parts: list[list[tuple[str, list[int]]]] = [[] for _ in range(shards)]
    filled = [0] * shards
    for name, shape in sorted(names, key=lambda item: -_numel(item[1])):  # greedy balance by bytes
        smallest = filled.index(min(filled))
        parts[smallest].append((name, shape))
        filled[smallest] += 2 * _numel(shape)
    weight_map, apparent, allocated = {}, 0, 0
    for s, part in enumerate(parts):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        apparent += write_sparse_shard(folder / file, dict(part))
        allocated += os.stat(folder / file).st_blocks * 512
        weight_map.update({name: file for name, _ in part})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return apparent, allocated


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def median_time(fn, runs: int) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (this process plus its children) of fn()."""
    walls, cpus = [], []
    for _ in range(runs):
        before = _cpu()
        started = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - started)
        cpus.append(_cpu() - before)
    return statistics.median(walls), statistics.median(cpus)


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def run_measured(args: list[str]) -> tuple[int, float, int]:
    """(exit code, wall seconds, max RSS in KiB) of one child run, its output discarded."""
    started = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, time.perf_counter() - started, usage.ru_maxrss


def write_hostile_draft(folder: Path, entries: int) -> int:
    """The bench draft in one unindexed sparse shard plus a shard of `entries` 1-byte tensors; header bytes."""
    fabricate(folder, 1)
    (folder / "model.safetensors.index.json").unlink()  # without an index every *.safetensors file is read
    parts = ",".join(f'"extra.{i}.weight":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}'
                     for i in range(entries))
    raw = ("{" + parts + "}").encode()
    raw += b" " * (-len(raw) % 8)
    with open(folder / "model-extra.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + entries)
    return len(raw)


def hostile_headers(runs: int) -> None:
    from dspark_cli.runtime.checkpoint.read import MAX_TENSORS

    dspark = shutil.which("dspark", path=str(Path(sys.executable).parent)) or "dspark"
    root = Path(tempfile.mkdtemp(prefix="dspark-bench-hostile-"))
    try:
        print(f"median of {runs} runs ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}); "
              f"MAX_TENSORS {MAX_TENSORS}")
        for entries in (MAX_TENSORS - 100, 1_200_000):
            folder = root / f"e{entries}"
            # written by a child process, so that this one stays small (children fork from it: max RSS)
            code = (f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); from pathlib import Path; "
                    f"import bench_validate as b; print(b.write_hostile_draft(Path({str(folder)!r}), {entries}))")
            header = int(run_cli([sys.executable, "-c", code]).stdout)
            for extra in ([], ["--json", "-"]):
                args = [dspark, "validate", str(folder), *extra]
                measured = [run_measured(args) for _ in range(runs)]
                code, wall, rss = (statistics.median(column) for column in zip(*measured))
                command = " ".join(["validate", *extra])
                print(f"  {entries:>9,} extra tensors, {header / 1e6:5.1f} MB header, {command:<16} exit {code:.0f}: "
                      f"{wall:5.2f} s wall, {rss / 1024:4.0f} MB max RSS")
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--keep", type=Path, help="write the checkpoint here and keep it")
    parser.add_argument("--hostile-headers", action="store_true", help="time validate on huge headers instead")
    args = parser.parse_args()
    if args.hostile_headers:
        hostile_headers(min(args.runs, 3))
        return

    from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint

    folder = args.keep or Path(tempfile.mkdtemp(prefix="dspark-bench-validate-")) / "draft"
    try:
        started = time.perf_counter()
        apparent, allocated = fabricate(folder, args.shards)
        print(f"fabricated {args.shards} shards in {time.perf_counter() - started:.2f} s: "
              f"apparent {apparent / 1e9:.2f} GB, on disk {allocated / 1e6:.2f} MB ({folder})")

        target = read_target_config(folder / "target")
        report = validate_checkpoint(open_checkpoint(folder), target)
        print(f"report: {len(report.errors)} errors, {len(report.warnings)} warnings, codes {report.codes}, "
              f"{report.resolved['tensors']} tensors, {report.resolved['bytes'] / 1e9:.2f} GB declared")

        in_process = median_time(lambda: validate_checkpoint(open_checkpoint(folder), target), args.runs)
        from safetensors import safe_open

        def library_headers() -> None:
            for shard in sorted(folder.glob("*.safetensors")):
                with safe_open(str(shard), framework="np") as handle:
                    list(handle.keys())

        library = median_time(library_headers, args.runs)
        dspark = shutil.which("dspark", path=str(Path(sys.executable).parent)) or "dspark"
        cli_args = [dspark, "validate", str(folder), "--target", str(folder / "target"), "--json", "-"]
        done = run_cli(cli_args)
        assert done.returncode == 0 and json.loads(done.stdout)["exit_code"] == 0, done.stderr
        cli = median_time(lambda: run_cli(cli_args), args.runs)
        bare = median_time(lambda: run_cli([sys.executable, "-c", "pass"]), args.runs)
        helps = median_time(lambda: run_cli([dspark, "--help"]), args.runs)

        rows = [
            ("validate, in-process (open_checkpoint + rules)", in_process),
            ("baseline: safetensors library, open every shard + list keys", library),
            ("dspark validate --target --json (subprocess)", cli),
            ("baseline: python -c pass (subprocess)", bare),
            ("baseline: dspark --help (subprocess)", helps),
        ]
        print(f"\nmedian of {args.runs} runs, checkpoint of {apparent / 1e9:.2f} GB in {args.shards} shards "
              f"({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})")
        print(f"  {'':<62} {'wall':>8}    {'cpu':>8}")
        for label, (wall, cpu) in rows:
            print(f"  {label:<62} {wall * 1000:8.1f} ms {cpu * 1000:8.1f} ms")
        verdict = "OK" if cli[0] < TARGET_S else "OVER"
        print(f"\nCLI wall {cli[0]:.3f} s (cpu {cli[1]:.3f} s) vs target {TARGET_S:.1f} s: {verdict}; "
              f"validation itself {in_process[0] * 1000:.1f} ms")
    finally:
        if args.keep is None:
            shutil.rmtree(folder.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
