"""`dspark quantize --scope draft`: the draft's decoder Linear layers (and optionally its lm_head) in ModelOpt's
W4A16 NVFP4, in the MIXED_PRECISION layout `--scope markov` already writes for markov_w2 (docs/quantize.md).

Quantized: every layer weight of linear_modules (q/k/v/o, gate/up/down) and fc; lm_head only when asked. Never
norms, embeddings, the Markov head or the confidence head. The shards of a fused vLLM layer (q/k/v, gate/up) are
quantized together so they share one weight_scale_2, as ModelOpt's export makes them (vLLM keeps one global scale
per fused layer). Each quantized `X.weight` becomes `X.weight` (uint8 [N, K/2]), `X.weight_scale`
(float8_e4m3fn [N, K/16]) and `X.weight_scale_2` (float32 []); every tensor is written to one model.safetensors,
every other file copied. The folder is validated before the rename (no error may remain) and published atomically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.kernels.nvfp4 import GROUP_SIZE, NVFP4Weight
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2, linear_modules, vllm_prefix
from dspark_cli.runtime.checkpoint.read import CONFIG_FILE, FLOAT_DTYPES, INDEX_FILE, QUANT_CONFIG_FILE, Checkpoint
from dspark_cli.runtime.io.outputs import atomic_output_dir
from dspark_cli.runtime.quantize.write import (
    ENGINES,
    PRODUCER,
    _check_output_folder,
    _copy_with_mode,
    _local_checkpoint,
    _quantize,
    _write_json,
    weight_error,
)

NEVER_QUANTIZED = ("confidence_head.proj.weight", MARKOV_W2)  # the heads scope draft leaves alone
LM_HEAD = "lm_head.weight"


@dataclass
class DraftQuantizeReport:
    """What `quantize_draft` wrote: the quantized weights, sizes and the worst weight error among them."""

    source: str
    output: str
    quantized_layers: list[str]  # vLLM prefixes, e.g. "model.layers.0.self_attn.q_proj"
    lm_head: bool
    bytes_before: int  # the quantized weights as stored in the input
    bytes_after: int  # their weight + weight_scale + weight_scale_2
    worst_relative_frobenius_error: float
    worst_layer: str
    warnings: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_before / self.bytes_after

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compression_ratio": self.compression_ratio, "scope": "draft", "format": "nvfp4"}


def quantize_draft(
    source: str | os.PathLike, out: str | os.PathLike, *, lm_head: bool = False, engine: str = "modelopt",
    force: bool = False, revision: str | None = None,
) -> DraftQuantizeReport:
    """Write a copy of draft `source` to `out` with its Linear layers in NVFP4 W4A16 (see the module docstring).

    `engine` as for scope markov: "modelopt" (ModelOpt's NVFP4QTensor) or "torch" (bit-identical).
    """
    started = time.perf_counter()
    if engine not in ENGINES:
        raise DsparkError(f"Unknown engine {engine!r}; choose one of {', '.join(ENGINES)}.")
    ckpt = _local_checkpoint(source, revision)
    out = Path(out)
    _check_output_folder(ckpt, out, force)
    _refuse_quantized(ckpt)
    groups = quantized_groups(ckpt, lm_head)
    tensors = {name: ckpt.load_tensor(name) for name in ckpt.tensors}
    before = after = 0
    worst, worst_layer = 0.0, ""
    for names in groups:
        weights = _quantize_together([tensors[name] for name in names], engine)
        for name, weight in zip(names, weights):
            error, _ = weight_error(tensors[name], weight)
            if error.relative_frobenius >= worst:
                worst, worst_layer = error.relative_frobenius, name
            before += tensors[name].numel() * tensors[name].element_size()
            module = name.removesuffix(".weight")
            tensors[name] = weight.packed  # uint8 [N, K/2]
            tensors[f"{module}.weight_scale"] = weight.scale  # float8_e4m3fn [N, K/16]
            tensors[f"{module}.weight_scale_2"] = weight.global_scale.reshape(())  # float32 []
            after += weight.packed.numel() + weight.scale.numel() + 4
    layers = [vllm_prefix(name).removesuffix(".weight") for names in groups for name in names]
    with atomic_output_dir(out, force) as folder:
        _write(ckpt, folder, tensors, layers)
        _verify(folder)
    return DraftQuantizeReport(ckpt.source, str(out), layers, lm_head, before, after, worst, worst_layer,
                               wall_s=time.perf_counter() - started)


def quantized_groups(ckpt: Checkpoint, lm_head: bool) -> list[tuple[str, ...]]:
    """On-disk weight names to quantize, grouped by the vLLM layer they fuse into (one weight_scale_2 each)."""
    config = DraftConfig.from_dict(ckpt.config)
    groups = []
    for module in linear_modules(config):
        names = tuple(name for name in module.weights if name in ckpt.tensors)
        if not names or names[0] in NEVER_QUANTIZED or (names[0] == LM_HEAD and not lm_head):
            continue
        for name in names:
            info = ckpt.tensors[name]
            if info.dtype not in FLOAT_DTYPES or len(info.shape) != 2 or info.shape[1] % GROUP_SIZE:
                raise DsparkError(f"{ckpt.source}: {name} is {info.dtype} {list(info.shape)}; NVFP4 needs a 2-D "
                                  f"float weight whose input features are a multiple of {GROUP_SIZE}.")
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


def quant_configs(layers: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(hf_quant_config.json, config.json `quantization_config`): MIXED_PRECISION, each layer W4A16_NVFP4."""
    entries = {layer: {"quant_algo": "W4A16_NVFP4", "group_size": GROUP_SIZE} for layer in layers}
    hf_quant_config = {
        "producer": dict(PRODUCER),
        "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
                         "quantized_layers": json.loads(json.dumps(entries))},
    }
    quantization_config = {
        "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                  "group_size": GROUP_SIZE}, "targets": list(layers)}},
        "quantized_layers": entries,
        "ignore": [],
        "quant_algo": "MIXED_PRECISION",
        "producer": dict(PRODUCER),
        "quant_method": "modelopt",
    }
    return hf_quant_config, quantization_config


def _write(ckpt: Checkpoint, folder: Path, tensors: dict[str, torch.Tensor], layers: list[str]) -> None:
    from safetensors.torch import save_file

    for name in ckpt.files:
        if name in (CONFIG_FILE, INDEX_FILE) or name.endswith(".safetensors"):
            continue  # all tensors go to one model.safetensors below
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy_with_mode(ckpt.local_dir / name, target)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    hf_quant_config, quantization_config = quant_configs(layers)
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
