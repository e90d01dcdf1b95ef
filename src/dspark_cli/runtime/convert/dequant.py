"""A draft's ModelOpt-quantized Linear layers (`dspark quantize --scope draft`) read back as float32 for the GGUF,
torch-free (numpy), to the bit the value dspark's runtime and vLLM's kernels multiply with:

- NVFP4 W4A16: `X.weight` uint8 [N, K/2] (two E2M1 codes a byte, element 2i in the low nibble), `X.weight_scale`
  F8_E4M3 [N, K/16], `X.weight_scale_2` F32 []. W[n, k] = E2M1[code] * (float(scale[n, k // 16]) * scale_2), the
  block scale rounded to float32 before the product: kernels/nvfp4.py `dequantize_nvfp4`'s order, ModelOpt's.
- FP8 (W8A8, static): `X.weight` F8_E4M3 [N, K], `X.weight_scale` F32 [], `X.input_scale` F32 []. W = float(code) *
  weight_scale (kernels/fp8.py `dequantize_fp8`). input_scale is the static activation scale vLLM's FP8 GEMM
  quantizes each input with; a GGUF has no such tensor (llama.cpp quantizes activations its own way per matmul), so
  it is dropped, and the converted draft runs with unquantized activations.

E4M3 here is float8_e4m3fn (bias 7, no infinities, 0x7F / 0xFF NaN), decoded by table; the tests compare the table
and both dequantizations with torch's and dspark's own on the quantized demo draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2, canonical_name
from dspark_cli.runtime.checkpoint.read import Checkpoint, TensorInfo

GROUP = 16  # NVFP4 elements per block scale
# E2M1 code -> value; code 8 (negative zero) reads +0.0, as kernels/nvfp4.py E2M1_VALUES has it
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NVFP4_SCALES = ("weight_scale", "weight_scale_2")
FP8_SCALES = ("weight_scale", "input_scale")


@dataclass(frozen=True)
class QuantizedLinear:
    """One quantized Linear weight: its on-disk weight name, format, and the scale tensors read with it (never
    written to the GGUF)."""

    weight: str
    format: str  # "nvfp4" or "fp8"
    scales: tuple[str, ...]

    @property
    def dropped(self) -> tuple[str, ...]:
        """Scales with no GGUF counterpart whose effect is lost, not folded into the weight: FP8's input_scale."""
        return tuple(name for name in self.scales if name.endswith(".input_scale"))


def quantized_linears(ckpt: Checkpoint) -> dict[str, QuantizedLinear]:
    """On-disk weight name -> its quantization, for every Linear weight stored as ModelOpt NVFP4 (uint8 beside an
    F8_E4M3 weight_scale) or FP8 (F8_E4M3 beside a weight_scale); markov_w2 aside (convert refuses a quantized
    Markov head before this)."""
    found = {}
    for name, info in ckpt.tensors.items():
        if not name.endswith(".weight") or canonical_name(name) == MARKOV_W2:
            continue
        module = name.removesuffix(".weight")
        scale = ckpt.tensors.get(f"{module}.weight_scale")
        if info.dtype == "U8" and scale is not None and scale.dtype == "F8_E4M3":
            found[name] = QuantizedLinear(name, "nvfp4", _present(ckpt, module, NVFP4_SCALES))
        elif info.dtype == "F8_E4M3" and scale is not None:
            found[name] = QuantizedLinear(name, "fp8", _present(ckpt, module, FP8_SCALES))
    return found


def _present(ckpt: Checkpoint, module: str, scales: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"{module}.{scale}" for scale in scales if f"{module}.{scale}" in ckpt.tensors)


def dequantize(ckpt: Checkpoint, linear: QuantizedLinear):
    """The layer's weight as float32 numpy [N, K]; DsparkError, in one sentence, for a layout it cannot read."""
    if linear.format == "nvfp4":
        return _nvfp4(ckpt, linear)
    return _fp8(ckpt, linear)


def _nvfp4(ckpt: Checkpoint, linear: QuantizedLinear):
    import numpy as np

    module = linear.weight.removesuffix(".weight")
    packed = _raw(ckpt, ckpt.tensors[linear.weight])
    rows, half = packed.shape if packed.ndim == 2 else (0, 0)
    cols = 2 * half
    scale = _raw(ckpt, _tensor(ckpt, f"{module}.weight_scale", linear))
    global_scale = _scalar(ckpt, f"{module}.weight_scale_2", linear)
    if packed.ndim != 2 or cols % GROUP or scale.shape != (rows, cols // GROUP):
        raise DsparkError(f"{ckpt.source}: {linear.weight} {list(packed.shape)} with weight_scale "
                          f"{list(scale.shape)} is not an NVFP4 layout (uint8 [N, K/2] with F8_E4M3 [N, K/16]); "
                          "dspark validate names the problem.")
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F  # element 2i in the low nibble
    codes[:, 1::2] = packed >> 4
    block_scale = e4m3_table()[scale] * global_scale  # [N, K/16] float32, rounded once like the runtime's
    values = np.asarray(E2M1, dtype=np.float32)[codes].reshape(rows, cols // GROUP, GROUP)
    return (values * block_scale[:, :, None]).reshape(rows, cols)


def _fp8(ckpt: Checkpoint, linear: QuantizedLinear):
    codes = _raw(ckpt, ckpt.tensors[linear.weight])
    if codes.ndim != 2:
        raise DsparkError(f"{ckpt.source}: {linear.weight} is {list(codes.shape)}; an FP8 weight is [N, K].")
    scale = _scalar(ckpt, f"{linear.weight.removesuffix('.weight')}.weight_scale", linear)
    return e4m3_table()[codes] * scale


def _tensor(ckpt: Checkpoint, name: str, linear: QuantizedLinear) -> TensorInfo:
    if name not in ckpt.tensors:
        raise DsparkError(f"{ckpt.source}: {linear.weight} is {linear.format.upper()} but {name} is missing; "
                          "dspark validate names the problem.")
    return ckpt.tensors[name]


def _scalar(ckpt: Checkpoint, name: str, linear: QuantizedLinear):
    """A per-tensor F32 scale ([] or [1]) as a numpy float32 scalar."""
    import numpy as np

    info = _tensor(ckpt, name, linear)
    if info.dtype != "F32" or info.numel != 1:
        raise DsparkError(f"{ckpt.source}: {name} is {info.dtype} {list(info.shape)}; a per-tensor scale is one "
                          "float32 value.")
    return np.float32(_raw(ckpt, info).reshape(-1)[0].view(np.float32))


def _raw(ckpt: Checkpoint, info: TensorInfo):
    """The tensor's bytes as stored: uint8 for U8 and F8_E4M3 (one byte a value), the bits of an F32 as uint32."""
    import numpy as np

    dtypes = {"U8": np.uint8, "F8_E4M3": np.uint8, "F32": np.uint32}
    if info.dtype not in dtypes:
        raise DsparkError(f"{ckpt.source}: {info.name} is stored as {info.dtype}, which is no part of a ModelOpt "
                          "NVFP4 or FP8 layer.")
    data = np.fromfile(ckpt.file_path(info.file), dtype=dtypes[info.dtype], count=info.numel, offset=info.begin)
    return data.reshape(info.shape)


@cache
def e4m3_table():
    """float8_e4m3fn byte -> float32 [256]: sign, 4 exponent bits (bias 7), 3 mantissa bits; subnormals at exponent
    0; 0x7F and 0xFF are NaN (no infinities)."""
    import numpy as np

    byte = np.arange(256)
    sign = np.where(byte >> 7, -1.0, 1.0)
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = sign * magnitude
    values[(exponent == 0xF) & (mantissa == 0x7)] = np.nan
    return values.astype(np.float32)  # every value is exact in float32
