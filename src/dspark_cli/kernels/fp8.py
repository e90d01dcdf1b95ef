"""ModelOpt's per-tensor FP8 (E4M3), the format of `quant_algo: "FP8"`: one float32 scale per weight and one static
float32 scale per activation, both amax / 448 (448 = the largest float8_e4m3fn magnitude).

    weight  = float8_e4m3fn(W / weight_scale)            W: [N, K] -> [N, K]
    W ≈ float(weight) * weight_scale
    x ≈ float(float8_e4m3fn(clamp(x / input_scale, ±448))) * input_scale   (what vLLM's static activation quant does)

ModelOpt computes the same (`FP8QTensor.quantize`: scales = amax / 448, then a round-to-nearest-even cast); an
all-zero tensor, which would give a zero scale and NaN codes, gets scale 1.0 here (its codes are all zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class FP8Weight:
    data: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [] (weight_scale)


def fp8_scale(amax: float) -> float:
    """amax / 448 in float32, 1.0 for an all-zero tensor."""
    return float(torch.tensor(amax, dtype=torch.float32) / FP8_MAX) if amax > 0 else 1.0


def quantize_fp8(weight: torch.Tensor, scale: float | None = None) -> FP8Weight:
    """Per-tensor FP8 of `weight` [N, K] with `scale` (default: its own amax / 448)."""
    weight, scale_t = _float_and_scale(weight, scale)
    data = (weight / scale_t).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [N, K]
    return FP8Weight(data, scale_t)


def _float_and_scale(weight: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight in float32, its scale as a float32 [] tensor); ValueError for NaN / Inf."""
    weight = weight.float()
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("the weight holds NaN or Inf values")
    if scale is None:
        scale = fp8_scale(float(weight.abs().max()) if weight.numel() else 0.0)
    return weight, torch.tensor(scale, dtype=torch.float32)


def dequantize_fp8(weight: FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float(data) * scale: [N, K] in `dtype` (exact in float32)."""
    return (weight.data.float() * weight.scale.float()).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] through static per-tensor FP8 and back, in x's dtype: the activation vLLM's FP8 GEMM multiplies."""
    scaled = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX)
    return (scaled.to(torch.float8_e4m3fn).float() * input_scale).to(x.dtype)


def quantize_fp8_modelopt(weight: torch.Tensor, scale: float | None = None) -> FP8Weight:
    """The same through ModelOpt's FP8QTensor (needs nvidia-modelopt): bit-identical to `quantize_fp8`."""
    import warnings

    with warnings.catch_warnings():  # ModelOpt warns on import about untested transformers versions
        warnings.filterwarnings("ignore", category=UserWarning, module=r"modelopt(\.|$)")
        from modelopt.torch.quantization.qtensor.fp8_tensor import FP8QTensor

    weight, scale_t = _float_and_scale(weight, scale)
    quantized, _ = FP8QTensor.quantize(weight, scales=scale_t)
    return FP8Weight(quantized._quantized_data, scale_t)
