"""The facts every rule reads, computed once before any rule runs.

A rule is a pure function of a `RuleContext`. Facts that several rules share, or that one rule's outcome used to
hand to later rules (the trusted layer count, the NVFP4 weights, the quantization config vLLM would use, the
algorithm it gives markov_w2), are fields here, so no rule depends on another having run first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Mapping

from dspark_cli.runtime.checkpoint.read import Checkpoint, CheckpointError, TensorInfo
from dspark_cli.runtime.checkpoint.config import GEOMETRY_KEYS, DraftConfig
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.checkpoint.layout import (
    MARKOV_W2,
    ExpectedTensor,
    LinearModule,
    canonical_name,
    expected_draft_tensors,
    linear_modules,
)
from dspark_cli.runtime.checkpoint.rules.quant_config import QuantConfig, claimed_algo, config_json_quant, legacy_quant
from dspark_cli.runtime.checkpoint.rules.values import positive_int

MAX_DRAFT_LAYERS = 256  # DeepSpec drafts have 5; a larger count is a corrupt config, not a draft
NOT_DRAFTS = ("unknown", "deepseek-v4")  # formats whose config, tensor and NVFP4 rules are skipped (DSP001)
_DERIVED_GEOMETRY = {"num_key_value_heads", "head_dim", "target_hidden_size", "draft_vocab_size"}  # have defaults


@dataclass(frozen=True)
class RuleContext:
    """A checkpoint as the rules see it. Rules only read it; `build_context` is the one place that computes it."""

    ckpt: Checkpoint
    config: DraftConfig  # config.json as vLLM resolves it
    target: TargetConfig | None  # the --target model's config
    deep: bool
    on_disk: Mapping[str, TensorInfo]  # on-disk name -> info (a name in two shards: the later shard's)
    tensors: Mapping[str, TensorInfo]  # canonical name (vLLM's renames applied) -> info
    is_draft: bool  # a DSpark or DFlash draft: the config, vocabulary, tensor and NVFP4 rules apply
    geometry_ok: bool  # a draft whose tensor shapes follow from its config (no DSP010, a head_dim)
    modules: tuple[LinearModule, ...]  # the Linear layers vLLM builds; per-layer ones only when geometry_ok
    expected: Mapping[str, ExpectedTensor]  # the tensors the config implies; empty unless geometry_ok
    nvfp4_weights: frozenset[str]  # Linear weights stored as NVFP4 (uint8)
    fp8_weights: frozenset[str]  # Linear weights stored as FP8 (float8_e4m3fn)
    json_quant: QuantConfig | None  # config.json's quantization_config, parsed
    legacy_quant: QuantConfig | None  # hf_quant_config.json, parsed
    quant: QuantConfig | None  # the config vLLM would use, when it can parse it and it is ModelOpt's
    head_claim: str | None  # the algorithm vLLM gives markov_w2 when it is stored as NVFP4

    @property
    def quant_read(self) -> QuantConfig | None:
        """The config vLLM reads (config.json's first), usable or not."""
        return self.json_quant or self.legacy_quant

    @property
    def foreign_quant(self) -> bool:
        """config.json names a quantizer other than ModelOpt (DSP313; its config is not checked)."""
        return _foreign(self.json_quant)

    @property
    def target_vocab(self) -> int | None:
        return self.target.vocab_size if self.target else self.config.vocab_size

    @property
    def target_depth(self) -> tuple[int | None, str | None]:
        """The target's layer count and where it comes from."""
        if self.target:
            return self.target.num_hidden_layers, "num_hidden_layers of the target option"
        if self.config.num_target_layers:
            return self.config.num_target_layers, "the draft's num_target_layers"
        return None, None

    @property
    def has_embed(self) -> bool:
        return any("embed_tokens" in name for name in self.tensors)

    @property
    def has_lm_head(self) -> bool:
        return any(name.startswith("lm_head") for name in self.tensors)


def build_context(ckpt: Checkpoint, target: TargetConfig | None, deep: bool) -> RuleContext:
    """Every fact the rules share, from what `open_checkpoint` parsed (no tensor data is read)."""
    config = DraftConfig.from_dict(ckpt.config)
    on_disk = ckpt.tensors
    tensors = {canonical_name(name): info for name, info in on_disk.items()}
    is_draft = config.format not in NOT_DRAFTS
    geometry_ok = is_draft and _geometry_ok(config)
    # Per-layer rules need a trustworthy layer count: without one, only the heads and fc are looked at.
    modules = tuple(linear_modules(config if geometry_ok else replace(config, num_hidden_layers=0))) if is_draft else ()
    nvfp4 = frozenset(name for m in modules for name in m.weights if name in tensors and tensors[name].dtype == "U8")
    fp8 = frozenset(name for m in modules for name in m.weights
                    if name in tensors and tensors[name].dtype == "F8_E4M3")
    raw_json = ckpt.config.get("quantization_config")
    json_quant = config_json_quant(raw_json) if raw_json is not None else None
    legacy = legacy_quant(ckpt.hf_quant_config) if ckpt.hf_quant_config is not None else None
    quant = _usable(json_quant, legacy)
    head = next((m for m in modules if m.weights == (MARKOV_W2,)), None)
    head_claim = claimed_algo(head, quant) if head and quant and MARKOV_W2 in nvfp4 else None
    return RuleContext(
        ckpt=ckpt, config=config, target=target, deep=deep,
        on_disk=MappingProxyType(on_disk), tensors=MappingProxyType(tensors),
        is_draft=is_draft, geometry_ok=geometry_ok, modules=modules,
        expected=MappingProxyType(expected_draft_tensors(config) if geometry_ok else {}),
        nvfp4_weights=nvfp4, fp8_weights=fp8, json_quant=json_quant, legacy_quant=legacy, quant=quant, head_claim=head_claim,
    )


def read_target(raw: dict | None) -> TargetConfig | None:
    """The --target config.json, which must give the vocabulary, width and depth (else DSP512, exit 2)."""
    if raw is None:
        return None
    target = TargetConfig.from_dict(raw)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if getattr(target, k) is None]
    if missing:
        raise CheckpointError(
            "DSP512", f"the config of the target option has no positive {', '.join(missing)}; pass the target causal LM's folder."
        )
    return target


def bad_geometry_keys(config: DraftConfig) -> list[str]:
    """Geometry keys vLLM needs that are missing (and have no default) or are not positive integers."""
    view = config.vllm_config
    keys = (*GEOMETRY_KEYS, "target_hidden_size", "draft_vocab_size")
    return [k for k in keys if not (positive_int(view.get(k)) or (view.get(k) is None and k in _DERIVED_GEOMETRY))]


def too_many_layers(config: DraftConfig) -> bool:
    return bool(config.num_hidden_layers and config.num_hidden_layers > MAX_DRAFT_LAYERS)


def _geometry_ok(config: DraftConfig) -> bool:
    return not bad_geometry_keys(config) and not too_many_layers(config) and config.head_dim is not None


def _usable(json_quant: QuantConfig | None, legacy: QuantConfig | None) -> QuantConfig | None:
    """The config vLLM reads (config.json's first) when it parses and is ModelOpt's; else None."""
    used = json_quant or legacy
    return used if used is not None and not used.problems and not _foreign(json_quant) else None


def _foreign(json_quant: QuantConfig | None) -> bool:
    method = json_quant.method if json_quant else None
    return bool(method) and not method.startswith("modelopt")
