"""The registry of draft families: one torch-free module per family says what its config.json and tensors look like.

A family module (qwen3.py, gemma4.py, dflash2.py) defines one `Family`: the architectures that select it, how its config keys
resolve onto DraftConfig's fields (`resolve`), the tensors of one decoder layer (`layer_tensors`) and
those it has once per model (`model_tensors`), the Linear layers
vLLM builds from them (`layer_linears`), whether vLLM shares embed_tokens / lm_head from the target, its own
validate rules, and for `dspark train` the targets it is the default draft for and how a new draft's config.json is
built from the target's (`draft_config`). The forward pass of the same family is `runtime/model/families/<name>.py`,
registered under the same name (docs/architecture.md "Adding a draft family"). Nothing here imports torch, so
`dspark validate` stays light.

A family is found one way from each side: from a draft's config by its architectures (`family_for`), from a target's
config by its text model_type (`family_for_target`, train's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dspark_cli.runtime.checkpoint.target_config import TargetConfig

# A layer tensor as the schema lists it: (name under layers.{i}., shape, shape formula for messages).
LayerTensor = tuple[str, tuple[int | None, ...], str]


@dataclass(frozen=True)
class Family:
    name: str  # "qwen3", "gemma4": the key of FAMILIES and of runtime.model.families.BACKBONES
    architectures: tuple[str, ...]  # config.json architectures that select this family
    title: str  # for messages: "Qwen3", "Gemma-4"
    resolve: Callable[[dict[str, Any]], dict[str, Any]]  # config view -> DraftConfig field values
    layer_tensors: Callable[[Any], list[LayerTensor]]  # DraftConfig -> tensors of one decoder layer
    layer_linears: Callable[[Any, str], list[tuple[str, tuple[str, ...]]]]  # (config, "layers.i.") -> (vLLM
    # module prefix, on-disk weights) of that layer's Linear modules
    vllm_shares_embeddings: bool  # vLLM shares a missing embed_tokens / lm_head from the target
    draft_config: Callable[..., dict[str, Any]]  # (TargetConfig, train's DraftShape, target layer ids, MaskChoice,
    # anchors) -> a new draft's config.json (DeepSpec's build_draft_config of the family)
    rules: tuple[Callable[[Any], list], ...] = ()  # validate rules of this family: (RuleContext) -> Results
    optional_layer_tensors: tuple[LayerTensor, ...] = ()  # per-layer tensors that default when absent
    target_model_types: tuple[str, ...] = ()  # targets' (text) model_types it is the default draft family for
    needs_target: str | None = None  # for messages, the targets it drafts for alone (those of target_model_types);
    # None: it drafts for any target
    model_tensors: Callable[[Any], list[LayerTensor]] = lambda config: []  # DraftConfig -> once-per-model tensors
    # of the family beside the shared ones (DFlash2's selector)

    def drafts_for(self, target: TargetConfig) -> bool:
        """Whether a draft of this family can be built for `target`."""
        return self.needs_target is None or target.model_type in self.target_model_types


def _registry() -> dict[str, Family]:
    from dspark_cli.runtime.checkpoint.families import dflash2, gemma4, qwen3

    return {family.name: family for family in (qwen3.FAMILY, gemma4.FAMILY, dflash2.FAMILY)}


FAMILIES: dict[str, Family] = _registry()
DEFAULT = "qwen3"  # DeepSpec's Qwen3 layout: every draft and every target no other family claims


def family_for(architectures: list[Any]) -> Family:
    """The family an architectures list selects; Qwen3 (DeepSpec's Qwen3 layout) for every other DSpark/DFlash draft."""
    for family in FAMILIES.values():
        if any(arch in family.architectures for arch in architectures):
            return family
    return FAMILIES[DEFAULT]


def family_for_target(target: TargetConfig) -> Family:
    """The default draft family for a target: the one listing its model_type (a Gemma-4 target's:
    Gemma-4, as DeepSpec's Gemma4DSparkTrainer), else Qwen3."""
    for family in FAMILIES.values():
        if target.model_type in family.target_model_types:
            return family
    return FAMILIES[DEFAULT]
