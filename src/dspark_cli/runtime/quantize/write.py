"""`dspark quantize`: the Markov head's `markov_w2` as ModelOpt W4A16 NVFP4, in a checkpoint vLLM loads.

Only `markov_head.markov_w2.weight` ([Vd, r]) is read and quantized (plus a sample of `markov_w1` rows for
the drafting report). The output folder holds:
  - the shard that held markov_w2, rewritten with `weight` (uint8 [Vd, r/2]), `weight_scale`
    (float8_e4m3fn [Vd, r/16], linear layout) and `weight_scale_2` (float32 []), every other tensor of that
    shard copied byte for byte;
  - every other safetensors shard hard-linked (copied where links are impossible) and every other file copied;
  - config.json with `quantization_config` and hf_quant_config.json, both MIXED_PRECISION with one
    `quantized_layers` entry, `model.markov_head.markov_w2` (the prefix vLLM gives the layer; docs/quantize.md);
  - an updated model.safetensors.index.json when the checkpoint is sharded.
The folder is written beside OUT, re-read and checked (runtime/quantize/verify.py), and renamed at the end
(runtime/files.atomic_output_dir). NVFP4 math lives in
kernels/nvfp4.py; this module only checks, reports and writes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.kernels import nvfp4
from dspark_cli.kernels.nvfp4 import GROUP_SIZE, NVFP4Weight, dequantize_nvfp4, dequantize_rows_nvfp4
from dspark_cli.runtime.checkpoint.read import (
    CONFIG_FILE,
    DTYPE_BYTES,
    FLOAT_DTYPES,
    INDEX_FILE,
    QUANT_CONFIG_FILE,
    Checkpoint,
    TensorInfo,
    open_checkpoint,
    read_safetensors_header,
)
from dspark_cli.runtime.io.outputs import atomic_output_dir, check_writable_parent, refuse_input_overlap
from dspark_cli.runtime.quantize.matmul_dtype import fast_matmul_dtype
from dspark_cli.runtime.checkpoint.layout import (
    MARKOV_W1,
    MARKOV_W2,
    MARKOV_W2_GLOBAL_SCALE,
    MARKOV_W2_MODULE,
    MARKOV_W2_SCALE,
    MARLIN_K_MULTIPLE,
    VLLM_MARKOV_W2_PREFIX,
)
from dspark_cli.runtime.quantize.verify import verify_quantized_output

# vLLM recognises the legacy file by producer name "modelopt"; the version names the ModelOpt release whose
# NVFP4QTensor.quantize both engines are bit-identical to.
PRODUCER = {"name": "modelopt", "version": "0.47.0"}
ENGINES = ("modelopt", "torch")
MODELOPT_MISSING = ("the engine option modelopt needs nvidia-modelopt (pip install nvidia-modelopt requests); or pass "
                    "the engine option torch, which gives bit-identical output.")
DEFAULT_SAMPLE_ROWS = 128  # ~0.3 s of CPU for Vd = 151936, r = 256; more rows: --sample-rows
TOP_K_OVERLAP = 16
_BIAS_CHUNK_ROWS = 64  # previous tokens per bias matmul: [64, Vd] fp32 is 39 MB for Vd = 151936
_BIAS_CANDIDATES = 32  # per previous token, preselected by the screen bias and then ranked exactly in fp32
_ERROR_CHUNK_ROWS = 16384  # weight rows per error-accumulation step
_COPY_BUFFER_BYTES = 16 << 20


@dataclass
class BiasAgreement:
    """bf16 vs NVFP4 Markov bias W2 @ W1[t] (computed in fp32) over a seeded sample of previous tokens t."""

    rows: int  # previous tokens sampled (rows of markov_w1)
    top1_agreement: float  # fraction of t whose arg-max draft token is the same
    top16_overlap: float  # mean |top-16(bf16) ∩ top-16(NVFP4)| / 16 (k = min(16, Vd))
    relative_error: float  # ||bias_nvfp4 - bias_bf16||_F / ||bias_bf16||_F over the sample


@dataclass
class QuantizeReport:
    """What `quantize_checkpoint` wrote and how close the NVFP4 head is to the original."""

    source: str
    output: str
    engine: str
    tensor: str  # on-disk name of the quantized weight
    quantized_layer: str  # the `quantized_layers` key (vLLM prefix)
    shape: tuple[int, int]  # [Vd, r]
    source_dtype: str  # safetensors dtype of the original weight, e.g. "BF16"
    relative_frobenius_error: float  # ||W_nvfp4 - W||_F / ||W||_F
    cosine: float  # cosine similarity of W_nvfp4 and W, flattened
    max_abs_error: float
    bytes_before: int  # the original weight
    bytes_after: int  # weight + weight_scale + weight_scale_2
    global_scale: float  # weight_scale_2
    all_zero: bool
    bias: BiasAgreement | None  # None when markov_w1 is absent/unusable or sample_rows = 0
    rewritten_shard: str
    linked_files: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    guard: dict | None = None  # the acceptance guard's figures (bench/runtime_guard.py), when it ran
    wall_s: float = 0.0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_before / self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        document = asdict(self)
        document["shape"] = list(self.shape)
        document["compression_ratio"] = self.compression_ratio
        return document


@dataclass(frozen=True)
class WeightError:
    """How far the dequantized NVFP4 weight is from the original."""

    relative_frobenius: float
    cosine: float
    max_abs: float


def quantize_checkpoint(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    engine: str = "modelopt",
    force: bool = False,
    revision: str | None = None,
    sample_rows: int | None = None,
    seed: int = 0,
    guard: Callable[[Path, Path], dict] | None = None,
) -> QuantizeReport:
    """Write a copy of the draft checkpoint `source` to `out` with markov_w2 in NVFP4 W4A16 (see module docstring).

    `engine` "modelopt" uses ModelOpt's NVFP4QTensor, "torch" the bit-identical kernels/nvfp4.py reimplementation.
    `sample_rows` previous tokens (default DEFAULT_SAMPLE_ROWS, seeded by `seed`; all when the vocabulary is
    smaller; 0 skips it) measure the agreement of the Markov bias. `guard(source folder, written folder)` runs on the
    finished folder before it is published (it raises to refuse). Raises DsparkError (exit 2) for unusable input;
    `source` is never modified.
    """
    started = time.perf_counter()
    if engine not in ENGINES:
        raise DsparkError(f"Unknown engine {engine!r}; choose one of {', '.join(ENGINES)}.")
    ckpt = _local_checkpoint(source, revision)
    out = Path(out)
    _check_output_folder(ckpt, out, force)
    w2_info = _check_markov_w2(ckpt)
    report_warnings = _rank_warnings(w2_info.shape[1])

    w2 = ckpt.load_tensor(MARKOV_W2)  # [Vd, r]
    amax = _checked_amax(ckpt, w2)
    weight = _quantize(w2, engine)
    all_zero = amax == 0.0
    if all_zero:
        report_warnings.append(
            f"{MARKOV_W2} is all zeros: written with weight_scale_2 = 1, every block scale 1 and every code 0, "
            "so it dequantizes to exact zeros (ModelOpt alone would write NaN scales)."
        )
    error, w2_nvfp4_bf16 = weight_error(w2, weight)
    bias = _bias_agreement(ckpt, w2, weight, w2_nvfp4_bf16, sample_rows, seed, report_warnings)
    del w2, w2_nvfp4_bf16  # only the NVFP4 weight is kept while writing

    with atomic_output_dir(out, force) as folder:
        linked, copied = write_quantized_checkpoint(ckpt, w2_info, weight, folder, report_warnings)
        verify_quantized_output(ckpt, folder)  # before the rename: a failure leaves nothing
        guard_figures = guard(ckpt.local_dir, folder) if guard is not None else None

    return QuantizeReport(
        source=ckpt.source,
        output=str(out),
        engine=engine,
        tensor=MARKOV_W2,
        quantized_layer=VLLM_MARKOV_W2_PREFIX,
        shape=(w2_info.shape[0], w2_info.shape[1]),
        source_dtype=w2_info.dtype,
        relative_frobenius_error=error.relative_frobenius,
        cosine=error.cosine,
        max_abs_error=error.max_abs,
        bytes_before=w2_info.nbytes,
        bytes_after=_nbytes(weight.packed) + _nbytes(weight.scale) + _nbytes(weight.global_scale),
        global_scale=weight.global_scale.item(),
        all_zero=all_zero,
        bias=bias,
        rewritten_shard=w2_info.file,
        linked_files=linked,
        copied_files=copied,
        warnings=report_warnings,
        guard=guard_figures,
        wall_s=time.perf_counter() - started,
    )


# --- checks -----------------------------------------------------------------------------------------------------


def _local_checkpoint(source: str | os.PathLike, revision: str | None) -> Checkpoint:
    """Open `source`; a hub checkpoint is downloaded first, since every file goes into the output."""
    ckpt = open_checkpoint(source, revision)
    if ckpt.local_dir is not None:
        return ckpt
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(ckpt.repo_id, revision=revision)
    except (OSError, ValueError) as error:  # HfHubHTTPError is an OSError
        raise DsparkError(
            f"{source} could not be downloaded from the Hugging Face Hub ({type(error).__name__}); "
            "check the id, the revision, your token and the network."
        ) from None
    local = open_checkpoint(folder)
    local.source, local.repo_id, local.revision = str(source), ckpt.repo_id, revision
    return local


def _check_output_folder(ckpt: Checkpoint, out: Path, force: bool) -> None:
    refuse_input_overlap(out, [("input checkpoint", ckpt.local_dir)], "output folder")
    check_writable_parent(out, "output folder")
    if os.path.lexists(out) and not force:
        raise DsparkError(f"{out} already exists; choose another output folder or pass the force option to replace it.")


def _check_markov_w2(ckpt: Checkpoint) -> TensorInfo:
    """Header-level refusals: no markov_w2, an already quantized head, a shape NVFP4 cannot hold."""
    tensors = ckpt.tensors
    info = tensors.get(MARKOV_W2)
    if info is None:
        raise DsparkError(
            f"{ckpt.source} has no tensor {MARKOV_W2!r}; dspark quantize needs a DSpark draft with a Markov head."
        )
    if info.dtype == "U8" or MARKOV_W2_SCALE in tensors or MARKOV_W2_GLOBAL_SCALE in tensors:
        raise DsparkError(
            f"{ckpt.source} already holds an NVFP4 {MARKOV_W2_MODULE} ({MARKOV_W2} is {info.dtype}"
            f"{', with weight_scale' if MARKOV_W2_SCALE in tensors else ''}); quantize the original bf16 checkpoint."
        )
    if "quantization_config" in ckpt.config or QUANT_CONFIG_FILE in ckpt.files:
        has_config = "quantization_config" in ckpt.config
        where = "config.json has a quantization_config" if has_config else f"it has {QUANT_CONFIG_FILE}"
        raise DsparkError(
            f"{ckpt.source} is already quantized ({where}); quantize the original unquantized checkpoint."
        )
    if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2 or 0 in info.shape:
        raise DsparkError(
            f"{ckpt.source}: {MARKOV_W2} is {info.dtype} {list(info.shape)}; expected a non-empty 2-D float tensor "
            "[draft_vocab_size, markov_rank]."
        )
    rank = info.shape[1]
    if rank % GROUP_SIZE:
        raise DsparkError(
            f"{ckpt.source}: {MARKOV_W2} has markov_rank r = {rank}, not a multiple of the NVFP4 group size 16, "
            "so vLLM cannot load it as NVFP4; keep this head in bf16."
        )
    return info


def _rank_warnings(rank: int) -> list[str]:
    if rank % MARLIN_K_MULTIPLE:
        return [
            f"markov_rank r = {rank} is not a multiple of {MARLIN_K_MULTIPLE}: the checkpoint is valid NVFP4, but "
            "vLLM's Marlin W4A16 kernel needs r % 64 == 0 and may refuse to load it."
        ]
    return []


def _checked_amax(ckpt: Checkpoint, w2: torch.Tensor) -> float:
    """max |w2|, refusing NaN / Inf (they would poison every NVFP4 scale)."""
    low, high = torch.aminmax(w2)  # NaN propagates through both
    amax = max(abs(float(low)), abs(float(high)))
    if not math.isfinite(amax):
        bad = w2.numel() - int(torch.isfinite(w2).sum())
        raise DsparkError(
            f"{ckpt.source}: {MARKOV_W2} has {bad} NaN or Inf values, which would poison every NVFP4 scale; "
            "fix the checkpoint first."
        )
    return amax


def _quantize(w2: torch.Tensor, engine: str) -> NVFP4Weight:
    """[Vd, r] float -> NVFP4Weight with the chosen engine (the two are bit-identical)."""
    try:
        if engine == "torch":
            return nvfp4.quantize_nvfp4(w2)
        with warnings.catch_warnings():  # ModelOpt warns on import about untested transformers versions
            warnings.filterwarnings("ignore", category=UserWarning, module=r"modelopt(\.|$)")
            return nvfp4.quantize_nvfp4_modelopt(w2)
    except ImportError:
        raise DsparkError(MODELOPT_MISSING) from None
    except ValueError as error:
        raise DsparkError(f"{MARKOV_W2} cannot be quantized: {error}.") from None


# --- quality figures --------------------------------------------------------------------------------------------


def weight_error(w2: torch.Tensor, weight: NVFP4Weight) -> tuple[WeightError, torch.Tensor]:
    """Compare dequantize(weight) with w2 [N, K] (both exact in fp32), in row chunks.

    Returns the relative Frobenius error, cosine and max abs error, and the dequantized weight in bf16 [N, K]
    (for the bias screen). cosine = (|a|² + |b|² - |a-b|²) / (2|a||b|) stays accurate when it is close to 1;
    a zero w2 reconstructed exactly has error 0 and cosine 1.
    """
    dequantized_bf16 = torch.empty(w2.shape, dtype=torch.bfloat16)
    sum_ref = sum_approx = sum_diff = 0.0
    max_abs = 0.0
    for start in range(0, w2.shape[0], _ERROR_CHUNK_ROWS):
        stop = start + _ERROR_CHUNK_ROWS
        reference = w2[start:stop].float()  # [R, K]
        rows = NVFP4Weight(weight.packed[start:stop], weight.scale[start:stop], weight.global_scale)
        approx = dequantize_nvfp4(rows)  # [R, K] fp32
        dequantized_bf16[start:stop] = approx
        sum_ref += _sum_squares(reference)
        sum_approx += _sum_squares(approx)
        diff = approx.sub_(reference)
        sum_diff += _sum_squares(diff)
        max_abs = max(max_abs, float(torch.linalg.vector_norm(diff, ord=float("inf"))))
    if sum_ref == 0.0:
        exact = sum_approx == 0.0
        error = WeightError(0.0 if exact else float("inf"), 1.0 if exact else 0.0, max_abs)
    else:
        norms = (sum_ref * sum_approx) ** 0.5
        cosine = (sum_ref + sum_approx - sum_diff) / (2 * norms) if norms > 0 else 0.0
        error = WeightError((sum_diff / sum_ref) ** 0.5, cosine, max_abs)
    return error, dequantized_bf16


def _bias_agreement(
    ckpt: Checkpoint,
    w2: torch.Tensor,
    weight: NVFP4Weight,
    w2_nvfp4_bf16: torch.Tensor,
    sample_rows: int | None,
    seed: int,
    report_warnings: list[str],
) -> BiasAgreement | None:
    sample_rows = DEFAULT_SAMPLE_ROWS if sample_rows is None else sample_rows
    if sample_rows <= 0:
        return None
    rank = w2.shape[1]
    w1_info = ckpt.tensors.get(MARKOV_W1)
    if w1_info is None or len(w1_info.shape) != 2 or w1_info.shape[1] != rank or not w1_info.is_float:
        found = "absent" if w1_info is None else f"{w1_info.dtype} {list(w1_info.shape)}"
        report_warnings.append(
            f"{MARKOV_W1} is {found}, not a float [vocab_size, {rank}] matrix; bias agreement not measured."
        )
        return None
    w1 = ckpt.load_tensor(MARKOV_W1)  # [V, r]
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randperm(w1.shape[0], generator=generator)[:sample_rows].sort().values  # [S]
    embeds = w1[rows].float()  # [S, r]
    del w1
    return bias_agreement(embeds, w2, weight, w2_nvfp4_bf16)


def bias_agreement(
    embeds: torch.Tensor, w2: torch.Tensor, weight: NVFP4Weight, w2_nvfp4_bf16: torch.Tensor
) -> BiasAgreement:
    """Markov biases embeds [S, r] @ W2^T of the original W2 [Vd, r] and of the NVFP4 one (`weight`, with its
    bf16 dequantization `w2_nvfp4_bf16`): top-1 agreement, top-16 overlap, relative error.

    A screen matmul over all Vd entries, in whichever of bf16 and fp32 is faster on this CPU (matmul_dtype.py:
    bf16 is 2-5x faster than fp32 with AVX512-BF16/AMX and 5-7x slower without), picks 32 candidates per vector;
    the top-16 / top-1 are then decided on exact fp32 biases of those candidates (bf16 output rounding, 2^-9
    relative, would create ties at the top). The relative error is taken from the screen biases (the bf16 figure
    was measured within 1e-4 of the fp32 one). Runs in chunks of previous tokens, so the [S, Vd] bias matrices
    never exist whole.
    """
    k = min(TOP_K_OVERLAP, w2.shape[0])
    candidates = min(_BIAS_CANDIDATES, w2.shape[0])
    screen = fast_matmul_dtype()
    w2_screen, w2_nvfp4_screen = w2.to(screen), w2_nvfp4_bf16.to(screen)  # no copy when already in that dtype
    top1_same = 0
    overlap = 0.0
    sum_ref = sum_diff = 0.0
    for start in range(0, embeds.shape[0], _BIAS_CHUNK_ROWS):
        chunk = embeds[start : start + _BIAS_CHUNK_ROWS]  # [C, r] fp32
        reference = chunk.to(screen) @ w2_screen.T  # [C, r] -> [C, Vd]
        approx = chunk.to(screen) @ w2_nvfp4_screen.T  # [C, Vd]
        ref_ids = reference.topk(candidates, dim=-1).indices  # [C, M]
        approx_ids = approx.topk(candidates, dim=-1).indices  # [C, M]
        ref_top = _exact_top(chunk, ref_ids, w2[ref_ids].float(), k)  # [C, k], largest first
        approx_rows = dequantize_rows_nvfp4(weight, approx_ids.flatten()).view(*approx_ids.shape, -1)  # [C, M, r]
        approx_top = _exact_top(chunk, approx_ids, approx_rows, k)  # [C, k]
        top1_same += int((ref_top[:, 0] == approx_top[:, 0]).sum())
        overlap += float((ref_top.unsqueeze(-1) == approx_top.unsqueeze(-2)).any(dim=-1).sum()) / k
        sum_ref += _sum_squares(reference)
        sum_diff += _sum_squares(approx.sub_(reference))
    count = embeds.shape[0]
    relative = (sum_diff / sum_ref) ** 0.5 if sum_ref > 0 else (0.0 if sum_diff == 0 else float("inf"))
    return BiasAgreement(rows=count, top1_agreement=top1_same / count, top16_overlap=overlap / count,
                         relative_error=relative)


def _sum_squares(x: torch.Tensor) -> float:
    """Σ x² of a [R, K] tensor: row norms in fp32, their squares summed in fp64 (a single fp32 reduction over
    millions of elements drifts by ~1e-4)."""
    return float(torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).double().square().sum())


def _exact_top(embeds: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The k candidate ids with the largest exact fp32 bias, largest first.

    embeds [C, r] fp32, ids [C, M], rows [C, M, r] fp32 (the W2 rows of `ids`) -> [C, k].
    """
    exact = torch.bmm(rows, embeds.unsqueeze(-1)).squeeze(-1)  # [C, M, r] @ [C, r, 1] -> [C, M]
    return ids.gather(1, exact.topk(k, dim=-1).indices)


# --- writing ----------------------------------------------------------------------------------------------------


def quant_configs() -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json, config.json `quantization_config`): MIXED_PRECISION with markov_w2 as the one
    W4A16_NVFP4 layer, so every other layer stays unquantized. The second is what ModelOpt's
    `convert_hf_quant_config_format` makes of the first."""
    layer = {"quant_algo": "W4A16_NVFP4", "group_size": GROUP_SIZE}
    hf_quant_config = {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "exclude_modules": [],
            "quantized_layers": {VLLM_MARKOV_W2_PREFIX: dict(layer)},
        },
    }
    quantization_config = {
        "config_groups": {
            "group_0": {
                "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE},
                "targets": [VLLM_MARKOV_W2_PREFIX],
            }
        },
        "quantized_layers": {VLLM_MARKOV_W2_PREFIX: dict(layer)},
        "ignore": [],
        "quant_algo": "MIXED_PRECISION",
        "producer": dict(PRODUCER),
        "quant_method": "modelopt",
    }
    return hf_quant_config, quantization_config


def write_quantized_checkpoint(
    ckpt: Checkpoint, w2_info: TensorInfo, weight: NVFP4Weight, folder: Path, warnings_out: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """Fill `folder` with the quantized checkpoint; returns (hard-linked files, copied files).

    Only the checkpoint's own files are linked or copied (regular files inside it: `Checkpoint.files`; opening it
    already refused a weight shard that leads elsewhere); each skipped entry is named in `warnings_out`. Files keep
    their modes.
    """
    linked: list[str] = []
    copied: list[str] = []
    new_tensors = {
        MARKOV_W2: weight.packed,  # uint8 [Vd, r/2]
        MARKOV_W2_SCALE: weight.scale,  # float8_e4m3fn [Vd, r/16]
        MARKOV_W2_GLOBAL_SCALE: weight.global_scale.reshape(()),  # float32 [] (vLLM and ModelOpt write a scalar)
    }
    if warnings_out is not None:
        warnings_out.extend(f"{name} was not copied: it is not a regular file inside the checkpoint (a link leading "
                            "outside it, a FIFO or a device)." for name in ckpt.skipped)
    for name in ckpt.files:
        if name in (CONFIG_FILE, INDEX_FILE):
            continue  # written below
        source = ckpt.local_dir / name
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if name == w2_info.file:
            rewrite_safetensors(source, target, drop=MARKOV_W2, add=new_tensors)
            shutil.copymode(source, target)
        elif name.endswith(".safetensors"):
            (linked if _link_or_copy(source, target) else copied).append(name)
        else:
            _copy_with_mode(source, target)
            copied.append(name)
    hf_quant_config, quantization_config = quant_configs()
    config = {**ckpt.config, "quantization_config": quantization_config}
    _write_json(folder / CONFIG_FILE, config, mode_from=ckpt.local_dir / CONFIG_FILE)
    _write_json(folder / QUANT_CONFIG_FILE, hf_quant_config)
    if ckpt.index is not None:
        _write_json(folder / INDEX_FILE, _updated_index(ckpt, w2_info, new_tensors),
                    mode_from=ckpt.local_dir / INDEX_FILE)
    return linked, copied


def _link_or_copy(source: Path, target: Path) -> bool:
    """Hard-link `target` to the file behind `source` (symlinks resolved); copy when linking fails. True if linked."""
    try:
        os.link(source.resolve(), target)
        return True
    except OSError:
        _copy_with_mode(source, target)
        return False


def _copy_with_mode(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    shutil.copymode(source, target)  # a 0600 file stays 0600


def _write_json(path: Path, document: dict[str, Any], mode_from: Path | None = None) -> None:
    """Write a JSON file; with `mode_from` (the input file it replaces) it takes that file's mode."""
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    if mode_from is not None and mode_from.is_file():
        shutil.copymode(mode_from, path)


def _updated_index(ckpt: Checkpoint, w2_info: TensorInfo, new_tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    index = json.loads(json.dumps(ckpt.index))  # deep copy of plain JSON
    weight_map = {name: file for name, file in index["weight_map"].items() if name != MARKOV_W2}
    weight_map.update({name: w2_info.file for name in new_tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    total = sum(info.nbytes for info in ckpt.tensors.values()) - w2_info.nbytes
    total += sum(_nbytes(tensor) for tensor in new_tensors.values())
    index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
    return index


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# --- safetensors shard rewriting --------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
                       torch.bfloat16: "BF16", torch.float16: "F16"}


def rewrite_safetensors(source: Path, target: Path, *, drop: str, add: dict[str, torch.Tensor]) -> None:
    """Write `target` = safetensors file `source` without tensor `drop`, plus the tensors `add`.

    The source's header is read and checked again (checkpoint.read.read_safetensors_header), so the offsets are
    the file's as it is now. Kept tensors are copied as raw bytes (bit-exact, never decoded) and the header's
    __metadata__ is kept.
    Tensors are laid out by decreasing element size, then name, so every tensor starts aligned to its element.
    """
    infos, metadata = read_safetensors_header(source)
    entries: list[tuple[str, str, list[int], Any]] = []  # (name, dtype, shape, (begin, end) in source | tensor)
    for name, info in infos.items():
        if name != drop:
            entries.append((name, info.dtype, list(info.shape), (info.begin, info.end)))
    for name, tensor in add.items():
        entries.append((name, _SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), tensor))
    entries.sort(key=lambda e: (-DTYPE_BYTES[e[1]], e[0]))

    new_header: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, payload in entries:
        size = payload[1] - payload[0] if isinstance(payload, tuple) else _nbytes(payload)
        new_header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(new_header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned

    with open(source, "rb") as src, open(target, "wb") as dst:
        dst.write(struct.pack("<Q", len(header_bytes)))
        dst.write(header_bytes)
        for _, _, _, payload in entries:
            if isinstance(payload, tuple):
                _copy_range(src, dst, *payload)
            else:
                dst.write(payload.contiguous().reshape(-1).view(torch.uint8).numpy())


def _copy_range(src: BinaryIO, dst: BinaryIO, begin: int, end: int) -> None:
    src.seek(begin)
    remaining = end - begin
    while remaining:
        chunk = src.read(min(remaining, _COPY_BUFFER_BYTES))
        if not chunk:
            raise DsparkError(f"{src.name} ended before byte {end}; the file is truncated, re-download it.")
        dst.write(chunk)
        remaining -= len(chunk)
