"""The score pass of a Gated DeltaNet target (Qwen3.5, Qwen3.5-MoE, Qwen3-Next), and its rollback as a copy.

transformers sends every multi-token forward of a Gated DeltaNet layer through its chunked kernel, padded to 64
positions, which on a CPU makes scoring a block of 5 drafted tokens cost 1.4 plain decoding steps; and it keeps only
the state after the last position, so a rejection needs the states restored and the mixers re-run. During a score
pass dspark runs each Gated DeltaNet mixer itself (`ScorePass.install` puts a forward of its own on the mixer; every
other forward, prefill and plain decoding included, is transformers' own):

    conv     one depthwise conv over [conv state (K), block (T)]: no padding; the conv state after keeping n
             positions is the window full[n : n + K], a slice of what the pass built anyway
    delta    the gated delta rule over the T positions as one unpadded chunk (transformers' chunked form with the
             chunk cut to the block): the UT system (I + A) u = beta * (v - exp(G) S0^T k) solved once, outputs
             o_i = exp(G_i) q_i^T S0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
    keep n   the recurrent state after n positions, S_n = exp(G_n) S0 + sum_{j<n} exp(G_n - G_j) k_j u_j^T, one
             [Dk, n] @ [n, Dv] product per head written into the cache (n = 0: S0 itself): no replay, no snapshot

(G = cumulative log decay, u = the delta rule's corrected values; docs/stateful.md has the measurements behind the
choice of one unpadded chunk over the per-token recurrent form.) The cache holds the state after all T positions
when the pass ends, as after transformers' own forward; `keep` moves it back to any scored position.

Works on transformers 5.17 to 5.25 (the mixer takes its cache as `cache_params` before 5.24, `cache` from it; all
lay the conv and recurrent states out as `layers[i].conv_states[0]` [1, C, K] and `recurrent_states[0]`
[1, H, Dk, Dv]). From 5.25 a layer also counts the positions its states have read (`token_count`): the score pass
advances it by T as transformers' forward does, `keep` moves it back with the states. A mixer laid out differently is
not taken over: `install` returns None and the target keeps the generic rollback (model/target_state.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# The attributes every Gated DeltaNet mixer of transformers 5.17-5.24 has, beside one of the two projection layouts.
COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "layer_idx", "num_k_heads", "num_v_heads",
          "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation")
QWEN3_5_LAYOUT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_NEXT_LAYOUT = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
TOKEN_COUNT = "cumulative_length_linear"  # a linear-attention cache layer's position count (transformers >= 5.25)


def token_count(layer) -> torch.Tensor | None:
    """The positions a linear-attention cache layer's states have read, a 0-dim tensor advanced in place by
    transformers' forward and answered by the layer's get_seq_length (the cache's, when layer 0 is one: positions
    and generate read it); None where transformers keeps no such count (before 5.25)."""
    count = getattr(layer, TOKEN_COUNT, None)
    return count if isinstance(count, torch.Tensor) else None


def is_gated_deltanet(module: nn.Module) -> bool:
    """True for a transformers Gated DeltaNet mixer in a projection layout this module knows."""
    return all(hasattr(module, name) for name in COMMON) and (
        all(hasattr(module, name) for name in QWEN3_5_LAYOUT)
        or all(hasattr(module, name) for name in QWEN3_NEXT_LAYOUT))


@dataclass
class DeltaBlock:
    """The gated delta rule over one block, kept so that the state after any of its positions can be formed."""

    start: torch.Tensor  # S0 [H, Dk, Dv]
    keys: torch.Tensor  # [H, T, Dk]
    updates: torch.Tensor  # [H, T, Dv]
    decay: torch.Tensor  # [H, T, T]
    log_decay: torch.Tensor  # [H, T]

    def state_after(self, kept: int) -> torch.Tensor:
        """S_kept [H, Dk, Dv] float32, the state after the first `kept` positions (kept = 0: S0)."""
        if kept == 0:
            return self.start
        weights = self.decay[:, kept - 1, :kept, None]  # [H, n, 1]: exp(G_n - G_j), j < n
        return (self.log_decay[:, kept - 1].exp()[:, None, None] * self.start
                + (self.keys[:, :kept] * weights).transpose(1, 2) @ self.updates[:, :kept])  # [H, Dk, Dv]


def delta_rule_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, DeltaBlock]:
    """The gated delta rule (l2-normalised q and k, as transformers' kernels) over T positions as one chunk.
    query, key [T, Hk, Dk], value [T, H, Dv], g, beta [T, H], start S0 [H, Dk, Dv] float32
    -> (output [T, H, Dv] float32, the block for states after any position)."""
    heads = value.shape[1]
    if key.shape[1] != heads:  # grouped value heads: each q/k head serves heads // Hk consecutive value heads
        query = query.repeat_interleave(heads // key.shape[1], dim=1)
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
    query, key, value = (x.transpose(0, 1).float() for x in (query, key, value))  # [H, T, D]
    beta, g = beta.transpose(0, 1).float(), g.transpose(0, 1).float()  # [H, T]
    query = _l2norm(query) * query.shape[-1] ** -0.5
    key = _l2norm(key)
    length = key.shape[1]
    log_decay = g.cumsum(-1)  # G [H, T]
    lower = torch.ones(length, length, dtype=torch.bool, device=key.device).tril()  # [T, T] j <= i
    decay = (log_decay[:, :, None] - log_decay[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # [H, T, T]
    weighted_keys = key * beta[..., None]  # [H, T, Dk]
    system = ((weighted_keys @ key.transpose(1, 2)) * decay).tril(-1)  # A [H, T, T], strictly lower
    targets = value * beta[..., None] - (weighted_keys * log_decay.exp()[..., None]) @ start  # [H, T, Dv]
    updates = torch.linalg.solve_triangular(system, targets, upper=False, unitriangular=True)  # u [H, T, Dv]: I + A
    out = (query * log_decay.exp()[..., None]) @ start + ((query @ key.transpose(1, 2)) * decay) @ updates
    return out.transpose(0, 1), DeltaBlock(start, key, updates, decay, log_decay)  # [T, H, Dv]


@dataclass
class ScoredLayer:
    """What one mixer's score pass keeps to set its states to any scored position."""

    conv_state: torch.Tensor  # the cache's conv state [1, C, K] (written in place)
    recurrent_state: torch.Tensor  # the cache's recurrent state [1, H, Dk, Dv] (written in place)
    conv_window: torch.Tensor  # [1, C, K + T]: the conv state before the block, then the block's conv inputs
    block: DeltaBlock  # the delta rule over the block
    count: torch.Tensor | None  # the layer's token_count (after the block; written in place), None before 5.25

    def keep(self, kept: int) -> None:
        """Set the cache's states (and position count) to those after the first `kept` of the T scored positions."""
        width = self.conv_state.shape[-1]
        self.conv_state.copy_(self.conv_window[..., kept : kept + width])
        self.recurrent_state.copy_(self.block.state_after(kept)[None])
        if self.count is not None:  # the T - kept dropped positions, as transformers' own crop subtracts them
            self.count.sub_(self.conv_window.shape[-1] - width - kept)


@dataclass(eq=False)
class ScorePass:
    """The Gated DeltaNet mixers of one target, run by dspark during its score passes.

    start() before the score forward, stop() after it; keep(n) then sets every mixer's states to those after the
    first n scored positions (the attention K/V are cropped by the caller)."""

    mixers: list[nn.Module]
    active: bool = False
    layers: list[ScoredLayer] = field(default_factory=list)
    scored: int = 0

    @classmethod
    def install(cls, mixers: list[nn.Module]) -> "ScorePass | None":
        """Route every mixer's score passes to a new ScorePass; None (nothing installed) unless all are Gated
        DeltaNet mixers in a layout this module knows. A mixer gets one forward of dspark's the first time; each
        TargetModel built on the same model adds its ScorePass to that mixer's set (held weakly)."""
        if not mixers or not all(is_gated_deltanet(mixer) for mixer in mixers):
            return None
        scoring = cls(list(mixers))
        for mixer in mixers:
            passes = mixer.__dict__.get(PASSES)
            if passes is None:
                passes = weakref.WeakSet()
                mixer.__dict__[PASSES] = passes
                mixer.forward = _routing_forward(mixer, mixer.forward, passes)
            passes.add(scoring)
        return scoring

    def start(self) -> None:
        self.active, self.layers, self.scored = True, [], 0

    def stop(self) -> None:
        self.active = False

    @torch.inference_mode()
    def keep(self, kept: int) -> None:
        """The states of every mixer after the first `kept` scored positions (kept = scored: as they are)."""
        layers, self.layers = self.layers, []
        if kept != self.scored:
            for layer in layers:
                layer.keep(kept)

    def score(self, mixer: nn.Module, hidden: torch.Tensor, cache, attention_mask) -> torch.Tensor:
        output, layer = score_mixer(mixer, hidden, cache, attention_mask)
        self.layers.append(layer)
        self.scored = hidden.shape[1]
        return output


PASSES = "_dspark_score_passes"  # the mixer's set of ScorePass (one per TargetModel built on the model)


def _routing_forward(mixer: nn.Module, original, passes: weakref.WeakSet):
    """The mixer's forward: dspark's score pass while one of its ScorePasses is active, transformers' otherwise."""
    def forward(hidden_states: torch.Tensor, cache=None, attention_mask=None, cache_params=None, **kwargs):
        cache = cache if cache is not None else cache_params
        scoring = next((scoring for scoring in passes if scoring.active), None) if cache is not None else None
        if scoring is None:
            return original(hidden_states, cache, attention_mask=attention_mask, **kwargs)
        return scoring.score(mixer, hidden_states, cache, attention_mask)

    return forward


def score_mixer(mixer: nn.Module, hidden: torch.Tensor, cache, attention_mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, ScoredLayer]:
    """One Gated DeltaNet mixer over a block of T positions continuing its cached state.
    hidden [1, T, Hd] -> (output [1, T, Hd], what keep() needs); the cache ends in the state after all T."""
    from transformers.activations import ACT2FN

    layer = cache.layers[mixer.layer_idx]
    conv_state, recurrent_state = layer.conv_states[0], layer.recurrent_states[0]
    if conv_state is None or recurrent_state is None:
        raise ValueError("a Gated DeltaNet score pass continues a cached sequence: prefill the target first")
    if attention_mask is not None and attention_mask.dim() == 2:
        hidden = (hidden * attention_mask[:, :, None]).to(hidden.dtype)
    length = hidden.shape[1]
    mixed, z, b, a = _projections(mixer, hidden)  # [1, T, C], [1, T, H, Dv], [1, T, H], [1, T, H]

    window = torch.cat([conv_state.to(mixed.dtype), mixed.transpose(1, 2)], dim=-1)  # [1, C, K + T]
    weight = mixer.conv1d.weight  # [C, 1, K]
    conv = F.conv1d(window.to(weight.dtype), weight, mixer.conv1d.bias, groups=window.shape[1])[..., -length:]
    conv = ACT2FN[mixer.activation](conv).to(mixed.dtype).transpose(1, 2)  # [1, T, C]
    query, key, value = torch.split(conv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)

    beta = b.sigmoid()  # [1, T, H]
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)  # [1, T, H] log decay per step
    start = recurrent_state[0].float().clone()  # S0 [H, Dk, Dv]
    out, scored = delta_rule_block(query.reshape(length, -1, mixer.head_k_dim),
                                   key.reshape(length, -1, mixer.head_k_dim),
                                   value.reshape(length, -1, mixer.head_v_dim), g[0], beta[0], start)
    conv_state.copy_(window[..., -conv_state.shape[-1] :])
    recurrent_state.copy_(scored.state_after(length)[None])
    count = token_count(layer)
    if count is not None:  # as transformers' update_conv_state counts a multi-token forward
        count.add_(length)

    out = mixer.norm(out.to(hidden.dtype).reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    output = mixer.out_proj(out.reshape(1, length, mixer.value_dim))  # [1, T, Hd]
    return output, ScoredLayer(conv_state, recurrent_state, window, scored, count)


def _projections(mixer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """hidden [1, T, Hd] -> (q|k|v before the conv [1, T, C], z [1, T, H, Dv], b [1, T, H], a [1, T, H])."""
    length = hidden.shape[1]
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5, Qwen3.5-MoE
        z = mixer.in_proj_z(hidden).reshape(1, length, -1, mixer.head_v_dim)
        return mixer.in_proj_qkv(hidden), z, mixer.in_proj_b(hidden), mixer.in_proj_a(hidden)
    query, key, value, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden),
                                                                    mixer.in_proj_ba(hidden))  # Qwen3-Next
    mixed = torch.cat([x.reshape(1, length, -1) for x in (query, key, value)], dim=-1)
    return mixed, z, b, a


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' and flash-linear-attention's q/k norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
