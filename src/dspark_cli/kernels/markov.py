"""Markov-head kernels: the gathered (top-k) Markov bias and the fused Markov walk.

Each Triton kernel has a pure-torch twin with the same semantics (docs/kernels.md):
  nvfp4_gathered_bias      <-> nvfp4_gathered_bias_reference  (bf16 twin: gathered_bias_reference)
  markov_walk_triton       <-> markov_walk_reference          (markov_walk picks one by device)
All dot products accumulate in float32.
"""

import torch

from . import triton_available
from .nvfp4 import NVFP4Weight, check_group_size, dequantize_rows_nvfp4, nvfp4_kernel_args

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch references below still work
    triton = None
else:
    from .nvfp4 import decode_nvfp4

_GATHER_BLOCK = 32  # candidates per program in nvfp4_gathered_bias


def _check_gathered_args(markov_embed, n_cols, values, index, logits):
    batch = markov_embed.shape[0]
    if markov_embed.shape != (batch, n_cols):
        raise ValueError(f"markov_embed must be [B, {n_cols}], got {tuple(markov_embed.shape)}")
    if values.shape != index.shape or values.ndim != 2 or values.shape[0] != batch:
        raise ValueError(
            f"values and index must both be [{batch}, TOPK], got {tuple(values.shape)} and {tuple(index.shape)}"
        )
    if logits.ndim != 2 or logits.shape[0] != batch:
        raise ValueError(f"logits must be [{batch}, V], got {tuple(logits.shape)}")


def _scatter_corrected(markov_embed, rows, values, index, logits, alpha):
    """logits[b, index[b, j]] = values[b, j] + alpha * <rows[b, j], markov_embed[b]>, in float32."""
    dots = torch.bmm(rows, markov_embed.float().unsqueeze(-1)).squeeze(-1)  # [B, TOPK, K] x [B, K, 1] -> [B, TOPK]
    logits.scatter_(1, index, (values.float() + alpha * dots).to(logits.dtype))


def gathered_bias_reference(markov_embed, w2, values, index, logits, alpha: float) -> None:
    """Unquantized twin: W2 is a dense [Vd, K] tensor. Writes logits in place, as `nvfp4_gathered_bias`."""
    _check_gathered_args(markov_embed, w2.shape[1], values, index, logits)
    _scatter_corrected(markov_embed, w2[index].float(), values, index, logits, alpha)  # rows [B, TOPK, K]


def nvfp4_gathered_bias_reference(markov_embed, weight: NVFP4Weight, values, index, logits, alpha: float) -> None:
    """Torch twin of `nvfp4_gathered_bias`: dequantizes only the gathered rows, in float32."""
    check_group_size(weight)
    _check_gathered_args(markov_embed, weight.shape[1], values, index, logits)
    batch, topk = index.shape
    rows = dequantize_rows_nvfp4(weight, index.reshape(-1)).view(batch, topk, -1)  # [B*TOPK, K] -> [B, TOPK, K]
    _scatter_corrected(markov_embed, rows, values, index, logits, alpha)


def nvfp4_gathered_bias(markov_embed, weight: NVFP4Weight, values, index, logits, alpha: float) -> None:
    """Triton kernel with vLLM's `nvfp4_gathered_bias` semantics, writing `logits` in place.

    markov_embed [B, K] (any float dtype and strides), weight NVFP4 [Vd, K], values [B, TOPK] (any float
    dtype), index int64 [B, TOPK] draft-vocab ids, logits [B, V] (usually a -inf row, may be a strided
    view). For every b, j: logits[b, index[b, j]] = values[b, j] + alpha * <dequant(W[index[b, j]]), e[b]>,
    accumulated in float32 and stored in logits' dtype. No other entry changes; `values` is not modified.
    Raises ValueError (mentioning "group size of 16") when the scale has other than K/16 columns.
    Duplicate ids within a row write the same place in an unspecified order.
    """
    check_group_size(weight)
    n_cols = weight.shape[1]
    _check_gathered_args(markov_embed, n_cols, values, index, logits)
    batch, topk = index.shape
    grid = (batch, triton.cdiv(topk, _GATHER_BLOCK))
    _nvfp4_gathered_bias_kernel[grid](
        markov_embed, markov_embed.stride(0), markov_embed.stride(1),
        *nvfp4_kernel_args(weight),
        values, values.stride(0), values.stride(1),
        index, index.stride(0), index.stride(1),
        logits, logits.stride(0), logits.stride(1),
        topk, n_cols // 2, float(alpha),
        BLOCK_T=_GATHER_BLOCK, HALF_K_BLOCK=triton.next_power_of_2(n_cols // 2),
    )


def _check_walk_args(base_values, cand_ids, first_prev, w1, w2, d2t, gumbel):
    batch, _, _ = base_values.shape
    if cand_ids.shape != base_values.shape:
        raise ValueError(f"cand_ids must match base_values {tuple(base_values.shape)}, got {tuple(cand_ids.shape)}")
    if first_prev.shape != (batch,):
        raise ValueError(f"first_prev must be [{batch}], got {tuple(first_prev.shape)}")
    if gumbel is not None and gumbel.shape != base_values.shape:
        raise ValueError(f"gumbel must match base_values {tuple(base_values.shape)}, got {tuple(gumbel.shape)}")
    if isinstance(w2, NVFP4Weight):
        check_group_size(w2)
    if w2.shape[1] != w1.shape[1]:
        raise ValueError(f"markov_w1 [V, r] and markov_w2 [Vd, r] disagree on r: {w1.shape[1]} vs {w2.shape[1]}")
    if d2t is not None and d2t.shape != (w2.shape[0],):
        raise ValueError(f"d2t must be [{w2.shape[0]}] (one offset per draft id), got {tuple(d2t.shape)}")


def _w2_rows(w2, ids: torch.Tensor) -> torch.Tensor:
    """Rows of W2 for draft ids [B, k] -> [B, k, r] float32, dense or NVFP4."""
    if isinstance(w2, NVFP4Weight):
        return dequantize_rows_nvfp4(w2, ids.reshape(-1)).view(*ids.shape, -1)
    return w2[ids].float()


def markov_walk_reference(
    base_values, cand_ids, first_prev, w1, w2, alpha: float, d2t=None, gumbel=None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of the fused Markov walk over one draft block of N positions.

    base_values [B, N, k] candidate base logits (any float dtype), cand_ids int64 [B, N, k] their
    draft-vocab ids, first_prev int64 [B] the anchor's target id, w1 [V, r], w2 dense [Vd, r] or
    NVFP4Weight, alpha the logit scale, d2t int64 [Vd] offsets or None, gumbel float32 [B, N, k] or None.
    For i = 0..N-1: e = w1[prev]; corrected[:, i, j] = base + alpha * <w2[cand_ids[:, i, j]], e>;
    j* = argmax_j corrected (greedy: gumbel None or temperature 0) or argmax_j corrected / T + gumbel;
    token = cand_ids[j*] (+ d2t[that id]); prev = token. Ties go to the lowest j.
    Returns tokens int64 [B, N] (target ids) and corrected float32 [B, N, k].
    """
    _check_walk_args(base_values, cand_ids, first_prev, w1, w2, d2t, gumbel)
    batch, n_steps, topk = base_values.shape
    use_gumbel = gumbel is not None and temperature != 0
    tokens = torch.empty((batch, n_steps), dtype=torch.int64, device=base_values.device)
    corrected = torch.empty((batch, n_steps, topk), dtype=torch.float32, device=base_values.device)
    prev = first_prev
    for i in range(n_steps):
        embed = w1[prev].float()  # [B] -> [B, r]
        rows = _w2_rows(w2, cand_ids[:, i])  # [B, k] -> [B, k, r]
        dots = torch.bmm(rows, embed.unsqueeze(-1)).squeeze(-1)  # [B, k]
        corrected[:, i] = base_values[:, i].float() + alpha * dots
        score = corrected[:, i] / temperature + gumbel[:, i] if use_gumbel else corrected[:, i]
        draft = cand_ids[:, i].gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)  # [B]
        tokens[:, i] = draft + d2t[draft] if d2t is not None else draft
        prev = tokens[:, i]
    return tokens, corrected


def markov_walk_triton(
    base_values, cand_ids, first_prev, w1, w2, alpha: float, d2t=None, gumbel=None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused Markov walk as one Triton kernel: one program per request walks all N positions.

    Same arguments, results and tie-break as `markov_walk_reference`. An NVFP4 W2 is dequantized in
    registers; the candidates' W2 rows are the only part of W2 that is read.
    """
    _check_walk_args(base_values, cand_ids, first_prev, w1, w2, d2t, gumbel)
    batch, n_steps, topk = base_values.shape
    rank = w1.shape[1]
    device = base_values.device
    tokens = torch.empty((batch, n_steps), dtype=torch.int64, device=device)
    corrected = torch.empty((batch, n_steps, topk), dtype=torch.float32, device=device)
    is_nvfp4 = isinstance(w2, NVFP4Weight)
    if is_nvfp4:
        w2_args = nvfp4_kernel_args(w2)
        w2_cols = rank // 2  # packed bytes per row
    else:
        # the NVFP4-only arguments are unused; w2 stands in for their pointers
        w2_args = (w2, w2.stride(0), w2.stride(1), w2, 0, 0, w2, w2, w2)
        w2_cols = rank
    use_gumbel = gumbel is not None and temperature != 0
    _markov_walk_kernel[(batch,)](
        base_values, *base_values.stride(),
        cand_ids, *cand_ids.stride(),
        first_prev, first_prev.stride(0),
        w1, w1.stride(0), w1.stride(1),
        *w2_args,
        d2t if d2t is not None else cand_ids,
        gumbel if use_gumbel else base_values, *(gumbel.stride() if use_gumbel else (0, 0, 0)),
        tokens, corrected,
        n_steps, topk, w2_cols, float(alpha), float(temperature),
        TOPK_BLOCK=triton.next_power_of_2(topk), COL_BLOCK=triton.next_power_of_2(w2_cols),
        IS_NVFP4=is_nvfp4, HAS_D2T=d2t is not None, USE_GUMBEL=use_gumbel,
    )
    return tokens, corrected


def markov_walk(
    base_values, cand_ids, first_prev, w1, w2, alpha: float, d2t=None, gumbel=None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused Markov walk: the Triton kernel on CUDA, the torch reference elsewhere (same results)."""
    walk = markov_walk_triton if triton_available(base_values) else markov_walk_reference
    return walk(base_values, cand_ids, first_prev, w1, w2, alpha, d2t, gumbel, temperature)


if triton is not None:

    @triton.jit
    def _nvfp4_gathered_bias_kernel(
        embed_ptr, stride_embed_b, stride_embed_k,
        packed_ptr, stride_packed_v, stride_packed_h, scale_ptr, stride_scale_v, stride_scale_c,
        global_scale_ptr, e2m1_ptr, e4m3_ptr,
        values_ptr, stride_values_b, stride_values_t,
        index_ptr, stride_index_b, stride_index_t,
        logits_ptr, stride_logits_b, stride_logits_v,
        topk, half_k, alpha,
        BLOCK_T: tl.constexpr, HALF_K_BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # candidates
        offs_h = tl.arange(0, HALF_K_BLOCK)  # packed bytes; byte h holds elements 2h and 2h+1
        t_mask = offs_t < topk
        h_mask = offs_h < half_k
        mask = t_mask[:, None] & h_mask[None, :]
        vocab_ids = tl.load(index_ptr + b * stride_index_b + offs_t * stride_index_t, mask=t_mask, other=0)
        packed = tl.load(
            packed_ptr + vocab_ids[:, None] * stride_packed_v + offs_h[None, :] * stride_packed_h, mask=mask, other=0
        )
        scale_cols = (offs_h // 8) * stride_scale_c  # 8 bytes (16 elements) share one scale
        scale_bytes = tl.load(scale_ptr + vocab_ids[:, None] * stride_scale_v + scale_cols[None, :], mask=mask, other=0)
        w_even, w_odd = decode_nvfp4(packed, scale_bytes, tl.load(global_scale_ptr), e2m1_ptr, e4m3_ptr)
        embed_row = embed_ptr + b * stride_embed_b
        e_even = tl.load(embed_row + 2 * offs_h * stride_embed_k, mask=h_mask, other=0.0).to(tl.float32)
        e_odd = tl.load(embed_row + (2 * offs_h + 1) * stride_embed_k, mask=h_mask, other=0.0).to(tl.float32)
        dots = tl.sum(w_even * e_even[None, :] + w_odd * e_odd[None, :], axis=1)  # [BLOCK_T]
        base = tl.load(values_ptr + b * stride_values_b + offs_t * stride_values_t, mask=t_mask, other=0.0)
        corrected = base.to(tl.float32) + alpha * dots
        out = logits_ptr + b * stride_logits_b + vocab_ids * stride_logits_v
        tl.store(out, corrected.to(logits_ptr.dtype.element_ty), mask=t_mask)

    @triton.jit
    def _markov_walk_kernel(
        base_ptr, stride_base_b, stride_base_n, stride_base_k,
        cand_ptr, stride_cand_b, stride_cand_n, stride_cand_k,
        first_prev_ptr, stride_first_prev,
        w1_ptr, stride_w1_v, stride_w1_r,
        w2_ptr, stride_w2_v, stride_w2_c, scale_ptr, stride_scale_v, stride_scale_c,
        global_scale_ptr, e2m1_ptr, e4m3_ptr,
        d2t_ptr,
        gumbel_ptr, stride_gumbel_b, stride_gumbel_n, stride_gumbel_k,
        tokens_ptr, corrected_ptr,
        n_steps, topk, w2_cols, alpha, temperature,
        TOPK_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr,
        IS_NVFP4: tl.constexpr, HAS_D2T: tl.constexpr, USE_GUMBEL: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs_j = tl.arange(0, TOPK_BLOCK)  # candidates
        offs_c = tl.arange(0, COL_BLOCK)  # W2 columns (packed bytes when IS_NVFP4)
        j_mask = offs_j < topk
        c_mask = offs_c < w2_cols
        mask = j_mask[:, None] & c_mask[None, :]
        prev = tl.load(first_prev_ptr + b * stride_first_prev)
        for i in range(n_steps):
            cand_row = cand_ptr + b * stride_cand_b + i * stride_cand_n
            cand = tl.load(cand_row + offs_j * stride_cand_k, mask=j_mask, other=0)  # draft ids [TOPK_BLOCK]
            w1_row = w1_ptr + prev * stride_w1_v
            w2_tile = w2_ptr + cand[:, None] * stride_w2_v + offs_c[None, :] * stride_w2_c
            if IS_NVFP4:
                packed = tl.load(w2_tile, mask=mask, other=0)
                scale_bytes = tl.load(
                    scale_ptr + cand[:, None] * stride_scale_v + (offs_c[None, :] // 8) * stride_scale_c,
                    mask=mask, other=0,
                )
                w_even, w_odd = decode_nvfp4(packed, scale_bytes, tl.load(global_scale_ptr), e2m1_ptr, e4m3_ptr)
                e_even = tl.load(w1_row + 2 * offs_c * stride_w1_r, mask=c_mask, other=0.0).to(tl.float32)
                e_odd = tl.load(w1_row + (2 * offs_c + 1) * stride_w1_r, mask=c_mask, other=0.0).to(tl.float32)
                dots = tl.sum(w_even * e_even[None, :] + w_odd * e_odd[None, :], axis=1)  # [TOPK_BLOCK]
            else:
                w = tl.load(w2_tile, mask=mask, other=0.0).to(tl.float32)
                embed = tl.load(w1_row + offs_c * stride_w1_r, mask=c_mask, other=0.0).to(tl.float32)
                dots = tl.sum(w * embed[None, :], axis=1)  # [TOPK_BLOCK]
            base_row = base_ptr + b * stride_base_b + i * stride_base_n
            base = tl.load(base_row + offs_j * stride_base_k, mask=j_mask, other=0.0)
            corrected = base.to(tl.float32) + alpha * dots
            tl.store(corrected_ptr + (b * n_steps + i) * topk + offs_j, corrected, mask=j_mask)
            score = corrected
            if USE_GUMBEL:
                gumbel_row = gumbel_ptr + b * stride_gumbel_b + i * stride_gumbel_n
                noise = tl.load(gumbel_row + offs_j * stride_gumbel_k, mask=j_mask, other=0.0)
                score = corrected / temperature + noise
            score = tl.where(j_mask, score, float("-inf"))
            best = tl.argmax(score, axis=0, tie_break_left=True)
            token = tl.sum(tl.where(offs_j == best, cand, 0), axis=0)  # the chosen draft id
            if HAS_D2T:
                token += tl.load(d2t_ptr + token)
            tl.store(tokens_ptr + b * n_steps + i, token)
            prev = token
