"""Q4_K blocks (and Q5_0, the type llama.cpp falls back to for a row that is not whole Q4_K super-blocks), written
from ggml's block formats and its reference quantizer's rules (ggml-common.h block_q4_K / block_q5_0;
ggml/src/ggml-quants.c at b11434: the search for a sub-block's scale and offset, the 6-bit packing), in float32
numpy so that the bytes are llama-quantize's (tests/convert/test_gguf_quant.py); torch-free.

A Q4_K super-block holds 256 values of a row as 8 sub-blocks of 32: an F16 scale `d` and offset scale `dmin`, the
sub-blocks' 6-bit scales and offsets packed in 12 bytes, then 128 bytes of 4-bit values; value = d·sc·q − dmin·m.
"""

from __future__ import annotations

QK_K = 256  # values per super-block
SUB = 32  # values per sub-block
STEPS = 20  # the reference's scale search: nstep 20, from rmin -1 by rdelta 0.1 around nmax 15


def _nearest(values):
    """ggml's nearest_int: round half to even (float32 addition of 1.5 x 2^23)."""
    import numpy as np

    return np.rint(values).astype(np.int32)


def _sub_block_scales(x, weights):
    """The reference's weighted least-squares search over 32-value sub-blocks x [S, 32] (float32): per sub-block the
    scale, the (positive) offset and the 4-bit values [S, 32] it found."""
    import numpy as np

    f32 = np.float32
    lowest = np.minimum(x.min(axis=1), f32(0))  # [S]
    highest = x.max(axis=1)
    flat = highest == lowest
    span = np.where(flat, f32(1), highest - lowest)
    sum_w, sum_x = weights[:, 0].copy(), weights[:, 0] * x[:, 0]
    for i in range(1, SUB):  # sequential sums, as the reference adds them
        sum_w = sum_w + weights[:, i]
        sum_x = sum_x + weights[:, i] * x[:, i]
    iscale = f32(15) / span
    scale = f32(1) / iscale
    levels = np.clip(_nearest(iscale[:, None] * (x - lowest[:, None])), 0, 15)
    best = _weighted_error(scale, levels, lowest, x, weights)
    offset = lowest.copy()
    for step in range(STEPS + 1):  # the reference moves its offset as it finds better ones: `offset`, not `lowest`
        iscale = (f32(-1) + f32(0.1) * f32(step) + f32(15)) / np.where(flat, f32(1), highest - offset)
        trial = np.clip(_nearest(iscale[:, None] * (x - offset[:, None])), 0, 15)
        sum_l = sum_l2 = sum_xl = np.zeros_like(sum_w)
        for i in range(SUB):
            wl = weights[:, i] * trial[:, i].astype(f32)
            sum_l = sum_l + wl
            sum_l2 = sum_l2 + wl * trial[:, i].astype(f32)
            sum_xl = sum_xl + wl * x[:, i]
        det = sum_w * sum_l2 - sum_l * sum_l
        valid = det > 0
        safe = np.where(valid, det, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 != 0, sum_l2, f32(1)), this_scale)
        this_min = np.where(positive, f32(0), this_min)
        error = _weighted_error(this_scale, trial, this_min, x, weights)
        better = valid & (error < best)
        levels = np.where(better[:, None], trial, levels)
        best = np.where(better, error, best)
        scale = np.where(better, this_scale, scale)
        offset = np.where(better, this_min, offset)
    scale = np.where(flat, f32(0), scale)
    offset = np.where(flat, lowest, offset)
    levels = np.where(flat[:, None], 0, levels)
    return scale, -offset, levels  # [S], [S], [S, 32]


def _weighted_error(scale, levels, offset, x, weights):
    import numpy as np

    total = np.zeros(len(x), dtype=np.float32)
    for i in range(SUB):
        diff = scale * levels[:, i].astype(np.float32) + offset - x[:, i]
        total = total + weights[:, i] * (diff * diff)
    return total


def quantize_q4_k(rows):
    """Q4_K super-blocks of float32 rows [R, C] (C a multiple of 256) -> uint8 [R, C / 256 * 144]."""
    import numpy as np

    f32 = np.float32
    x = rows.astype(f32).reshape(-1, SUB)  # [S, 32], 8 sub-blocks per super-block
    average = _root_mean_square(x)  # [S]
    scales, mins, levels = _sub_block_scales(x, average[:, None] + np.abs(x))
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)  # [B, 8]
    max_scale = np.maximum(scales.max(axis=1), f32(0))  # [B]
    max_min = np.maximum(mins.max(axis=1), f32(0))
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, f32(1)), f32(0))
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, f32(1)), f32(0))
    ls = np.minimum(63, _nearest(inv_scale[:, None] * scales) & 0xFF).astype(np.uint8)  # [B, 8] 6-bit scales
    lm = np.minimum(63, _nearest(inv_min[:, None] * mins) & 0xFF).astype(np.uint8)
    d = (max_scale / f32(63)).astype(np.float16)  # the super-block scales
    dmin = (max_min / f32(63)).astype(np.float16)
    sub_d = d.astype(f32)[:, None] * ls.astype(f32)  # [B, 8]: what a reader multiplies by
    sub_m = dmin.astype(f32)[:, None] * lm.astype(f32)
    xb = x.reshape(-1, 8, SUB)
    safe = np.where(sub_d != 0, sub_d, f32(1))[:, :, None]
    requantized = np.clip(_nearest((xb + sub_m[:, :, None]) / safe), 0, 15)
    levels = np.where((sub_d != 0)[:, :, None], requantized, levels.reshape(-1, 8, SUB)).astype(np.uint8)
    flat = levels.reshape(-1, 4, 2, SUB)  # 64-value chunks: the first 32 in the low nibbles, the next in the high
    qs = (flat[:, :, 0] | (flat[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), pack_scales(ls, lm), qs],
                            axis=1)
    return packed.reshape(rows.shape[0], -1)  # [R, C / 256 * 144]


def _root_mean_square(x):
    import numpy as np

    total = np.zeros(len(x), dtype=np.float32)
    for i in range(SUB):
        total = total + x[:, i] * x[:, i]
    return np.sqrt(total / np.float32(SUB))


def pack_scales(ls, lm):
    """Eight 6-bit scales and offsets [B, 8] in 12 bytes (ggml's get_scale_min_k4 reads them back): bytes 0-3 and
    4-7 hold the first four scales and offsets with the high two bits of the last four on top; bytes 8-11 the low
    four bits of the last four scales (low nibble) and offsets (high nibble)."""
    import numpy as np

    out = np.zeros((len(ls), 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def quantize_q5_0(rows):
    """Q5_0 blocks (block_q5_0: an F16 scale d = m / -16 with m the value of largest magnitude, 32 bits of fifth
    bits, 16 bytes of low nibbles, values min(31, trunc(x / d + 16.5))) of float32 rows [R, C] -> [R, C / 32 * 22]."""
    import numpy as np

    blocks = rows.astype(np.float32).reshape(-1, SUB)  # [B, 32]
    first_largest = np.abs(blocks).argmax(axis=1)
    d = blocks[np.arange(len(blocks)), first_largest] / np.float32(-16)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    values = np.minimum(31, (blocks * inverse[:, None] + np.float32(16.5)).astype(np.int8)).astype(np.uint32)
    fifth = ((values >> 4) & 1) << np.arange(SUB, dtype=np.uint32)  # bit j of qh: value j's fifth bit
    qh = np.bitwise_or.reduce(fifth, axis=1).astype("<u4")
    low = (values & 0xF).astype(np.uint8)
    packed = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), qh[:, None].view(np.uint8),
                             low[:, :SUB // 2] | (low[:, SUB // 2:] << 4)], axis=1)
    return packed.reshape(rows.shape[0], -1)
