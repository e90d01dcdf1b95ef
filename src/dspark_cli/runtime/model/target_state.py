"""Exact rollback of a stateful target: the recurrent, convolution and linear-attention states of its cache.

A round scores [anchor, d_1..d_n] in one forward. Attention layers keep one K/V entry per position and are simply
cropped, but a Gated DeltaNet, Mamba, short-convolution or lightning-attention layer folds every scored token into
one fixed-size state, so after accepting m draft tokens that state has seen n - m tokens too many. dspark restores it
exactly (docs/stateful.md has the measurements behind each choice), one of three ways (StateRollback):

Gated DeltaNet targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): dspark runs the mixers itself during a score pass
(model/gdn_scoring.py: one unpadded chunk instead of transformers' 64-position one) and keeps what it needs to form
the state after any scored position, so the rollback is a copy of the state at the kept position: no snapshot before
the score pass, no replay after it.

Other targets that continue a cached sequence with a block (Mamba2 hybrids, LFM2, MiniMax):

    states = StateSnapshot.take(cache)     # before the score pass: one copy of every state tensor (no forward)
    ... score n + 1 tokens, accept m ...
    states.restore()                       # the states as they were before the score pass (copied in place)
    replay.run(keep=m + 1)                 # re-advance only the stateful mixers over the kept positions

The replay feeds each stateful mixer (the Mamba, conv or lightning block of a decoder layer) the inputs it received
for the kept positions in the score pass: by causality those inputs do not depend on the rejected positions, so the
mixers end in the state of prompt + committed tokens, and no attention, MLP or lm_head runs again. A round that keeps
every scored position restores nothing and replays nothing.

Where transformers cannot continue a cached sequence with several tokens at once (Jamba's Mamba layers start their
selective scan from zero on a multi-token forward), the target scores one token at a time instead and keeps the
state after each position (`Family.block_scoring`): exact, but slower than plain decoding.

The cache is built the way the model's own `generate` builds it: `DynamicCache(config=...)`, whose layers carry the
states (transformers 5.17 to 5.25: `conv_states` / `recurrent_states` dicts of a linear-attention layer, from 5.25 with
the count of positions they have read, which a rollback sets back too), or the model's own cache class (MiniMax).
State layouts dspark does not know are refused, never guessed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.stateful import FAMILIES, Family, supported_names
from dspark_cli.runtime.model.gdn_scoring import TOKEN_COUNT, ScorePass, token_count


def text_model_type(config) -> str:
    """model_type of the text config (a multimodal Qwen3.5 loads as its text model)."""
    return getattr(config.get_text_config(), "model_type", None) or config.model_type


def build_cache(model: nn.Module):
    """A new, empty cache built as the model's own generate builds it.

    DynamicCache(config=text config) lays out one layer per decoder layer from config.layer_types (linear-attention
    layers hold conv / recurrent states); a model that refuses DynamicCache (MiniMax) gets its own cache class."""
    from transformers import DynamicCache

    if _supports_default_cache(model):
        cache = DynamicCache(config=model.config.get_text_config())
        if any(hasattr(layer, "sliding_window") for layer in cache.layers):
            raise DsparkError(f"the target {type(model).__name__} has sliding-window attention layers beside its "
                              "recurrent states; transformers cannot crop those once the window is full, so dspark "
                              "cannot roll this target back exactly.")
        return cache
    if text_model_type(model.config) == "minimax":
        return _minimax_cache(model.config.get_text_config())
    raise DsparkError(f"the target {type(model).__name__} keeps a cache of its own that dspark cannot roll back; "
                      f"dspark drafts for {supported_names()} and attention-only causal LMs.")


def _minimax_cache(text_config):
    """MiniMaxCache whose length questions go to its first full-attention layer.

    transformers' MiniMaxCache answers get_seq_length / get_mask_sizes from layer 0, which is a lightning-attention
    layer in MiniMax's layout and holds no K/V: a multi-token forward after a prefix then gets a causal mask as if
    the cache were empty (single-token decoding does not notice). Asking the first attention layer fixes that."""
    layer_types = list(text_config.layer_types)
    return _minimax_cache_class()(layer_types.index("full_attention") if "full_attention" in layer_types else 0)


@functools.cache
def _minimax_cache_class() -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    class MiniMaxTargetCache(MiniMaxCache):
        def __init__(self, attention_layer: int):
            super().__init__()
            self.attention_layer = attention_layer

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return super().get_seq_length(layer_idx or self.attention_layer)

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
            return super().get_mask_sizes(query_length, layer_idx or self.attention_layer)

        def get_query_offset(self, layer_idx: int = 0):
            return super().get_query_offset(layer_idx or self.attention_layer)

    return MiniMaxTargetCache


# --- the states -------------------------------------------------------------------------------------------------

Slot = tuple[object, object]  # (a dict or list of the cache holding a state tensor, its key)


def state_slots(cache) -> list[Slot]:
    """Every state tensor of the cache that a forward overwrites in place (not the attention K/V, which grows).

    Linear-attention layers (transformers' LinearAttentionCacheLayerMixin: Gated DeltaNet, Mamba, short conv)
    keep conv_states / recurrent_states dicts, and from transformers 5.25 the count of positions those states have
    read (a 0-dim tensor the forward advances in place); MiniMaxCache keeps linear_cache, one KV-state per lightning
    layer."""
    slots: list[Slot] = []
    for layer in getattr(cache, "layers", []):
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            if isinstance(states, dict):
                slots += [(states, key) for key, tensor in states.items() if isinstance(tensor, torch.Tensor)]
        if token_count(layer) is not None:  # an attribute of the layer: its own __dict__ holds it
            slots.append((vars(layer), TOKEN_COUNT))
    linear = getattr(cache, "linear_cache", None)
    if isinstance(linear, list):
        slots += [(linear, index) for index, tensor in enumerate(linear) if isinstance(tensor, torch.Tensor)]
    return slots


@dataclass
class StateSnapshot:
    """A copy of every state tensor of a cache; restore() writes it back in place (static addresses are kept)."""

    saved: list[tuple[object, object, torch.Tensor]]

    @classmethod
    def take(cls, cache) -> "StateSnapshot":
        return cls([(holder, key, holder[key].clone()) for holder, key in state_slots(cache)])

    def restore(self) -> None:
        for holder, key, tensor in self.saved:
            holder[key].copy_(tensor)

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for _, _, tensor in self.saved)


def crop_attention(cache, length: int) -> None:
    """Keep the first `length` positions of every attention layer's K/V, leaving the states alone.

    A Falcon-H1 layer holds both (transformers' LinearAttentionAndFullAttentionLayer, whose own crop refuses while
    it holds a recurrent state): its attention half is cropped through the attention base class."""
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "keys", None) is None or not hasattr(layer, "get_seq_length"):
            continue
        excess = layer.get_seq_length() - length
        if excess > 0:
            _attention_crop(type(layer))(layer, -excess)


def _attention_crop(layer_class: type) -> Callable:
    """The crop of the first class in the layer's MRO that is not a linear-attention (state) layer."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    for base in layer_class.__mro__:
        if "crop" in vars(base) and not issubclass(base, LinearAttentionCacheLayerMixin):
            return base.crop
    raise DsparkError(f"dspark cannot crop the attention part of a {layer_class.__name__} cache layer.")


# --- the replay -------------------------------------------------------------------------------------------------


@dataclass
class MixerReplay:
    """Records the calls of the stateful mixers during a score pass and re-runs them over a prefix of its positions.

    Forward pre-hooks keep references to each mixer's arguments (no copies); `run(keep, scored)` calls every
    recorded mixer again, in layer order, with each [1, T, ...] argument cut to its first `keep` positions."""

    calls: list[tuple[nn.Module, tuple, dict]] = field(default_factory=list)
    recording: bool = False

    @classmethod
    def install(cls, mixers: list[nn.Module]) -> "MixerReplay":
        replay = cls()
        for mixer in mixers:
            mixer.register_forward_pre_hook(replay._record, with_kwargs=True)
        return replay

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.recording:
            self.calls.append((module, args, kwargs))

    def start(self) -> None:
        self.calls, self.recording = [], True

    def stop(self) -> None:
        self.recording = False

    @torch.inference_mode()
    def run(self, keep: int, scored: int) -> None:
        """Re-advance every recorded mixer over the first `keep` of the `scored` positions (cache in place)."""
        def cut(value):
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == scored:
                return value[:, :keep]  # [1, scored, ...] -> [1, keep, ...]
            if isinstance(value, tuple):
                return tuple(cut(item) for item in value)
            return value

        for module, args, kwargs in self.calls:
            module(*[cut(a) for a in args], **{k: cut(v) for k, v in kwargs.items()})
        self.calls = []


def stateful_mixers(model: nn.Module, family: Family) -> list[nn.Module]:
    """The stateful mixer of every decoder layer that has one (family.mixer; on family.only_layer_type layers)."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    mixers = []
    for index, layer in enumerate(model.get_decoder().layers):
        if family.only_layer_type is not None and layer_types[index] != family.only_layer_type:
            continue
        mixer = getattr(layer, family.mixer, None)
        if mixer is not None:
            mixers.append(mixer)
    if not mixers:
        raise DsparkError(f"the {family.name} target has no `{family.mixer}` mixer in its decoder layers; its "
                          "transformers version lays the model out differently from what dspark rolls back.")
    return mixers


# --- which targets ----------------------------------------------------------------------------------------------


def stateful_family(config, model_class: type | None = None) -> Family | None:
    """The Family of a stateful target config, None for an attention-only one (no weights are needed).

    DsparkError (one sentence) for a target whose state dspark cannot roll back exactly: a model class with a cache
    of its own, or layers that keep a recurrent / convolution state in a family not verified here."""
    kind = text_model_type(config)
    if kind in FAMILIES:
        return FAMILIES[kind]
    custom_cache = model_class is not None and not _class_supports_default_cache(model_class)
    if custom_cache or _state_layer_types(config):
        what = "keeps a cache of its own" if custom_cache else (
            f"has {', '.join(sorted(_state_layer_types(config)))} layers that carry a recurrent or convolution state")
        raise DsparkError(f"the target's model type {kind!r} {what}, and dspark has no exact rollback of that state "
                          f"after a rejected draft token; stateful targets dspark drafts for: {supported_names()}.")
    return None


def _class_supports_default_cache(model_class: type) -> bool:
    check = getattr(model_class, "_supports_default_dynamic_cache", None)
    return True if check is None else bool(check())


def _supports_default_cache(model: nn.Module) -> bool:
    return _class_supports_default_cache(type(model))


def _state_layer_types(config) -> set[str]:
    """The layer types of the config whose transformers cache layer keeps a state instead of K/V."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    try:
        layers = DynamicCache(config=config.get_text_config()).layers
    except (KeyError, TypeError, ValueError, AttributeError):
        return set()  # a layout transformers' DynamicCache does not know: the load path decides
    layer_types = list(getattr(config.get_text_config(), "layer_types", None) or [])
    return {str(layer_types[i]) if i < len(layer_types) else "state" for i, layer in enumerate(layers)
            if isinstance(layer, LinearAttentionCacheLayerMixin)}


def family_of_target(config) -> Family | None:
    """stateful_family of a target from its config (the PretrainedConfig of its config.json), before any weight is
    read."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return stateful_family(config, model_class)


# --- one target's rollback --------------------------------------------------------------------------------------


@dataclass
class ScoredBlock:
    """The positions of the last score pass and what is needed to keep only a prefix of them."""

    start: int  # cache length before the block
    length: int  # positions scored
    before: StateSnapshot | None  # the states at `start` (None: the Gated DeltaNet score pass keeps its own)
    after: list[StateSnapshot] | None = None  # one-at-a-time scoring: the states after each scored position


class StateRollback:
    """The stateful half of a TargetModel: how it scores a block and keeps a prefix of it, one of three ways.

    - Gated DeltaNet targets (Qwen3.5, Qwen3-Next): dspark runs the mixers itself during a score pass
      (model/gdn_scoring.py) and sets their states to the kept position by a copy; no snapshot, no replay.
    - other targets that can continue a cache with a block: snapshot, score, then restore + mixer replay.
    - Jamba: one forward per scored token, the states after each kept (rollback is a copy)."""

    def __init__(self, model: nn.Module, family: Family):
        self.family = family
        mixers = stateful_mixers(model, family) if family.block_scoring else []
        self.gated_deltanet = ScorePass.install(mixers)
        self.replay = MixerReplay.install(mixers) if mixers and self.gated_deltanet is None else None
        self.saved: tuple[int, StateSnapshot] | None = None  # (cache length, snapshot) taken by save()
        self.scored: ScoredBlock | None = None

    @property
    def needs_snapshot(self) -> bool:
        """True where a score pass must be preceded by a copy of the states (the replay scheme)."""
        return self.replay is not None

    def reset(self) -> None:
        self.saved = self.scored = None

    def save(self, cache, length: int) -> None:
        """Snapshot the states before a score pass at cache length `length` (the round's `snapshot` step)."""
        if self.needs_snapshot and (self.saved is None or self.saved[0] != length):
            self.saved = (length, StateSnapshot.take(cache))

    def begin_score(self, cache, start: int, length: int) -> None:
        if self.gated_deltanet is not None:
            self.scored = ScoredBlock(start, length, None)
            self.gated_deltanet.start()
            return
        if self.replay is None:  # one at a time: the states before the block, then after each position
            self.scored = ScoredBlock(start, length, StateSnapshot.take(cache), [])
            return
        self.save(cache, start)
        self.scored = ScoredBlock(start, length, self.saved[1])
        self.saved = None
        self.replay.start()

    def end_score(self) -> None:
        for scheme in (self.gated_deltanet, self.replay):
            if scheme is not None:
                scheme.stop()

    def after_position(self, cache) -> None:
        """One-at-a-time scoring: keep the states after the position just scored."""
        self.scored.after.append(StateSnapshot.take(cache))

    def keep(self, cache, keep: int) -> None:
        """Keep the first `keep` positions of the last scored block: attention K/V cropped, states exact."""
        block, self.scored = self.scored, None
        if self.gated_deltanet is not None:
            self.gated_deltanet.keep(keep)
        elif keep == block.length:  # every scored position stays: nothing to undo
            if self.replay is not None:
                self.replay.calls = []
            return
        elif block.after is not None:
            (block.after[keep - 1] if keep else block.before).restore()
        else:
            block.before.restore()
            if keep:
                self.replay.run(keep, block.length)
        if keep < block.length:
            crop_attention(cache, block.start + keep)
