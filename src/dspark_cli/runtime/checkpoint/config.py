"""DraftConfig: one typed view of a draft's config.json and the order in which vLLM resolves each key.

This is the only place that knows config key names and their resolution order (docs/format.md §1.1, §2.1).
Parsing is lenient: a missing or mistyped key becomes None here and `rules/` reports it; `require_runnable`
turns the essentials into one clear error for commands that need a working draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.families import FAMILIES, family_for
from dspark_cli.runtime.checkpoint.families.qwen3 import LAYER_TYPES
from dspark_cli.runtime.checkpoint.heads import HEAD_TYPES

DFLASH_ARCHITECTURES = {"DFlashDraftModel", "Qwen3DFlashModel", "DFlashQwen3Model", "DFlash2DraftModel"}
OTHER_DSPARK_FAMILIES = {"Qwen3OmniDSparkModel", "K3DSparkModel", "Qwen3VLDSparkModel", "DSparkV41DraftModel"}
DEEPSEEK_V4_MODEL_TYPES = {"deepseek_v4", "deepseek_v41"}

# Keys SpecForge nests under dflash_config but vLLM reads only at the top level (docs/formats-other.md §2.5, §4).
SPECFORGE_HOISTED_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")

# Mask-token keys in vLLM's order (get_parallel_drafting_token_id); dflash_config first.
MASK_TOKEN_KEYS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")

GEOMETRY_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size")


@dataclass(frozen=True)
class Resolved:
    """A value and the config key it came from (None when absent everywhere)."""

    value: Any
    source: str | None


@dataclass(frozen=True)
class LayerAttention:
    """Which keys a draft layer's query block sees (docs/format.md §2.3): a query at position q sees the key at k when
    q - k < window (None: no bound), and k <= q if causal, else k - q < window too (both sides of the window)."""

    window: int | None
    causal: bool

    @property
    def dense(self) -> bool:
        """Every context key and every slot of the block, in both directions (DeepSpec's drafts)."""
        return self.window is None and not self.causal


@dataclass
class DraftConfig:
    raw: dict[str, Any]
    architecture: str | None
    kind: str  # "dspark" | "dflash" | "unknown"
    hidden_size: int | None
    intermediate_size: int | None
    num_hidden_layers: int | None
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    vocab_size: int | None
    draft_vocab_size: int | None  # output vocab; defaults to vocab_size
    target_hidden_size: int | None  # width of one captured target feature; defaults to hidden_size
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    mask_token: Resolved
    target_layer_ids: Resolved  # 0-based target layers whose outputs are used (HF hidden_states[id + 1])
    block_size: Resolved
    markov_rank: int | None  # 0 for a DFlash draft
    markov_head_type: str | None
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    sample_from_anchor: bool  # the layout the draft was trained in (N queries when True, 1+N when False)
    vllm_bonus_anchor: bool  # dspark_bonus_anchor: the only layout key vLLM's DSpark speculator reads
    logit_scale: float  # used as is, like vLLM (rules warn when it is not positive)
    use_aux_hidden_state: bool
    num_target_layers: int | None
    dspark_draft_topk: int | None
    format: str = "unknown"  # a key of formats.FORMAT_NAMES
    vllm_config: dict[str, Any] = field(default_factory=dict)  # the config as vLLM sees it after its adapters
    nested_only: tuple[str, ...] = ()  # SPECFORGE_HOISTED_KEYS found only under dflash_config (vLLM misses them)
    # The draft family (checkpoint/families/) and the keys some families resolve differently (Gemma-4).
    family: str = "qwen3"
    attention_k_eq_v: bool = False  # values are the keys' projection (no v_proj)
    final_logit_softcapping: float | None = None  # base logits = tanh(l / cap) * cap
    rope_partial_factor: float = 1.0  # proportional RoPE: the first factor * head_dim/2 frequencies rotate
    hidden_act: str = "silu"
    # DFlash2 (checkpoint/families/dflash2.py, docs/formats-other.md §7): None for every other family
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    embedding_scale: float | None = None  # token embeddings times this (DFlash2's input_embedding_scale)
    # per draft layer as vLLM builds it; None when vLLM could not (rules/ say why: DSP028, DSP035)
    layer_attention: tuple[LayerAttention, ...] | None = None

    @property
    def mask_token_id(self) -> int | None:
        return self.mask_token.value

    @property
    def layer_ids(self) -> list[int] | None:
        return self.target_layer_ids.value

    @property
    def hidden_state_indices(self) -> list[int] | None:
        """Indices into HF `output_hidden_states` (= vLLM aux ids): layer id + 1."""
        ids = self.layer_ids
        return None if ids is None else [i + 1 for i in ids]

    @property
    def has_markov(self) -> bool:
        return bool(self.markov_rank)

    @property
    def has_selector(self) -> bool:
        """A DFlash2 path selector: its top-1 score is the draft's confidence."""
        return self.family == "dflash2"

    @property
    def has_confidence(self) -> bool:
        """The draft gives a confidence per position (a confidence head, or a DFlash2 selector)."""
        return bool(self.enable_confidence_head) or self.has_selector

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size != self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "DraftConfig":
        """Typed view of `raw`; speculators configs are first mapped the way vLLM's adapter maps them."""
        fmt = detect_format(raw)
        view = vllm_view(raw, fmt)
        dflash = _dict(view.get("dflash_config"))
        architecture = _architecture(view)
        kind = _kind(fmt)
        hidden = _int(view.get("hidden_size"))
        vocab = _int(view.get("vocab_size"))
        heads = _int(view.get("num_attention_heads"))
        head_dim = _int(view.get("head_dim"))
        if head_dim is None and hidden and heads:
            head_dim = hidden // heads
        nested = _nested_only(view, dflash) if fmt == "specforge" else {}
        dspark_keys = {**view, **nested}
        rank = dspark_keys.get("markov_rank")
        markov_rank = _int(rank) if rank is not None else (0 if kind == "dflash" else None)
        alpha = dflash.get("confidence_head_alpha", 0)  # SpecForge builds the head when its loss weight is > 0
        confidence_default = fmt == "specforge" and isinstance(alpha, (int, float)) and alpha > 0
        head_type = dspark_keys.get("markov_head_type", "vanilla" if markov_rank else None)
        family = family_for(_list(view.get("architectures")))
        config = cls(
            raw=raw,
            architecture=architecture,
            kind=kind,
            hidden_size=hidden,
            intermediate_size=_int(view.get("intermediate_size")),
            num_hidden_layers=_int(view.get("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=_int(view.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=_int(_or_default(view.get("draft_vocab_size"), vocab)),
            target_hidden_size=_int(_or_default(view.get("target_hidden_size"), hidden)),
            rms_norm_eps=_float(view.get("rms_norm_eps"), 1e-6),
            rope_theta=_rope_theta(view),
            attention_bias=bool(view.get("attention_bias", False)),
            mask_token=resolve_mask_token(view),
            target_layer_ids=resolve_target_layer_ids(view),
            block_size=resolve_block_size(view),
            markov_rank=markov_rank,
            markov_head_type=head_type.lower() if isinstance(head_type, str) else head_type,  # DeepSpec lower-cases
            enable_confidence_head=bool(dspark_keys.get("enable_confidence_head", confidence_default)),
            # Newer vLLM defaults to False when the key is missing; DeepSpec always writes it.
            confidence_head_with_markov=bool(dspark_keys.get("confidence_head_with_markov", False)),
            sample_from_anchor=_sample_from_anchor(view, dflash),
            vllm_bonus_anchor=bool(view.get("dspark_bonus_anchor", False)),
            logit_scale=_number(view.get("logit_scale"), 1.0),
            use_aux_hidden_state=bool(dflash.get("use_aux_hidden_state", view.get("use_aux_hidden_state", True))),
            num_target_layers=_int(view.get("num_target_layers")),
            dspark_draft_topk=_int(view.get("dspark_draft_topk")),
            format=fmt,
            vllm_config=view,
            nested_only=tuple(nested),
            family=family.name,
            layer_attention=resolve_layer_attention(view),
        )
        for key, value in family.resolve(view).items():  # the family's own key resolution (Gemma-4 geometry)
            setattr(config, key, value)
        return config

    def require_runnable(self, source: str) -> None:
        """Raise one clear DsparkError if this config lacks what a forward pass needs."""
        for key in GEOMETRY_KEYS:
            value = getattr(self, key)
            if value is None or value <= 0:
                raise DsparkError(f"{source}: config.json key {key!r} must be a positive integer (got "
                                  f"{self.raw.get(key)!r}); run `dspark validate {source}` for details.")
        if self.mask_token_id is None:
            raise DsparkError(f"{source}: config.json names no mask token (mask_token_id or "
                              "dflash_config.mask_token_id); the draft cannot fill its query block.")
        if not self.layer_ids:
            raise DsparkError(f"{source}: config.json names no target_layer_ids; the draft cannot read the "
                              "target's hidden states.")
        if self.markov_rank is None or self.markov_rank < 0:
            raise DsparkError(f"{source}: config.json key 'markov_rank' must be a non-negative integer.")
        if self.has_selector and None in (self.conv_kernel_size, self.conv_group_size, self.selector_rank,
                                          self.selector_top_k):
            raise DsparkError(f"{source}: a DFlash2 draft needs conv_kernel_size, conv_group_size, selector_rank and "
                              f"selector_top_k as positive integers under dflash_config; run `dspark validate "
                              f"{source}` for details.")
        if self.has_selector and self.reduced_vocab:
            raise DsparkError(f"{source}: a DFlash2 draft's selector indexes its codebooks by target ids; a reduced "
                              "draft vocabulary (draft_vocab_size) is not supported (validate: DSP065).")
        if self.layer_attention is None:
            raise DsparkError(f"{source}: config.json's layer_types, sliding_window or dflash_config.swa_window_size "
                              "do not say how every draft layer attends (one full_attention / sliding_attention entry "
                              f"per layer, a positive window for sliding layers); run `dspark validate {source}`.")
        if self.has_markov and self.markov_head_type not in HEAD_TYPES:
            raise DsparkError(f"{source}: markov_head_type {self.markov_head_type!r} is not a Markov head type "
                              f"dspark knows ({', '.join(HEAD_TYPES)}).")

    @property
    def family_title(self) -> str:
        return FAMILIES[self.family].title


def resolve_mask_token(raw: dict[str, Any]) -> Resolved:
    """vLLM's DFlash model reads `dflash_config.get("mask_token_id", ...)`: a null there wins (and fails)."""
    dflash = _dict(raw.get("dflash_config"))
    if MASK_TOKEN_KEYS[0] in dflash and dflash[MASK_TOKEN_KEYS[0]] is None:
        return Resolved(None, f"dflash_config.{MASK_TOKEN_KEYS[0]}")
    candidates = [(f"dflash_config.{MASK_TOKEN_KEYS[0]}", dflash)] + [(key, raw) for key in MASK_TOKEN_KEYS]
    return _first(*candidates)


def resolve_layer_attention(view: dict[str, Any]) -> tuple[LayerAttention, ...] | None:
    """Each draft layer's window and causality as vLLM resolves them (qwen3_dflash.py `_resolve_layer_attention`,
    `_dflash_layer_causal`): sliding layers are the `sliding_attention` entries of layer_types, or every layer with
    dflash_config.use_swa when layer_types is absent or names none; their window is dflash_config.swa_window_size
    when that key is present, else sliding_window; a layer is causal as is_causal says, else dflash_config.causal,
    else exactly when layer_types names it sliding_attention. None when vLLM could not build the layers: layer_types
    not one known entry per layer, or a sliding layer without a positive integer window."""
    layers, types = view.get("num_hidden_layers"), view.get("layer_types")
    if _int(layers) is None or layers <= 0:
        return None
    if types is not None and not (isinstance(types, list) and len(types) == layers
                                  and all(t in LAYER_TYPES for t in types)):
        return None
    dflash = _dict(view.get("dflash_config"))
    named = [t == "sliding_attention" for t in types] if types is not None else [False] * layers
    sliding = named if any(named) else [bool(dflash.get("use_swa"))] * layers
    window = dflash.get("swa_window_size", view.get("sliding_window"))
    if any(sliding) and not (_int(window) and window > 0):
        return None
    causal = view.get("is_causal")
    causal = dflash.get("causal") if causal is None else causal
    return tuple(LayerAttention(window if slides else None, typed if causal is None else bool(causal))
                 for slides, typed in zip(sliding, named))


def resolve_block_size(raw: dict[str, Any]) -> Resolved:
    dflash = _dict(raw.get("dflash_config"))
    return _first(("block_size", raw), ("dflash_config.block_size", dflash), ("dspark_block_size", raw))


def detect_format(raw: dict[str, Any]) -> str:
    """Which layout a config.json is in (docs/formats-other.md §5); a key of formats.FORMAT_NAMES."""
    speculators = raw.get("speculators_model_type")
    if speculators in ("dspark", "dflash"):
        return f"speculators-{speculators}"
    archs = [a for a in _list(raw.get("architectures")) if isinstance(a, str)]
    model_type = raw.get("model_type") if isinstance(raw.get("model_type"), str) else None
    if "Qwen3DSparkModel" in archs:
        return "deepspec"
    if "Gemma4DSparkModel" in archs:
        return "deepspec-gemma4"
    if "DSparkV41DraftModel" in archs or ("DSparkDraftModel" in archs and model_type in DEEPSEEK_V4_MODEL_TYPES):
        return "deepseek-v4"
    if "DSparkDraftModel" in archs:
        return "specforge"
    if "DFlash2DraftModel" in archs:
        return "dflash2"
    if any(a in DFLASH_ARCHITECTURES or "DFlash" in a for a in archs):
        return "dflash"
    if any(a in OTHER_DSPARK_FAMILIES for a in archs):
        return "other-dspark"
    return "unknown"


def vllm_view(raw: dict[str, Any], fmt: str | None = None) -> dict[str, Any]:
    """The config as vLLM reads it: speculators configs flattened by its adapter, DSparkDraftModel (qwen3) renamed."""
    fmt = fmt or detect_format(raw)
    if fmt.startswith("speculators"):
        return _from_speculators(raw, fmt)
    if fmt == "specforge":
        return {**raw, "architectures": ["Qwen3DSparkModel"]}
    return raw


def _from_speculators(raw: dict[str, Any], fmt: str) -> dict[str, Any]:
    """vLLM's SpeculatorsConfig mapping (docs/formats-other.md §4): transformer_layer_config plus the draft fields."""
    view = dict(_dict(raw.get("transformer_layer_config")))
    dflash: dict[str, Any] = {}
    aux = raw.get("aux_hidden_state_layer_ids")
    if isinstance(aux, list):
        view["eagle_aux_hidden_state_layer_ids"] = aux  # capture ids = target_layer_ids + 1, used as-is
        if all(isinstance(v, int) and not isinstance(v, bool) for v in aux):
            dflash["target_layer_ids"] = [v - 1 for v in aux]
    if "mask_token_id" in raw:
        dflash["mask_token_id"] = raw["mask_token_id"]
    for key in ("draft_vocab_size", "target_hidden_size", "block_size"):
        if key in raw:
            view[key] = raw[key]
    if fmt == "speculators-dspark":
        view["architectures"] = ["Qwen3DSparkModel"]
        defaults = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                    "confidence_head_with_markov": True, "sample_from_anchor": True}
        view.update({key: raw.get(key, default) for key, default in defaults.items()})
        view["dspark_bonus_anchor"] = not view["sample_from_anchor"]
        for key in ("target_layer_ids", "mask_token_id"):
            if key in dflash:
                view[key] = dflash[key]
    else:
        view["architectures"] = ["DFlashDraftModel"]
        view["sample_from_anchor"] = bool(raw.get("sample_from_anchor", False))
    view["dflash_config"] = dflash
    return view


def _nested_only(view: dict[str, Any], dflash: dict[str, Any]) -> dict[str, Any]:
    return {key: dflash[key] for key in SPECFORGE_HOISTED_KEYS if key not in view and key in dflash}


def resolve_target_layer_ids(raw: dict[str, Any]) -> Resolved:
    """0-based target layer ids in vLLM's aux-id order; keys that hold capture ids (id + 1) are shifted back."""
    dflash = _dict(raw.get("dflash_config"))
    eagle = _dict(raw.get("eagle_config"))
    candidates = [
        ("eagle_aux_hidden_state_layer_ids", raw, -1),
        ("dflash_config.target_layer_ids", dflash, 0),
        ("dspark_target_layer_ids", raw, 0),
        ("target_layer_ids", raw, 0),
        ("dflash_config.layer_ids", dflash, -1),
        ("eagle_config.layer_ids", eagle, -1),
    ]
    for source, table, shift in candidates:
        key = source.rsplit(".", 1)[-1]
        if key in table:
            value = table[key]
            if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return Resolved([v + shift for v in value], source)
            return Resolved(None, source)  # present but malformed: rules report it
    return Resolved(None, None)


def _first(*candidates: tuple[str, dict]) -> Resolved:
    for source, table in candidates:
        key = source.rsplit(".", 1)[-1]
        if key in table and table[key] is not None:
            return Resolved(_int(table[key]), source)
    return Resolved(None, None)


def _architecture(raw: dict[str, Any]) -> str | None:
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return None


def _kind(fmt: str) -> str:
    if fmt in ("dflash", "dflash2", "speculators-dflash"):
        return "dflash"
    if fmt in ("deepspec", "deepspec-gemma4", "specforge", "speculators-dspark", "other-dspark"):
        return "dspark"
    return "unknown"


def _sample_from_anchor(raw: dict[str, Any], dflash: dict[str, Any]) -> bool:
    if "sample_from_anchor" in raw:
        return bool(raw["sample_from_anchor"])
    if "sample_from_anchor" in dflash:
        return bool(dflash["sample_from_anchor"])
    if raw.get("dspark_bonus_anchor"):
        return False
    return _architecture(raw) not in DFLASH_ARCHITECTURES  # z-lab DFlash uses the 1+N layout


def _rope_theta(raw: dict[str, Any]) -> float:
    params = _dict(raw.get("rope_parameters")) or _dict(raw.get("rope_scaling"))
    theta = raw.get("rope_theta", params.get("rope_theta"))
    return float(theta) if isinstance(theta, (int, float)) and not isinstance(theta, bool) else 1e6


def _or_default(value: Any, default: Any) -> Any:
    """vLLM replaces a missing or null draft_vocab_size / target_hidden_size by its default."""
    return default if value is None else value


def _number(value: Any, default: float) -> float:
    """Any real number as given (vLLM uses logit_scale as is), else `default`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return float(value)
    return default


def _float(value: Any, default: float) -> float:
    """A positive number, else `default` (rules report malformed values)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return default


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
