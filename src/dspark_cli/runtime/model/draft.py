"""DSparkDraft: the DSpark / DFlash draft model, and DraftContext, its context K/V cache during generation.

One parallel pass drafts a block: target features → `fc` + `hidden_norm` → per-layer context K/V (no
input_layernorm), then the query block attends to all context and, non-causally, to itself through Qwen3 decoder
layers and the final `norm`. The Markov head (`markov_w1` [V, r], `markov_w2` [Vd, r]) and the confidence head are
exposed as separate pieces: the sequential stage lives in `runtime/decode/markov.py`. The draft knows nothing of files: loading by the
DeepSpec tensor names (docs/format.md §1.2, §2) and saving are `runtime/model/draft_io.py`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [B, kv_heads, T, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """[B, T] int positions -> cos, sin [B, 1, T, head_dim] (neox layout: halves rotated together)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated at its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        bias = config.attention_bias
        self.q_proj = nn.Linear(H, self.heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def _split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, T, heads*D] -> [B, heads, T, D]"""
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, H] -> k, v [B, kv_heads, T, D] (k normed and rotated)."""
        k = apply_rope(self.k_norm(self._split(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._split(self.v_proj(x), self.kv_heads)

    def forward(self, x, cos, sin, context: tuple[torch.Tensor, torch.Tensor], attn_mask):
        """Block x [B, Q, H] attends to [context ; block]; attn_mask [B|1, Q, C+Q] bool or None (all)."""
        q = apply_rope(self.q_norm(self._split(self.q_proj(x), self.heads)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        k = torch.cat([context[0].to(k.dtype), k], dim=2)
        v = torch.cat([context[1].to(v.dtype), v], dim=2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        mask = None if attn_mask is None else attn_mask[:, None]  # [B|1, 1, Q, C+Q]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, Q, D]
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, context, attn_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, draft_vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)  # indexed by target-vocab id
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)  # rows indexed by draft id


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkDraft(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        config.require_runnable("draft config")
        if not config.use_aux_hidden_state:
            raise DsparkError("drafts with use_aux_hidden_state=false (no fc, last hidden state as context) are not "
                              "supported by dspark; use a checkpoint trained with target-layer features.")
        self.config = config
        H, V, Vd, r = config.hidden_size, config.vocab_size, config.draft_vocab_size, config.markov_rank
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(len(config.layer_ids) * config.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.markov_head = MarkovHead(V, Vd, r) if r else None
        self.confidence_head = ConfidenceHead(self.confidence_in_features) if config.enable_confidence_head else None
        self.register_buffer("d2t", None)
        self.w2_nvfp4 = None  # NVFP4Weight of markov_w2 when the checkpoint head is NVFP4 (packed rows for gathers)
        self.shares_embed = False  # embed_tokens / lm_head hold the target's weights (not saved)
        self.shares_lm_head = False
        self.init_weights()

    @property
    def confidence_in_features(self) -> int:
        c = self.config
        return c.hidden_size + (c.markov_rank if c.confidence_head_with_markov and c.markov_rank else 0)

    def init_weights(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # --- forward pieces ---------------------------------------------------------------------------------------

    def target_features(self, hidden_states) -> torch.Tensor:
        """HF output_hidden_states (L+1 x [B, T, Ht]) -> [B, T, n*Ht]: outputs of the draft's target layers."""
        return torch.cat([hidden_states[i] for i in self.config.hidden_state_indices], dim=-1)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, n*Ht] -> [B, T, H]"""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> KVCache:
        """context [B, T, H] at positions [B, T] -> per layer k, v [B, kv_heads, T, D]."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, context.dtype)
        return [layer.self_attn.key_value(context, cos, sin) for layer in self.layers]

    def block_hidden(self, input_ids, positions, context_kv: KVCache, attn_mask=None) -> torch.Tensor:
        """Query block ids [B, Q] at positions [B, Q] -> final-norm hidden [B, Q, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, context in zip(self.layers, context_kv):
            x = layer(x, cos, sin, context, attn_mask)
        return self.norm(x)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] (draft vocabulary)"""
        return self.config.logit_scale * self.lm_head(hidden)

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """target-vocab ids [...] -> [..., r]"""
        return self.markov_head.markov_w1(prev_ids)

    def markov_bias(self, embed: torch.Tensor) -> torch.Tensor:
        """[..., r] -> [..., Vd]"""
        return self.config.logit_scale * self.markov_head.markov_w2(embed)

    def confidence_logit(self, hidden: torch.Tensor, embed: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] (+ Markov embedding [..., r]) -> acceptance logit [...] in fp32."""
        x = hidden.float()
        if self.config.confidence_head_with_markov and self.config.markov_rank:
            x = torch.cat([x, embed.float()], dim=-1)
        return self.confidence_head.proj(x).squeeze(-1)

    def state_for_save(self, dtype: torch.dtype = torch.bfloat16, include_shared: bool = False) -> dict:
        """DeepSpec-format tensors (names as on disk); shared target weights only if asked."""
        skip = set()
        if self.shares_embed and not include_shared:
            skip.add("embed_tokens.weight")
        if self.shares_lm_head and not include_shared:
            skip.add("lm_head.weight")
        tensors = {n: p.detach().to(dtype).contiguous().cpu() for n, p in self.named_parameters() if n not in skip}
        if self.d2t is not None:
            tensors["d2t"] = self.d2t.cpu().long()
        return tensors


class DraftContext:
    """The draft's context cache for one sequence: K/V of positions 0..length-1 per draft layer, in buffers
    that grow by doubling, plus the position ids 0..capacity-1 that the context and query blocks slice.

    Owned by one speculative_generate call: filled at prefill, extended only by the advance step, so that
    `length` always equals the target cache length (the committed positions whose features are known)."""

    def __init__(self, draft: DSparkDraft, capacity: int):
        config, weight = draft.config, draft.fc.weight
        shape = (1, config.num_key_value_heads, max(capacity, 1), config.head_dim)
        self.keys = [torch.empty(shape, dtype=weight.dtype, device=weight.device) for _ in draft.layers]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.positions = torch.arange(shape[2], device=weight.device)  # [capacity]
        self.length = 0

    def append(self, draft: DSparkDraft, features: torch.Tensor) -> None:
        """Project the target features of the next T positions and store their K/V. [T, n*Ht] -> cache."""
        count = features.shape[0]
        end = self.length + count
        positions = self.position_ids(self.length, count)  # [1, T]
        with torch.inference_mode():
            new_kv = draft.context_kv(draft.project_context(features[None]), positions)  # layers x [1, kvh, T, D]
        for keys, values, (k, v) in zip(self.keys, self.values, new_kv):
            keys[:, :, self.length : end] = k
            values[:, :, self.length : end] = v
        self.length = end

    def position_ids(self, start: int, count: int) -> torch.Tensor:
        """[1, count] int64 positions start..start+count-1 (a view; the buffers grow when they would overflow)."""
        if start + count > self.positions.shape[0]:
            self._grow(2 * (start + count))
        return self.positions[None, start : start + count]

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) [1, kv_heads, length, head_dim] views."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]

    @torch.inference_mode(False)  # normal tensors, writable in and outside inference mode (as in __init__)
    def _grow(self, capacity: int) -> None:
        def grown(buffer: torch.Tensor) -> torch.Tensor:
            bigger = buffer.new_empty(*buffer.shape[:2], capacity, buffer.shape[3])
            bigger[:, :, : self.length] = buffer[:, :, : self.length]
            return bigger

        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]
        self.positions = torch.arange(capacity, device=self.positions.device)
