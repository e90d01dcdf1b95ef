"""DSparkDraft: the DSpark / DFlash draft model, and DraftContext, its context K/V cache during generation.

One parallel pass drafts a block: target features → `fc` + `hidden_norm` → per-layer context K/V (no
input_layernorm), then the query block attends to the context and to itself through the decoder layers of the
draft's family (runtime/model/families/: Qwen3, Gemma-4, DFlash2) and the final `norm`: a dense layer to all context
and all of its block in both directions, a causal or sliding-window layer as the config says (`layer_attention`,
docs/format.md §2.3). The Markov head (its type from runtime/model/heads/: `markov_w1` [V, r], `markov_w2` [Vd, r],
plus the gated / RNN projections) and the confidence head are exposed as separate pieces: the sequential stage
lives in `runtime/decode/markov.py`. The draft knows nothing of files: loading by the DeepSpec tensor names
(docs/format.md §1.2, §2) and saving are `runtime/model/draft_io.py`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.families import FAMILIES
from dspark_cli.runtime.model.families import BACKBONES
from dspark_cli.runtime.model.heads import HEADS
from dspark_cli.runtime.model.layers import layer_mask, rope_cos_sin
from dspark_cli.runtime.model.selector import CandidateSelector

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [B, kv_heads, T, head_dim]


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
        self.family = BACKBONES[config.family]
        H, V, Vd, r = config.hidden_size, config.vocab_size, config.draft_vocab_size, config.markov_rank
        self.layers = nn.ModuleList(self.family.DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = self.family.Norm(H, config.rms_norm_eps)
        self.fc = nn.Linear(len(config.layer_ids) * config.target_hidden_size, H, bias=False)
        self.hidden_norm = self.family.Norm(H, config.rms_norm_eps)
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.markov_head = HEADS[config.markov_head_type](V, Vd, r, H) if r else None
        self.confidence_head = ConfidenceHead(self.confidence_in_features) if config.enable_confidence_head else None
        self.candidate_selector = (CandidateSelector(V, config.selector_rank, H, config.selector_top_k)
                                   if config.has_selector else None)  # DFlash2's path selector
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
            elif getattr(module, "weight", None) is not None and module.weight.dim() == 1:  # the norms
                nn.init.ones_(module.weight)
        for name, buffer in self.named_buffers():
            if name.endswith("layer_scalar"):
                nn.init.ones_(buffer)
        for module in self.modules():  # bare parameters with their own rule (DFlash2's convolution and selector)
            if hasattr(module, "init_parameters"):
                module.init_parameters(std)

    # --- forward pieces ---------------------------------------------------------------------------------------

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, n*Ht] -> [B, T, H]"""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """[B, T] positions -> cos, sin [B, 1, T, head_dim] (partial for Gemma-4's proportional RoPE)."""
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype, c.rope_partial_factor)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> KVCache:
        """context [B, T, H] at positions [B, T] -> per layer k, v [B, kv_heads, T, D]."""
        cos, sin = self.rope(positions, context.dtype)
        return [layer.self_attn.key_value(context, cos, sin) for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, Q] ids -> [B, Q, H] (times sqrt(H), rounded to the weight's dtype, for Gemma-4)."""
        x = self.embed_tokens(input_ids)
        scale = self.family.embed_scale(self.config)
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype, device=x.device)

    def block_hidden(self, input_ids, positions, context_kv: KVCache, attn_mask=None,
                     block_length: int | None = None) -> torch.Tensor:
        """Query block ids [B, Q] at positions [B, Q] over the context K/V of positions 0..C-1 -> final-norm hidden
        [B, Q, H]. attn_mask [B|1, Q, C+Q] bool (None: everything) is what every layer may see; each layer narrows it
        by its own rule (layer_mask). block_length: Q holds blocks of this many slots one after another (training's
        anchors), for a family that convolves along the block (DFlash2); None: Q is one block."""
        x = self.embed(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        blocks = {"block_length": block_length} if getattr(self.family, "BLOCK_CONVOLUTION", False) else {}
        rules = self.config.layer_attention
        context_length = context_kv[0][0].shape[2]
        masks = {rule: layer_mask(rule, positions, context_length, attn_mask) for rule in set(rules)}
        for layer, context, rule in zip(self.layers, context_kv, rules):
            x = layer(x, cos, sin, context, masks[rule], **blocks)
        return self.norm(x)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., Vd] (draft vocabulary; soft-capped for Gemma-4, then times logit_scale)"""
        return self.config.logit_scale * self.family.logits(self.lm_head(hidden), self.config)

    def markov_embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """target-vocab ids [...] -> e = W1[prev] [..., r]"""
        return self.markov_head.markov_w1(prev_ids)

    def markov_latents(self, embed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced latents of whole blocks: e [..., K, r], hidden [..., K, H] -> u [..., K, r]."""
        return self.markov_head.block_latents(embed, hidden)

    def markov_bias(self, latent: torch.Tensor) -> torch.Tensor:
        """u [..., r] -> [..., Vd]"""
        return self.config.logit_scale * self.markov_head.markov_w2(latent)

    def confidence_logit(self, hidden: torch.Tensor, embed: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] (+ Markov embedding [..., r]) -> acceptance logit [...] in fp32."""
        x = hidden.float()
        if self.config.confidence_head_with_markov and self.config.markov_rank:
            x = torch.cat([x, embed.float()], dim=-1)
        return self.confidence_head.proj(x).squeeze(-1)

    def state_for_save(self, dtype: torch.dtype = torch.bfloat16, include_shared: bool = False) -> dict:
        """DeepSpec-format tensors (names as on disk); shared target weights only if asked, or when vLLM would not
        share them for this family (Gemma-4: the draft ships its own embed_tokens and lm_head, as DeepSpec's)."""
        include_shared = include_shared or not FAMILIES[self.config.family].vllm_shares_embeddings
        skip = set()
        if self.shares_embed and not include_shared:
            skip.add("embed_tokens.weight")
        if self.shares_lm_head and not include_shared:
            skip.add("lm_head.weight")
        tensors = {n: p.detach().to(dtype).contiguous().cpu() for n, p in self.named_parameters() if n not in skip}
        tensors.update({n: b.detach().to(dtype).contiguous().cpu() for n, b in self.named_buffers()
                        if n.endswith("layer_scalar")})
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
