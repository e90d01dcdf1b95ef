"""NVFP4 (E2M1 elements, E4M3 block scales of 16, one fp32 global scale): the project's only NVFP4 math.

Layout (ModelOpt / vLLM checkpoint layout, docs/kernels.md):
  packed        uint8          [N, K/2]   element 2i in the low nibble of byte i, 2i+1 in the high nibble
  scale         float8_e4m3fn  [N, K/16]  linear (row-major): scale[n, j] covers W[n, 16j:16j+16]
  global_scale  float32        []         weight_scale_2 = amax(|W|) / 2688
  W[n, k] = E2M1[code[n, k]] * (float(scale[n, k // 16]) * global_scale)

`quantize_nvfp4` is a pure-torch reimplementation that is bit-identical to ModelOpt 0.47's
`NVFP4QTensor.quantize(w, 16)`; `quantize_nvfp4_modelopt` calls ModelOpt itself. Both share one
rule for an all-zero tensor (ModelOpt alone would return NaN): global scale 1.0, every block scale
1.0, every code 0, so the tensor dequantizes to exact zeros.
"""

from dataclasses import dataclass
import functools

import torch

from dspark_cli.kernels import NVFP4_GROUP_SIZE as GROUP_SIZE

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references below still work
    triton = None

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Values of codes 0..7; codes 8..15 negate them (sign bit 3). Code 8 (-0) decodes to +0.0, as in ModelOpt.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Round-to-nearest-even cut points between neighbouring magnitudes: (cut, the tie goes up).
# Ties go to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
_E2M1_CUTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_SMALLEST_BLOCK_SCALE = 2.0**-9  # ModelOpt clamps block scales to [2^-9, 448] before the fp8 cast
# Below this global scale, block scale x global scale could underflow fp32 and divide by zero.
_SMALLEST_GLOBAL_SCALE = 2.0**-117
_CHUNK_ELEMENTS = 1 << 23  # rows are (de)quantized in chunks of about this many elements (~120 MB of temporaries)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes 0..15 -> [..., K/2] uint8; element 2i goes in the low nibble of byte i."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes; inverse of `pack_nibbles`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4 matrix W [N, K] as stored in a ModelOpt W4A16_NVFP4 checkpoint."""

    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    global_scale: torch.Tensor  # float32 [] (weight_scale_2); a 1-element tensor is accepted

    def __post_init__(self):
        packed, scale, global_scale = self.packed, self.scale, self.global_scale
        if packed.dtype != torch.uint8 or packed.ndim != 2:
            raise ValueError(f"NVFP4 packed weight must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
        if scale.dtype != torch.float8_e4m3fn or scale.ndim != 2:
            raise ValueError(f"NVFP4 weight_scale must be 2-D float8_e4m3fn, got {scale.dtype} {tuple(scale.shape)}")
        if scale.shape[0] != packed.shape[0]:
            raise ValueError(f"NVFP4 weight_scale has {scale.shape[0]} rows, the packed weight {packed.shape[0]}")
        if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
            raise ValueError(
                f"NVFP4 weight_scale_2 must be one float32 value, got {global_scale.dtype} {tuple(global_scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dequantized matrix."""
        return self.packed.shape[0], 2 * self.packed.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in `dtype`; see `dequantize_nvfp4`."""
        return dequantize_nvfp4(self, dtype)

    def rows(self, index: torch.Tensor) -> "NVFP4Weight":
        """The rows `index` (int64 [M]) of this matrix, still NVFP4: [N, K] -> [M, K]."""
        scale = self.scale.view(torch.uint8)[index].view(torch.float8_e4m3fn)  # index the bytes: fp8 indexing is patchy
        return NVFP4Weight(self.packed[index], scale, self.global_scale)

    def to(self, device: torch.device | str) -> "NVFP4Weight":
        """The same weight on `device`."""
        return NVFP4Weight(self.packed.to(device), self.scale.to(device), self.global_scale.to(device))


def check_group_size(weight: NVFP4Weight) -> None:
    """Raise ValueError unless every 16 elements of a row have one scale (scale columns == K/16)."""
    n_cols = weight.shape[1]
    if n_cols % GROUP_SIZE or weight.scale.shape[1] != n_cols // GROUP_SIZE:
        raise ValueError(
            f"NVFP4 weights need a group size of 16: K={n_cols} needs {n_cols / GROUP_SIZE:g} scale columns, "
            f"got {weight.scale.shape[1]}"
        )


def _row_chunk(n_cols: int) -> int:
    return max(1, _CHUNK_ELEMENTS // n_cols)


def _checked_amax(w: torch.Tensor) -> torch.Tensor:
    """Validate a weight for quantization and return amax(|w|) as a float32 0-dim tensor."""
    if w.ndim != 2 or not w.is_floating_point() or w.numel() == 0:
        raise ValueError(f"NVFP4 quantization needs a non-empty 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    if w.shape[1] % GROUP_SIZE:
        raise ValueError(f"NVFP4 quantization needs the last dimension to be a multiple of 16, got {w.shape[1]}")
    low, high = torch.aminmax(w)  # NaN propagates; a max of absolute values is exact in any dtype
    amax = torch.maximum(low.abs(), high.abs()).float()
    if not torch.isfinite(amax):
        raise ValueError("NVFP4 quantization needs finite values, but the tensor contains NaN or Inf")
    if 0 < amax.item() / (E2M1_MAX * E4M3_MAX) < _SMALLEST_GLOBAL_SCALE:
        raise ValueError(f"NVFP4 quantization cannot represent a tensor whose largest magnitude is {amax.item():.3g}")
    return amax


def _global_scale(amax: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 = amax / 2688 in float32; 1.0 for an all-zero tensor (the zero-tensor rule)."""
    if amax.item() == 0:
        return torch.ones((), dtype=torch.float32, device=amax.device)
    # Divided on the CPU: CUDA torch divides by a Python scalar as a multiply by its rounded reciprocal.
    return (amax.cpu() / (E2M1_MAX * E4M3_MAX)).to(amax.device)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round x (already divided by its scales) to E2M1 codes: nearest, ties to even, saturating at 6.

    The sign bit is set for x < 0 only, so -0.0 gives code 0 and tiny negatives give code 8 (-0).
    """
    magnitude = scaled.abs()
    codes = (scaled < 0).to(torch.uint8) << 3
    for cut, tie_goes_up in _E2M1_CUTS:
        codes += magnitude >= cut if tie_goes_up else magnitude > cut
    return codes


def quantize_nvfp4(w: torch.Tensor) -> NVFP4Weight:
    """[N, K] float -> NVFP4Weight, bit-identical to ModelOpt 0.47 `NVFP4QTensor.quantize(w, 16)`.

    Steps, all in float32 as ModelOpt does them (a bf16/fp16 input is only upcast, which is exact):
      global_scale = amax(|w|) / 2688
      block scale  = amax(|block|) / (6 * global_scale); exact 0 -> 1.0; clamp to [2^-9, 448]; cast to e4m3 (RNE)
      code         = E2M1_RNE(x / (float(block scale) * global_scale))
    All-zero tensor: global scale 1.0, block scales 1.0, codes 0 (dequantizes to exact zeros; ModelOpt gives NaN).
    Rows are processed in chunks, so the peak memory is the output plus a few MB.

    Raises ValueError for a tensor that is not 2-D float, has K % 16 != 0, contains NaN/Inf, or whose
    largest magnitude is so small (< ~1.6e-32) that the scales would underflow.
    """
    amax = _checked_amax(w)
    global_scale = _global_scale(amax)
    block_scale_unit = E2M1_MAX * global_scale  # [] float32, rounded once as in ModelOpt
    n_rows, n_cols = w.shape
    packed = torch.empty((n_rows, n_cols // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((n_rows, n_cols // GROUP_SIZE), dtype=torch.float8_e4m3fn, device=w.device)
    step = _row_chunk(n_cols)
    for start in range(0, n_rows, step):
        blocks = w[start : start + step].reshape(-1, n_cols // GROUP_SIZE, GROUP_SIZE)  # [R, K/16, 16]
        block_scale = blocks.abs().amax(dim=-1).float() / block_scale_unit  # [R, K/16]
        block_scale.masked_fill_(block_scale == 0, 1.0)
        block_scale_fp8 = block_scale.clamp_(_SMALLEST_BLOCK_SCALE, E4M3_MAX).to(torch.float8_e4m3fn)
        divisor = block_scale_fp8.float() * global_scale  # [R, K/16]
        scaled = blocks / divisor.unsqueeze(-1)  # [R, K/16, 16], promoted to float32
        packed[start : start + step] = pack_nibbles(_e2m1_codes(scaled).reshape(-1, n_cols))
        scale[start : start + step] = block_scale_fp8
    return NVFP4Weight(packed, scale, global_scale)


def quantize_nvfp4_modelopt(w: torch.Tensor) -> NVFP4Weight:
    """[N, K] float -> NVFP4Weight computed by ModelOpt's `NVFP4QTensor.quantize(w, 16)`.

    Same input checks and the same all-zero-tensor rule as `quantize_nvfp4` (ModelOpt is given
    global scale 1.0 for an all-zero tensor), so the two engines can be compared on any input.
    Raises ImportError when nvidia-modelopt is not installed.
    """
    amax = _checked_amax(w)
    try:
        from modelopt.torch.quantization.qtensor import NVFP4QTensor
    except ImportError as exc:
        raise ImportError(
            "quantize_nvfp4_modelopt needs nvidia-modelopt (pip install nvidia-modelopt requests); "
            "quantize_nvfp4 computes the same result without it"
        ) from exc
    given_global_scale = _global_scale(amax) if amax.item() == 0 else None
    qtensor, scale, global_scale = NVFP4QTensor.quantize(w, GROUP_SIZE, weights_scaling_factor_2=given_global_scale)
    return NVFP4Weight(qtensor._quantized_data, scale, global_scale.float().reshape(()))


def dequantize_nvfp4(weight: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4Weight -> [N, K] in `dtype`: E2M1[code] * (float(scale) * global_scale), in float32, then cast.

    The product order matches ModelOpt's `dequantize`, so the float32 result is bit-identical to it.
    """
    check_group_size(weight)
    n_rows, n_cols = weight.shape
    byte_values = _byte_values(weight.packed.device)
    global_scale = weight.global_scale.reshape(())
    out = torch.empty((n_rows, n_cols), dtype=dtype, device=weight.packed.device)
    step = _row_chunk(n_cols)
    for start in range(0, n_rows, step):
        chunk = weight.packed[start : start + step]  # [R, K/2]
        values = byte_values.index_select(0, chunk.reshape(-1).int()).view(*chunk.shape, 2)  # [R, K/2, 2] float32
        block_scale = weight.scale[start : start + step].float() * global_scale  # [R, K/16]
        blocks = values.view(-1, n_cols // GROUP_SIZE, GROUP_SIZE) * block_scale.unsqueeze(-1)  # [R, K/16, 16]
        out[start : start + step] = blocks.view(-1, n_cols)
    return out


def dequantize_rows_nvfp4(weight: NVFP4Weight, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: rows `rows` (int64 [M]) of the dequantized matrix, [M, K] in `dtype`."""
    return dequantize_nvfp4(weight.rows(rows), dtype)


@functools.cache
def _byte_values(device: torch.device) -> torch.Tensor:
    """Packed byte -> its (even, odd) element values: float32 [256, 2], from `E2M1_VALUES`."""
    return E2M1_VALUES[unpack_nibbles(torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None]).long()].to(device)


@functools.cache
def lookup_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode tables the kernels gather from: E2M1 code -> float32 [16], e4m3 byte -> float32 [256].

    The e4m3 table is torch's own fp8 -> fp32 conversion, so kernels decode scales exactly as torch does.
    """
    e4m3_values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return E2M1_VALUES.to(device), e4m3_values.to(device)


if triton is not None:

    @triton.jit
    def decode_nvfp4(packed, scale_bytes, global_scale, e2m1_ptr, e4m3_ptr):
        """uint8 packed bytes and the uint8 e4m3 scale of each byte -> (even, odd) float32 elements."""
        block_scale = tl.load(e4m3_ptr + scale_bytes.to(tl.int32)) * global_scale
        even = tl.load(e2m1_ptr + (packed & 0x0F).to(tl.int32)) * block_scale
        odd = tl.load(e2m1_ptr + (packed >> 4).to(tl.int32)) * block_scale
        return even, odd

    @triton.jit
    def _dequantize_rows_kernel(
        packed_ptr, stride_packed_n, stride_packed_h, scale_ptr, stride_scale_n, stride_scale_c,
        global_scale_ptr, e2m1_ptr, e4m3_ptr, rows_ptr, out_ptr, stride_out_m,
        n_out_rows, half_k,
        BLOCK_M: tl.constexpr, HALF_K_BLOCK: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # output rows
        offs_h = tl.arange(0, HALF_K_BLOCK)  # byte columns; byte h holds elements 2h and 2h+1
        m_mask = offs_m < n_out_rows
        mask = m_mask[:, None] & (offs_h < half_k)[None, :]
        rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0)
        packed = tl.load(
            packed_ptr + rows[:, None] * stride_packed_n + offs_h[None, :] * stride_packed_h, mask=mask, other=0
        )
        scale_bytes = tl.load(
            scale_ptr + rows[:, None] * stride_scale_n + (offs_h[None, :] // 8) * stride_scale_c, mask=mask, other=0
        )
        even, odd = decode_nvfp4(packed, scale_bytes, tl.load(global_scale_ptr), e2m1_ptr, e4m3_ptr)
        out_row = out_ptr + offs_m[:, None] * stride_out_m + 2 * offs_h[None, :]
        tl.store(out_row, even.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + 1, odd.to(out_ptr.dtype.element_ty), mask=mask)


def nvfp4_kernel_args(weight: NVFP4Weight) -> tuple:
    """The arguments every NVFP4 kernel takes for one weight, in order: packed pointer and its two
    strides, scale bytes and their two strides, the global-scale pointer, the E2M1 and e4m3 tables."""
    scale_bytes = weight.scale.view(torch.uint8)
    e2m1, e4m3 = lookup_tables(weight.packed.device)
    return (
        weight.packed, weight.packed.stride(0), weight.packed.stride(1),
        scale_bytes, scale_bytes.stride(0), scale_bytes.stride(1),
        weight.global_scale, e2m1, e4m3,
    )


def dequantize_rows_triton(weight: NVFP4Weight, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton twin of `dequantize_rows_nvfp4`: rows (int64 [M]) -> [M, K] in `dtype`, same values."""
    check_group_size(weight)
    n_cols = weight.shape[1]
    rows = rows.contiguous()
    out = torch.empty((rows.numel(), n_cols), dtype=dtype, device=weight.packed.device)
    block_m = 16
    _dequantize_rows_kernel[(triton.cdiv(rows.numel(), block_m),)](
        *nvfp4_kernel_args(weight), rows, out, out.stride(0), rows.numel(), n_cols // 2,
        BLOCK_M=block_m, HALF_K_BLOCK=triton.next_power_of_2(n_cols // 2),
    )
    return out
