"""`dspark quantize --scope draft`: the draft's decoder Linear layers (and optionally its lm_head) in one of ModelOpt's
formats, in the MIXED_PRECISION layout `--scope markov` already writes for markov_w2 (docs/quantize.md):

- nvfp4: W4A16 NVFP4. Each `X.weight` becomes `X.weight` (uint8 [N, K/2]), `X.weight_scale` (float8_e4m3fn
  [N, K/16]) and `X.weight_scale_2` (float32 []).
- fp8: W8A8 per-tensor FP8 with static activation scales. Each `X.weight` becomes `X.weight` (float8_e4m3fn [N, K]),
  `X.weight_scale` (float32 []) and `X.input_scale` (float32 [], amax of the layer's input on calibration prompts
  through the target / 448).

Quantized: o_proj, gate/up/down of every layer and fc; q/k/v and the lm_head only when asked (vLLM multiplies the
stored q/k/v weights densely for the context K/V and builds the draft's lm_head unquantized, so it refuses both:
validate's DSP731 / DSP732). Never norms, embeddings, the Markov head or the confidence head. The shards of a
fused vLLM layer (q/k/v, gate/up) are quantized together so they share one scale (NVFP4's weight_scale_2, FP8's
weight_scale and input_scale), as ModelOpt's export makes them (vLLM keeps one scale per fused layer). Every tensor is written to one
model.safetensors, every other file copied. The folder is validated before the rename (no error may remain), then
optionally put through the acceptance guard (bench/runtime_guard.py), and published atomically.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.kernels.nvfp4 import GROUP_SIZE, NVFP4Weight, dequantize_nvfp4
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2, canonical_name, linear_modules, vllm_prefix
from dspark_cli.runtime.checkpoint.read import CONFIG_FILE, FLOAT_DTYPES, INDEX_FILE, QUANT_CONFIG_FILE, Checkpoint
from dspark_cli.runtime.io.outputs import atomic_output_dir
from dspark_cli.kernels import fp8
from dspark_cli.runtime.quantize.write import (
    ENGINES,
    MODELOPT_MISSING,
    PRODUCER,
    _check_output_folder,
    _copy_with_mode,
    _local_checkpoint,
    _quantize,
    _write_json,
)

NEVER_QUANTIZED = ("confidence_head.proj.weight", MARKOV_W2)  # the heads scope draft leaves alone
LM_HEAD = "lm_head.weight"
FORMATS = ("nvfp4", "fp8")
LAYER_ALGO = {"nvfp4": {"quant_algo": "W4A16_NVFP4", "group_size": GROUP_SIZE}, "fp8": {"quant_algo": "FP8"}}


@dataclass(frozen=True)
class Calibration:
    """What FP8's activation scales are measured on: the target and prompts (quantize/calibrate.py)."""

    target: str
    prompts: tuple[str, ...]
    max_new_tokens: int = 64


@dataclass
class DraftQuantizeReport:
    """What `quantize_draft` wrote: the quantized weights, sizes and the worst weight error among them."""

    source: str
    output: str
    format: str  # "nvfp4" or "fp8"
    quantized_layers: list[str]  # vLLM prefixes, e.g. "model.layers.0.mlp.gate_proj"
    lm_head: bool
    qkv: bool
    bytes_before: int  # the quantized weights as stored in the input
    bytes_after: int  # their weight and scales
    worst_relative_frobenius_error: float
    worst_layer: str
    input_scales: dict[str, float] = field(default_factory=dict)  # fp8: vLLM prefix -> input_scale
    calibration_prompts: int = 0
    guard: dict | None = None  # the acceptance guard's figures (bench/runtime_guard.py), when it ran
    warnings: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_before / self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compression_ratio": self.compression_ratio, "scope": "draft"}


def quantize_draft(
    source: str | os.PathLike, out: str | os.PathLike, *, fmt: str = "nvfp4", lm_head: bool = False,
    qkv: bool = False, engine: str = "modelopt", force: bool = False, revision: str | None = None,
    calibration: Calibration | None = None, guard: Callable[[Path, Path], dict] | None = None,
) -> DraftQuantizeReport:
    """Write a copy of draft `source` to `out` with its Linear layers in `fmt` (see the module docstring).

    `engine` as for scope markov: "modelopt" (ModelOpt's quantizers) or "torch" (bit-identical). FP8 needs
    `calibration`. `guard(source folder, written folder)` runs on the finished folder before it is published; it
    raises to refuse (nothing is written) and returns figures to keep in the report.
    """
    started = time.perf_counter()
    if engine not in ENGINES:
        raise DsparkError(f"Unknown engine {engine!r}; choose one of {', '.join(ENGINES)}.")
    if fmt not in FORMATS:
        raise DsparkError(f"Unknown format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if fmt == "fp8" and calibration is None:
        raise DsparkError("FP8 needs static activation scales measured through the target: give the target and "
                          "a calibration prompt file.")
    if fmt == "nvfp4" and calibration is not None:
        raise DsparkError("NVFP4 W4A16 keeps activations in bf16 and needs no calibration; drop the calibration "
                          "prompts.")
    ckpt = _local_checkpoint(source, revision)
    out = Path(out)
    _check_output_folder(ckpt, out, force)
    _refuse_quantized(ckpt)
    groups = quantized_groups(ckpt, lm_head, fmt, qkv)
    amax = _calibrate(ckpt, groups, calibration) if calibration is not None else {}
    tensors = {name: ckpt.load_tensor(name) for name in ckpt.tensors}
    report = DraftQuantizeReport(ckpt.source, str(out), fmt, [], lm_head, qkv, 0, 0, 0.0, "",
                                 calibration_prompts=len(calibration.prompts) if calibration else 0)
    report.warnings += _engine_warnings(qkv, lm_head)
    for names in groups:
        originals = [tensors[name] for name in names]
        new_tensors, dequantized = (_nvfp4_group(names, originals, engine) if fmt == "nvfp4"
                                    else _fp8_group(names, originals, engine, max(amax[name] for name in names)))
        for name, original, approx in zip(names, originals, dequantized):
            error = _relative_error(original, approx)
            if error >= report.worst_relative_frobenius_error:
                report.worst_relative_frobenius_error, report.worst_layer = error, name
            report.bytes_before += original.numel() * original.element_size()
            layer = vllm_prefix(name).removesuffix(".weight")
            report.quantized_layers.append(layer)
            if fmt == "fp8":
                report.input_scales[layer] = float(new_tensors[f"{name.removesuffix('.weight')}.input_scale"])
        report.bytes_after += sum(t.numel() * t.element_size() for t in new_tensors.values())
        tensors.update(new_tensors)
    with atomic_output_dir(out, force) as folder:
        _write(ckpt, folder, tensors, report.quantized_layers, fmt)
        _verify(folder)
        if guard is not None:
            report.guard = guard(ckpt.local_dir, folder)
    report.wall_s = time.perf_counter() - started
    return report


def _engine_warnings(qkv: bool, lm_head: bool) -> list[str]:
    """What the serving engines refuse in this output (validate's engine codes), one sentence each."""
    out = []
    if qkv:
        out.append("q/k/v are quantized: vLLM (DSP731) and SGLang (DSP705) refuse this draft, their context K/V "
                   "multiplying the stored weights densely; dspark's runtime and a converted llama.cpp GGUF run it.")
    if lm_head:
        out.append("the lm_head is quantized: vLLM refuses this draft (DSP732), its draft lm_head being "
                   "unquantized; dspark's runtime and a converted llama.cpp GGUF run it.")
    return out


def _nvfp4_group(names: tuple[str, ...], weights: list[torch.Tensor], engine: str
                 ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The group's NVFP4 tensors (one shared weight_scale_2), and each weight dequantized for the error figures."""
    out, dequantized = {}, []
    for name, weight in zip(names, _quantize_together(weights, engine)):
        module = name.removesuffix(".weight")
        out[name] = weight.packed  # uint8 [N, K/2]
        out[f"{module}.weight_scale"] = weight.scale  # float8_e4m3fn [N, K/16]
        out[f"{module}.weight_scale_2"] = weight.global_scale.reshape(())  # float32 []
        dequantized.append(dequantize_nvfp4(weight, torch.float32))  # [N, K]
    return out, dequantized


def _fp8_group(names: tuple[str, ...], weights: list[torch.Tensor], engine: str,
               input_amax: float) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The group's FP8 tensors (one weight_scale from the joint amax, one input_scale from the calibrated amax), and
    each weight dequantized for the error figures."""
    quantize = fp8.quantize_fp8 if engine == "torch" else fp8.quantize_fp8_modelopt
    scale = fp8.fp8_scale(max(float(w.float().abs().max()) for w in weights))
    input_scale = torch.tensor(fp8.fp8_scale(input_amax), dtype=torch.float32)  # []
    out, dequantized = {}, []
    for name, weight in zip(names, weights):
        module = name.removesuffix(".weight")
        try:
            quantized = quantize(weight, scale)
        except ImportError:
            raise DsparkError(MODELOPT_MISSING) from None
        except ValueError as error:
            raise DsparkError(f"{name} cannot be quantized: {error}.") from None
        out[name] = quantized.data  # float8_e4m3fn [N, K]
        out[f"{module}.weight_scale"] = quantized.scale.reshape(())  # float32 []
        out[f"{module}.input_scale"] = input_scale.clone()  # float32 []
        dequantized.append(fp8.dequantize_fp8(quantized))  # [N, K]
    return out, dequantized


def _relative_error(original: torch.Tensor, dequantized: torch.Tensor) -> float:
    reference = original.float()
    norm = float(torch.linalg.vector_norm(reference))
    diff = float(torch.linalg.vector_norm(dequantized - reference))
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def _calibrate(ckpt: Checkpoint, groups: list[tuple[str, ...]], calibration: Calibration) -> dict[str, float]:
    """Per on-disk weight name: the max |input| its module saw on the calibration prompts."""
    from dspark_cli.runtime.quantize.calibrate import activation_amax

    modules = {name: canonical_name(name).removesuffix(".weight") for names in groups for name in names}
    amax = activation_amax(calibration.target, str(ckpt.local_dir), sorted(set(modules.values())),
                           calibration.prompts, calibration.max_new_tokens)
    return {name: amax[module] for name, module in modules.items()}


def quantized_groups(ckpt: Checkpoint, lm_head: bool, fmt: str = "nvfp4", qkv: bool = False
                     ) -> list[tuple[str, ...]]:
    """On-disk weight names to quantize, grouped by the vLLM layer they fuse into (one shared scale each)."""
    config = DraftConfig.from_dict(ckpt.config)
    groups = []
    for module in linear_modules(config):
        names = tuple(name for name in module.weights if name in ckpt.tensors)
        if not names or names[0] in NEVER_QUANTIZED:
            continue
        if (names[0] == LM_HEAD and not lm_head) or (module.prefix.endswith(".qkv_proj") and not qkv):
            continue
        for name in names:
            info = ckpt.tensors[name]
            if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2:
                raise DsparkError(f"{ckpt.source}: {name} is {info.dtype} {list(info.shape)}; quantizing needs a "
                                  "2-D float weight.")
            if fmt == "nvfp4" and info.shape[1] % GROUP_SIZE:
                raise DsparkError(f"{ckpt.source}: {name} is {list(info.shape)}; NVFP4 needs input features that "
                                  f"are a multiple of {GROUP_SIZE} (FP8 has no such rule).")
        groups.append(names)
    if lm_head and LM_HEAD not in ckpt.tensors:
        raise DsparkError(f"{ckpt.source} has no {LM_HEAD} of its own (it shares the target's); quantize without "
                          "the lm-head option.")
    return groups


def _refuse_quantized(ckpt: Checkpoint) -> None:
    if "quantization_config" in ckpt.config or QUANT_CONFIG_FILE in ckpt.files:
        raise DsparkError(f"{ckpt.source} is already quantized; quantize the original unquantized checkpoint.")


def _quantize_together(weights: list[torch.Tensor], engine: str) -> list[NVFP4Weight]:
    """NVFP4 of the row-concatenation of `weights` (each [N_i, K]), split back: one shared weight_scale_2."""
    joint = _quantize(torch.cat(weights), engine)  # [ΣN_i, K]
    out, start = [], 0
    for weight in weights:
        stop = start + weight.shape[0]
        out.append(NVFP4Weight(joint.packed[start:stop].clone(), joint.scale[start:stop].clone(),
                                joint.global_scale.clone()))
        start = stop
    return out


def quant_configs(layers: list[str], fmt: str = "nvfp4") -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json, config.json `quantization_config`): MIXED_PRECISION, each layer W4A16_NVFP4 or FP8,
    the latter as ModelOpt's convert_hf_quant_config_format makes it of the former (targets sorted)."""
    entries = {layer: dict(LAYER_ALGO[fmt]) for layer in layers}
    hf_quant_config = {
        "producer": dict(PRODUCER),
        "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
                         "quantized_layers": json.loads(json.dumps(entries))},
    }
    if fmt == "fp8":
        group = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                 "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
    else:
        group = {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}}
    quantization_config = {
        "config_groups": {"group_0": {**group, "targets": sorted(layers)}},
        "quantized_layers": entries,
        "ignore": [],
        "quant_algo": "MIXED_PRECISION",
        "producer": dict(PRODUCER),
        "quant_method": "modelopt",
    }
    return hf_quant_config, quantization_config


def _write(ckpt: Checkpoint, folder: Path, tensors: dict[str, torch.Tensor], layers: list[str], fmt: str) -> None:
    from safetensors.torch import save_file

    for name in ckpt.files:
        if name in (CONFIG_FILE, INDEX_FILE) or name.endswith(".safetensors"):
            continue  # all tensors go to one model.safetensors below
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy_with_mode(ckpt.local_dir / name, target)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    hf_quant_config, quantization_config = quant_configs(layers, fmt)
    _write_json(folder / CONFIG_FILE, {**ckpt.config, "quantization_config": quantization_config},
                mode_from=ckpt.local_dir / CONFIG_FILE)
    _write_json(folder / QUANT_CONFIG_FILE, hf_quant_config)


def _verify(folder: Path) -> None:
    """validate's rules on the written folder: no error may remain (engine-only codes aside)."""
    from dspark_cli.runtime.checkpoint.read import open_checkpoint
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
    from dspark_cli.runtime.engines import ENGINE_ONLY_CODES

    errors = [e for e in validate_checkpoint(open_checkpoint(folder)).errors if e.code not in ENGINE_ONLY_CODES]
    if errors:
        raise DsparkError(f"the quantized draft failed its own check ({errors[0].code}: {errors[0].message}); "
                          "nothing was written. Please report this with the input checkpoint.")
