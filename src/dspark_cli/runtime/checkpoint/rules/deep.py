"""Deep value checks (DSP6xx, only with `deep`): NaN/Inf and all-zero weights, untrained norms, NVFP4 and FP8 scales,
the d2t map.

The one rule family that reads tensor data: each tensor with a value rule is loaded alone, in file order, so
memory stays at one tensor. Runs on every checkpoint, draft or not.
"""

from __future__ import annotations

from dspark_cli.runtime.checkpoint.read import CheckpointError, TensorInfo
from dspark_cli.runtime.checkpoint.rules.codes import Results
from dspark_cli.runtime.checkpoint.rules.context import RuleContext
from dspark_cli.runtime.checkpoint.rules.tensors import INTEGER_DTYPES

FLOAT_MATRIX_DTYPES = {"F16", "BF16", "F32", "F64"}


def tensor_values(ctx: RuleContext) -> Results:
    """Load each tensor that has a value rule, one at a time, in file order."""
    out = Results()
    if not ctx.deep:
        out.skip("DSP601-DSP607, DSP609", "tensor values are checked only with the deep option")
        return out
    for info in sorted(ctx.on_disk.values(), key=lambda i: (i.file, i.begin)):
        is_global_scale = info.name.endswith(".weight_scale_2") and info.dtype == "F32"
        is_fp8_scale = info.name.rsplit(".", 1)[0] + ".weight" in ctx.fp8_weights and info.name.endswith(
            (".weight_scale", ".input_scale")) and info.dtype == "F32"
        is_block_scale = info.name.endswith(".weight_scale") and info.dtype == "F8_E4M3"
        is_d2t = info.name == "d2t" and info.dtype in INTEGER_DTYPES and len(info.shape) == 1
        if is_global_scale:
            out += _global_scale(info, _load(ctx, info))
        elif is_fp8_scale:
            out += _fp8_scale(info, _load(ctx, info))
        elif info.dtype in FLOAT_MATRIX_DTYPES:
            out += _float_values(info, _load(ctx, info))
        elif is_block_scale:
            out += _block_scales(info, _load(ctx, info))
        elif is_d2t:
            out += _d2t(ctx.target_vocab, _load(ctx, info))
    return out


def _load(ctx: RuleContext, info: TensorInfo):
    try:
        return ctx.ckpt.load_tensor(info.name)
    except CheckpointError:
        raise
    except Exception as error:  # safetensors / OS errors while reading tensor bytes
        raise CheckpointError(
            "DSP514", f"tensor {info.name!r} in {info.file} could not be loaded ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'}); re-download the file."
        ) from None


def _global_scale(info: TensorInfo, tensor) -> Results:
    import torch

    out, value = Results(), tensor.reshape(-1)
    if value.numel() == 0 or not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
        out.add("DSP606", f"{info.name} is {value.tolist()}; the global scale must be finite and positive.",
                "Re-quantize; an all-zero weight needs weight_scale_2 = 1 (dspark quantize handles it).")
    return out


def _fp8_scale(info: TensorInfo, tensor) -> Results:
    import torch

    out, value = Results(), tensor.reshape(-1)
    if value.numel() == 0 or not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
        out.add("DSP609", f"{info.name} is {value.tolist()}; an FP8 scale must be finite and positive (a zero scale "
                "turns the layer's output into zeros or NaN).", "Re-quantize with dspark quantize (an all-zero "
                "weight gets scale 1).")
    return out


def _block_scales(info: TensorInfo, tensor) -> Results:
    import torch

    out, bad = Results(), _count(tensor, lambda t: ~torch.isfinite(t.float()) | (t.float() < 0))
    if bad:
        out.add("DSP605", f"{info.name} has {bad} block scales that are NaN, Inf or negative.",
                "Re-quantize from the bf16 weights with dspark quantize.")
    return out


def _float_values(info: TensorInfo, tensor) -> Results:
    import torch

    out, bad = Results(), _count(tensor, lambda t: ~torch.isfinite(t))
    if bad:
        out.add("DSP601", f"{info.name} has {bad} NaN/Inf values.",
                "Re-export the tensor from a healthy training step; NaN weights poison every draft.")
    if tensor.dim() == 2 and tensor.numel() and _count(tensor, lambda t: t != 0) == 0:
        out.add("DSP602", f"{info.name} {list(info.shape)} is all zeros.",
                "Check that the trained weights were saved (an untrained or unsaved layer drafts nothing useful).")
    if tensor.dim() == 1 and info.name.endswith("norm.weight"):
        out += untrained_norm(info.name, tensor.float().tolist())
    return out


def untrained_norm(name: str, values: list[float]) -> Results:
    """DSP607: an RMSNorm weight still at its initial value (every element exactly 1) or with no spread at all (every
    element equal): a preview export of a draft whose norms were never trained, or never saved."""
    out = Results()
    if len(values) < 2 or len(set(values)) != 1:
        return out
    what = "every element is exactly 1.0, its initial value" if values[0] == 1.0 else f"every element is {values[0]}"
    out.add("DSP607", f"{name} is untrained: {what}.",
            "Export the trained weights (a draft with untrained norms drafts tokens the target rarely accepts).")
    return out


def _d2t(target_vocab: int | None, d2t) -> Results:
    import torch

    out = Results()
    targets = torch.arange(d2t.numel(), dtype=torch.long) + d2t  # [Vd] target ids
    T = target_vocab
    if T:
        outside = int(((targets < 0) | (targets >= T)).sum())
        if outside:
            out.add("DSP603", f"d2t maps {outside} draft ids outside the target vocabulary [0, {T}) "
                    "(target_id = draft_id + d2t[draft_id]).", "Rebuild d2t as offsets: target_id - draft_id.")
    duplicates = targets.numel() - int(torch.unique(targets).numel())
    if duplicates:
        out.add("DSP604", f"d2t maps {duplicates} draft ids onto target ids another draft id already has.",
                "Rebuild d2t from a one-to-one draft-to-target vocabulary map.")
    return out


def _count(tensor, predicate, chunk: int = 1 << 24) -> int:
    """Number of elements where predicate holds, in flat chunks so a large tensor needs little extra memory."""
    flat = tensor.reshape(-1)
    return sum(int(predicate(flat[i : i + chunk]).sum()) for i in range(0, flat.numel(), chunk))
