"""GGUF files quantized for llama.cpp (release b11434): Q8_0, Q4_0 and Q4_K by dspark's own block quantizers (Q4_K's
in gguf_kquant.py), Q4_K_M by llama.cpp's `llama-quantize` (scripts/build_llamacpp.sh builds it); torch-free.

A quantized file is made from the unquantized GGUF dspark's converters write (gguf.py, target_gguf.py): its keys are
copied, `general.file_type` set, and each tensor quantized or copied as it was. Which tensors stay unquantized is
llama.cpp's rule (src/llama-quant.cpp, tensor_allows_quantization and tensor_type_fallback at b11434): a tensor of
fewer than two dimensions in ggml's sense (norms, biases, and `conf_proj.weight`, whose [hidden + rank, 1] is one
row), a name not ending in `weight` (`d2t`, `markov_w2.scale`), a `*_norm.weight`; a matrix whose rows are not whole
32-value blocks falls back to F16. `keep_output` leaves `output.weight` (the lm_head) as it was, like llama-quantize's
option that leaves the output tensor.

Q8_0, Q4_0 and Q4_K are written "pure" (every eligible matrix in the one type; for Q4_K, Q5_0 where a row is not
whole 256-value super-blocks), the file `llama-quantize --pure` writes, byte for byte (tests/convert/test_gguf_quant.py
compares them); llama.cpp's own Q4_0 mixture would put output.weight in Q6_K. Q4_K_M is llama.cpp's mixture (Q4_K,
Q6_K for output.weight and half the attn_v / ffn_down, Q5_0 where a row is not whole 256-value super-blocks, as the
dflash Markov matrices of rank 128 are), so it is llama-quantize's.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.convert.gguf_kquant import QK_K, quantize_q4_k, quantize_q5_0
from dspark_cli.runtime.engines.llamacpp import build_binary, quantize_argv
from dspark_cli.runtime.io.outputs import atomic_output_file, check_output_file

QK = 32  # values per Q8_0 / Q4_0 block (ggml-common.h QK8_0, QK4_0)
OUTTYPES = ("q8_0", "q4_0", "q4_k", "q4_k_m")
# llama_ftype: MOSTLY_Q8_0, MOSTLY_Q4_0, and for q4_k what `llama-quantize --pure ... Q4_K` writes (its "Q4_K" is an
# alias of MOSTLY_Q4_K_M)
FILE_TYPES = {"q8_0": 7, "q4_0": 2, "q4_k": 15, "q4_k_m": 15}


@dataclass(frozen=True)
class TensorPlan:
    """What one tensor of the unquantized file becomes: its ggml type name, and why it stays as it was."""

    name: str
    source_type: str
    out_type: str
    reason: str = ""


def quantize_q8_0(rows):
    """Q8_0 blocks (ggml-common.h block_q8_0: an F16 scale d = max|x| / 127, then 32 int8 round(x / d), half away
    from zero) of float32 rows [R, C] (C a multiple of 32) -> uint8 [R, C / 32 * 34]."""
    import numpy as np

    blocks = rows.astype(np.float32).reshape(-1, QK)  # [B, 32]
    d = np.abs(blocks).max(axis=1) / np.float32(127)  # [B]
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inverse[:, None]
    whole = np.trunc(scaled)  # C's roundf: halves away from zero (the fraction is exact in float32)
    quants = (whole + np.sign(scaled) * (np.abs(scaled - whole) >= 0.5)).astype(np.int8)
    packed = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), quants.view(np.uint8)], axis=1)
    return packed.reshape(rows.shape[0], -1)  # [R, C / 32 * 34]


def quantize_q4_0(rows):
    """Q4_0 blocks (block_q4_0: an F16 scale d = m / -8 with m the value of largest magnitude, then 16 bytes whose
    low nibbles are values 0..15 and high nibbles 16..31, each min(15, trunc(x / d + 8.5))) of float32 rows [R, C]
    -> uint8 [R, C / 32 * 18]."""
    import numpy as np

    blocks = rows.astype(np.float32).reshape(-1, QK)  # [B, 32]
    first_largest = np.abs(blocks).argmax(axis=1)  # the first of equal magnitudes, as the reference's strict <
    d = blocks[np.arange(len(blocks)), first_largest] / np.float32(-8)  # [B]
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    nibbles = np.minimum(15, (blocks * inverse[:, None] + np.float32(8.5)).astype(np.int8)).astype(np.uint8)
    packed = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8),
                             nibbles[:, :QK // 2] | (nibbles[:, QK // 2:] << 4)], axis=1)
    return packed.reshape(rows.shape[0], -1)  # [R, C / 32 * 18]


QUANTIZERS: dict[str, Callable] = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q4_k": quantize_q4_k,
                                   "q5_0": quantize_q5_0}


def tensor_plan(name: str, ggml_shape: tuple[int, ...], source_type: str, outtype: str,
                keep_output: bool = False) -> TensorPlan:
    """llama.cpp's choice for one tensor (ggml order: ggml_shape[0] is the row length) under dspark's pure
    Q8_0 / Q4_0 / Q4_K (a Q4_K row that is not whole 256-value super-blocks falls back to Q5_0)."""
    if all(size == 1 for size in ggml_shape[1:]):  # ggml_n_dims < 2
        return TensorPlan(name, source_type, source_type, "one row or fewer dimensions")
    if not name.endswith("weight"):
        return TensorPlan(name, source_type, source_type, "not a weight")
    if name.endswith("_norm.weight"):
        return TensorPlan(name, source_type, source_type, "a norm")
    if keep_output and name == "output.weight":
        return TensorPlan(name, source_type, source_type, "the lm_head, kept")
    if ggml_shape[0] % QK:
        return TensorPlan(name, source_type, "F16", f"rows of {ggml_shape[0]} values are not whole 32-value blocks")
    if outtype == "q4_k" and ggml_shape[0] % QK_K:
        return TensorPlan(name, source_type, "Q5_0", f"rows of {ggml_shape[0]} values are not whole Q4_K super-blocks")
    return TensorPlan(name, source_type, outtype.upper())


def quantize_file(source: Path, out: Path, outtype: str, keep_output: bool = False) -> list[TensorPlan]:
    """Write the unquantized GGUF `source` quantized to `outtype` at `out` (a path it may overwrite); the plan of
    every tensor as written."""
    if outtype == "q4_k_m":
        run_llama_quantize(source, out, keep_output)
        return read_plan(out)
    return _write_pure(source, out, outtype, keep_output)


def _write_pure(source: Path, out: Path, outtype: str, keep_output: bool) -> list[TensorPlan]:
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(out, arch)
    _copy_keys(reader, writer, FILE_TYPES[outtype])
    plans = []
    for tensor in reader.tensors:
        plan = tensor_plan(tensor.name, tuple(int(n) for n in tensor.shape), tensor.tensor_type.name, outtype,
                           keep_output)
        _add(writer, tensor, plan)
        plans.append(plan)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return plans


def _copy_keys(reader, writer, file_type: int) -> None:
    """Every key of `reader` but the header's and general.architecture (the writer's own), file_type replaced."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = file_type if key == "general.file_type" else field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type)


def _add(writer, tensor, plan: TensorPlan) -> None:
    """The tensor as its plan says: copied as stored, F16 (a fallback), or quantized row by row."""
    import gguf
    import numpy as np

    ggml_type = gguf.GGMLQuantizationType[plan.out_type]
    if plan.out_type == plan.source_type:  # the reader's bytes or values as stored
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=ggml_type)
        return
    rows = source_values(tensor).reshape(-1, int(tensor.shape[0]))  # [rows, row length]
    if plan.out_type == "F16":
        writer.add_tensor(tensor.name, rows.astype(np.float16).reshape(_numpy_shape(tensor)))
        return
    packed = QUANTIZERS[plan.out_type.lower()](rows)
    writer.add_tensor(tensor.name, packed.reshape(*_numpy_shape(tensor)[:-1], -1), raw_dtype=ggml_type)


def source_values(tensor):
    """An unquantized GGUF tensor's values as float32, exactly (BF16's bits are the top half of F32's)."""
    import numpy as np

    kind = tensor.tensor_type.name
    if kind == "F32":
        return np.asarray(tensor.data, dtype=np.float32)
    if kind == "F16":
        return np.asarray(tensor.data).astype(np.float32)
    if kind == "BF16":
        return (np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise DsparkError(f"{tensor.name} is {kind} in the GGUF to quantize; dspark quantizes F32, F16 and BF16 tensors.")


def _numpy_shape(tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))


def read_plan(path: Path) -> list[TensorPlan]:
    """The tensors of a quantized GGUF with their types (no source type: read from the output alone)."""
    import gguf

    return [TensorPlan(t.name, "", t.tensor_type.name) for t in gguf.GGUFReader(path).tensors]


def run_llama_quantize(source: Path, out: Path, keep_output: bool) -> None:
    binary = build_binary("llama-quantize")
    if not binary.is_file():
        raise DsparkError(f"Q4_K_M is written by llama.cpp's llama-quantize, and there is none at {binary}; build it "
                          "with scripts/build_llamacpp.sh.")
    done = subprocess.run(quantize_argv(binary, source, out, "Q4_K_M", keep_output), capture_output=True, text=True)
    if done.returncode != 0:
        raise DsparkError(f"llama-quantize failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")


def convert_quantized(write_source: Callable[[Path], dict[str, Any]], out: str | os.PathLike, outtype: str,
                      inputs: list, force: bool = False, keep_output: bool = False,
                      check: Callable[[Path, Path], dict] | None = None) -> dict[str, Any]:
    """`write_source(path)` writes the unquantized GGUF (a converter's call); it is quantized into `out`
    (exclusive unless `force`). `check(unquantized, quantized)`, when given, runs before `out` is published and
    may raise to refuse it (the acceptance guard); its figures join the summary."""
    if outtype not in OUTTYPES:
        raise DsparkError(f"the outtype {outtype!r} is not one dspark writes; choose one of {', '.join(OUTTYPES)}.")
    out = Path(out)
    check_output_file(out, inputs, "the output")
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent if out.parent.is_dir() else None) as tmp:
        source = Path(tmp) / "unquantized.gguf"
        summary = write_source(source)
        unquantized_bytes = source.stat().st_size
        with atomic_output_file(out, force) as final:
            plans = quantize_file(source, final, outtype, keep_output)
            guard = check(source, final) if check is not None else None
    types: dict[str, int] = {}
    for plan in plans:
        types[plan.out_type] = types.get(plan.out_type, 0) + 1
    kept = [f"{p.name} ({p.reason})" for p in plans if p.reason and p.out_type == p.source_type]
    fallbacks = [f"{p.name}: {p.out_type} ({p.reason})" for p in plans if p.reason and p.out_type != p.source_type]
    return {**summary, "output": str(out), "outtype": outtype, "tensor_types": types, "unquantized": sorted(kept),
            "fallbacks": sorted(fallbacks),
            "bytes": out.stat().st_size, "unquantized_bytes": unquantized_bytes, **({"guard": guard} if guard else {})}
