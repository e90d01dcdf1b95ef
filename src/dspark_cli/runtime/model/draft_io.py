"""Loading and saving a DSparkDraft: DeepSpec / vLLM tensor names (docs/format.md §1.2, §2), weights shared with
the target, the NVFP4 markov_w2 and the NVFP4 / FP8 Linear layers of a quantized checkpoint, and the files a draft
is written as."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import Checkpoint, open_checkpoint
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.model.draft import DSparkDraft
from dspark_cli.runtime.checkpoint.layout import IGNORED_BY_VLLM, MARKOV_W2, QUANT_SUFFIXES, canonical_name


def load_draft(
    source: str | os.PathLike | Checkpoint,
    *,
    target_embed: torch.Tensor | None = None,
    target_lm_head: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DSparkDraft:
    """Load a DeepSpec/vLLM-format draft; missing embed_tokens / lm_head are shared from the target's."""
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    config = DraftConfig.from_dict(ckpt.config)
    config.require_runnable(ckpt.source)
    names = {canonical_name(name): name for name in ckpt.tensors if not name.startswith(IGNORED_BY_VLLM)}
    if config.enable_confidence_head and not any(n.startswith("confidence_head.") for n in names):
        config.enable_confidence_head = False  # vLLM silently drops a head without weights; so do we
    with torch.device("meta"):
        model = DSparkDraft(config)
    model = model.to_empty(device=device)
    _load_tensors(model, ckpt, names, target_embed, target_lm_head, dtype, device)
    model.to(dtype)
    if model.confidence_head is not None:
        model.confidence_head.float()  # vLLM holds the confidence head in fp32
    return model.eval()


def _load_tensors(model: DSparkDraft, ckpt, names, target_embed, target_lm_head, dtype, device) -> None:
    params = dict(model.named_parameters())
    scalars = {n: b for n, b in model.named_buffers() if n.endswith("layer_scalar")}  # Gemma-4: default 1.0
    params.update(scalars)
    nvfp4 = {}
    quantized_linears: dict[str, dict[str, torch.Tensor]] = {}
    for canonical, stored in names.items():
        if canonical.startswith("markov_head.markov_w2.") and (
            canonical != MARKOV_W2 or ckpt.tensors[stored].dtype == "U8"
        ):
            nvfp4[canonical.rsplit(".", 1)[-1]] = ckpt.load_tensor(stored)
            continue
        module, _, part = canonical.rpartition(".")
        if part in QUANT_SUFFIXES or (part == "weight" and ckpt.tensors[stored].dtype in ("U8", "F8_E4M3")):
            quantized_linears.setdefault(module, {})[part] = ckpt.load_tensor(stored)  # a scope-draft layer
            continue
        if canonical == "d2t":
            model.d2t = ckpt.load_tensor(stored).to(device=device, dtype=torch.long)
            continue
        if canonical not in params:
            raise DsparkError(f"{ckpt.source}: unexpected tensor {stored!r}; run `dspark validate` on it.")
        tensor = ckpt.load_tensor(stored)
        if tuple(tensor.shape) != tuple(params[canonical].shape):
            raise DsparkError(f"{ckpt.source}: tensor {stored!r} has shape {list(tensor.shape)} but the config "
                              f"implies {list(params[canonical].shape)}; run `dspark validate` on it.")
        with torch.no_grad():
            params[canonical].copy_(tensor.to(dtype))
    if nvfp4:
        _load_nvfp4_w2(model, nvfp4, ckpt.source, dtype, device)
    for module, parts in quantized_linears.items():
        if parts.get("weight") is not None and parts["weight"].dtype == torch.float8_e4m3fn:
            _load_fp8_linear(model, params, module, parts, ckpt.source, dtype)
        else:
            _load_nvfp4_linear(params, module, parts, ckpt.source, dtype)
    share_from_target(model, names, "embed_tokens.weight", target_embed, ckpt.source, dtype)
    share_from_target(model, names, "lm_head.weight", target_lm_head, ckpt.source, dtype)
    loaded = set(names) | {"embed_tokens.weight", "lm_head.weight"}
    with torch.no_grad():
        for name in set(scalars) - loaded:
            scalars[name].fill_(1.0)
    loaded |= set(scalars)
    if nvfp4:
        loaded.add(MARKOV_W2)
    loaded |= {f"{module}.weight" for module in quantized_linears}
    missing = sorted(set(params) - loaded)
    if missing:
        raise DsparkError(f"{ckpt.source}: required tensor {missing[0]!r} is missing"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                          "run `dspark validate` on it.")


def _load_nvfp4_w2(model: DSparkDraft, parts: dict[str, torch.Tensor], source: str, dtype, device) -> None:
    from dspark_cli.kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4

    if set(parts) != {"weight", "weight_scale", "weight_scale_2"}:
        raise DsparkError(f"{source}: the NVFP4 markov_w2 needs weight, weight_scale and weight_scale_2; found "
                          f"{sorted(parts)}; re-run `dspark quantize`.")
    model.w2_nvfp4 = NVFP4Weight(
        packed=parts["weight"].to(device),
        scale=parts["weight_scale"].to(device),
        global_scale=parts["weight_scale_2"].to(device=device, dtype=torch.float32).reshape(()),
    )
    dense = dequantize_nvfp4(model.w2_nvfp4, torch.float32)  # [Vd, r]
    w2 = model.markov_head.markov_w2.weight
    if tuple(dense.shape) != tuple(w2.shape):
        raise DsparkError(f"{source}: the NVFP4 markov_w2 dequantizes to {list(dense.shape)} but the config "
                          f"implies {list(w2.shape)}; run `dspark validate` on it.")
    with torch.no_grad():
        w2.copy_(dense.to(dtype))


def _load_nvfp4_linear(params, module: str, parts: dict[str, torch.Tensor], source: str, dtype) -> None:
    """A Linear layer `dspark quantize --scope draft` wrote in NVFP4 W4A16, dequantized to `dtype` at load."""
    from dspark_cli.kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4

    name = f"{module}.weight"
    if set(parts) != {"weight", "weight_scale", "weight_scale_2"} or name not in params:
        raise DsparkError(f"{source}: the NVFP4 layer {module} needs weight, weight_scale and weight_scale_2 of a "
                          f"Linear layer; found {sorted(parts)}; run `dspark validate` on it.")
    weight = NVFP4Weight(parts["weight"], parts["weight_scale"],
                         parts["weight_scale_2"].to(torch.float32).reshape(()))
    dense = dequantize_nvfp4(weight, torch.float32)  # [N, K]
    if tuple(dense.shape) != tuple(params[name].shape):
        raise DsparkError(f"{source}: the NVFP4 layer {module} dequantizes to {list(dense.shape)} but the config "
                          f"implies {list(params[name].shape)}; run `dspark validate` on it.")
    with torch.no_grad():
        params[name].copy_(dense.to(dtype))


def _load_fp8_linear(model: DSparkDraft, params, module: str, parts: dict[str, torch.Tensor], source: str,
                     dtype) -> None:
    """A Linear layer `dspark quantize --scope draft --format fp8` wrote (ModelOpt FP8, W8A8 per tensor): the weight
    dequantized to `dtype` at load, and the layer's input passed through FP8 with its static input_scale on every
    call, as vLLM's FP8 GEMM quantizes it."""
    from dspark_cli.kernels.fp8 import FP8Weight, dequantize_fp8, fake_quantize_fp8

    name = f"{module}.weight"
    if set(parts) != {"weight", "weight_scale", "input_scale"} or name not in params:
        raise DsparkError(f"{source}: the FP8 layer {module} needs weight, weight_scale and input_scale of a Linear "
                          f"layer; found {sorted(parts)}; run `dspark validate` on it.")
    weight_scale, input_scale = (parts[k].to(torch.float32).reshape(()) for k in ("weight_scale", "input_scale"))
    if not (torch.isfinite(weight_scale) and torch.isfinite(input_scale) and weight_scale > 0 and input_scale > 0):
        raise DsparkError(f"{source}: the FP8 layer {module} has weight_scale {float(weight_scale)} and input_scale "
                          f"{float(input_scale)}; both must be finite and positive; re-quantize it.")
    dense = dequantize_fp8(FP8Weight(parts["weight"], weight_scale))  # [N, K]
    if tuple(dense.shape) != tuple(params[name].shape):
        raise DsparkError(f"{source}: the FP8 layer {module} is {list(dense.shape)} but the config implies "
                          f"{list(params[name].shape)}; run `dspark validate` on it.")
    with torch.no_grad():
        params[name].copy_(dense.to(dtype))
    on_device = input_scale.to(params[name].device)  # once here, not on every call
    model.get_submodule(module).register_forward_pre_hook(
        lambda _, args: (fake_quantize_fp8(args[0], on_device), *args[1:]))


def share_from_target(model: DSparkDraft, names, name: str, weight: torch.Tensor | None, source: str,
                      dtype) -> None:
    """Use the target's `weight` as the draft's embed_tokens / lm_head (frozen) unless `names` holds the draft's own."""
    if name in names:
        return
    module = model.embed_tokens if name.startswith("embed") else model.lm_head
    if weight is None:
        raise DsparkError(f"{source} has no {name!r}; pass the target model so the draft can share its "
                          f"{name.split('.')[0]}.")
    if tuple(weight.shape) != tuple(module.weight.shape):
        what = "input vocab_size" if name.startswith("embed") else "draft_vocab_size"
        raise DsparkError(f"{source} shares {name!r} from the target, but the target's is {list(weight.shape)} "
                          f"and the draft's {what} needs {list(module.weight.shape)}; the pair is incompatible.")
    module.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    if name.startswith("embed"):
        model.shares_embed = True
    else:
        model.shares_lm_head = True


def tie_to_target(model: DSparkDraft, embed_weight: torch.Tensor | None, lm_head_weight: torch.Tensor | None) -> None:
    """Use the target's (frozen) embedding and lm_head, as DeepSpec trains and vLLM serves by default."""
    dtype = model.lm_head.weight.dtype
    if embed_weight is not None:
        share_from_target(model, {}, "embed_tokens.weight", embed_weight, "draft", dtype)
    if lm_head_weight is not None:
        share_from_target(model, {}, "lm_head.weight", lm_head_weight, "draft", dtype)


def save_draft(model: DSparkDraft, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               include_shared: bool = False, extra_config: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors atomically (replacing `path`)."""
    from dspark_cli.runtime.io.outputs import atomic_output_dir

    path = Path(path)
    with atomic_output_dir(path, force=True) as tmp:
        write_draft_files(model, tmp, dtype, include_shared, extra_config)
    return path


def write_draft_files(model: DSparkDraft, folder: Path, dtype: torch.dtype = torch.bfloat16,
                      include_shared: bool = False, extra_config: dict[str, Any] | None = None) -> None:
    """Write config.json + model.safetensors into the existing `folder` (callers make it atomic)."""
    from safetensors.torch import save_file

    config = {**model.config.raw, **(extra_config or {}), "torch_dtype": str(dtype).removeprefix("torch.")}
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(model.state_for_save(dtype, include_shared), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
