"""A new draft for a target: its geometry (DraftShape), mask token, config.json and weights shared with the target.

The layout follows DeepSpec: the target's (text) config with the draft fields overridden, as the draft family's
`draft_config` builds it (checkpoint/families/: Qwen3, or Gemma-4 for a Gemma-4 target, as DeepSpec's
qwen3/config.py and gemma4/config.py build_draft_config do); the draft shares frozen copies of the target's embedding
and lm_head unless asked to train its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.families import FAMILIES, Family, family_for_target
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.model.draft import DSparkDraft
from dspark_cli.runtime.model.draft_io import tie_to_target


@dataclass(frozen=True)
class DraftShape:
    """Geometry of a new draft; the backbone width, heads and MLP are copied from the target."""

    layers: int = 1
    block_size: int = 7
    target_layers: tuple[int, ...] | None = None  # None: evenly spaced (default_target_layers)
    markov_rank: int = 256  # 0: a DFlash draft
    confidence: bool = True
    confidence_with_markov: bool = True
    mask_token_id: int | None = None  # None: the tokenizer's mask token, else a free or an added id
    train_embeddings: bool = False  # False: a frozen copy of the target's embedding (DeepSpec)
    train_lm_head: bool = False  # False: a frozen copy of the target's lm_head (DeepSpec)
    arch: str | None = None  # draft family: a key of checkpoint.families.FAMILIES; None: the target's (draft_family)
    markov_head_type: str = "vanilla"  # vanilla | gated | rnn (DeepSpec's markov_head_type)


@dataclass
class MaskChoice:
    token_id: int
    vocab_size: int  # draft input vocabulary (target rows, + 1 when the mask token was added)
    note: str



def default_target_layers(num_target_layers: int, count: int) -> list[int]:
    """Evenly spaced target layers as DeepSpec / z-lab choose them (1 .. L-3; one draft layer: the middle one).

    Small targets (under 6 layers) use 0 .. L-2; the last layer is never used (HF's last hidden state is
    post-norm). Duplicates after rounding are dropped.
    """
    if num_target_layers < 2:
        raise DsparkError(f"the target has {num_target_layers} layer(s); a draft needs a target with at least 2.")
    if count == 1:
        return [num_target_layers // 2 - (1 if num_target_layers <= 2 else 0)]
    start, end = (1, num_target_layers - 3) if num_target_layers >= 6 else (0, num_target_layers - 2)
    if count > end - start:  # every layer in range (and no loop over a huge count)
        return list(range(start, end + 1))
    ids = {round(start + i * (end - start) / (count - 1)) for i in range(count)}
    return sorted(ids)


def choose_mask_token(tokenizer, embedding_rows: int, requested: int | None) -> MaskChoice:
    """The draft's mask token: as requested, the tokenizer's mask token, a free embedding row, or one added."""
    if requested is not None:
        if not 0 <= requested <= embedding_rows:
            raise DsparkError(f"the mask-token-id option {requested} is outside the target's vocabulary "
                              f"(0..{embedding_rows - 1}, or {embedding_rows} to add one).")
        if requested == embedding_rows:
            return MaskChoice(requested, embedding_rows + 1, f"mask token {requested} added to the vocabulary")
        return MaskChoice(requested, embedding_rows, f"mask token {requested} (as requested)")
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        mask_id = tokenizer.convert_tokens_to_ids("<|mask|>") if "<|mask|>" in tokenizer.get_vocab() else None
    if mask_id is not None and mask_id < embedding_rows:
        return MaskChoice(mask_id, embedding_rows, f"mask token {mask_id} (the tokenizer's mask token)")
    if len(tokenizer) < embedding_rows:
        return MaskChoice(len(tokenizer), embedding_rows,
                          f"mask token {len(tokenizer)} (the first embedding row the tokenizer never produces)")
    return MaskChoice(embedding_rows, embedding_rows + 1,
                      f"the tokenizer has no free id: mask token {embedding_rows} added to the draft's vocabulary "
                      "(the draft ships its own embed_tokens with one extra row)")


def draft_family(target: TargetConfig, requested: str | None) -> Family:
    """The draft family for a target: as requested, else the registry's default for it (`family_for_target`: the
    target's own family, e.g. Gemma-4 for a Gemma-4 target, else Qwen3). A family that drafts only for its own
    targets refuses the others."""
    family = FAMILIES.get(requested) if requested else family_for_target(target)
    if family is None:
        raise DsparkError(f"the draft-arch option {requested!r} is not a draft family; choose auto, "
                          f"{', '.join(FAMILIES)}.")
    if not family.drafts_for(target):
        raise DsparkError(f"the draft-arch option {family.name} needs {family.needs_target}; this target's "
                          f"model_type is {target.model_type!r}.")
    return family


def draft_config_dict(target_config: dict, shape: DraftShape, target_layers: list[int], mask: MaskChoice,
                      anchors: int) -> dict:
    """DeepSpec's layout: the target's config (its config.json as a dict) with the draft fields overridden, as the
    draft's family builds it."""
    target = TargetConfig.from_dict(target_config)
    return draft_family(target, shape.arch).draft_config(target, shape, target_layers, mask, anchors)


def new_draft(target, tokenizer, shape: DraftShape, anchors: int) -> tuple[DSparkDraft, MaskChoice]:
    """A freshly initialised draft for `target`, sharing (frozen) its embedding and lm_head."""
    config, mask = new_draft_config(target.config.to_dict(), tokenizer, shape, anchors)
    draft = build_draft(config, target)
    train_shared_weights(draft, shape)
    return draft, mask


def new_draft_config(target_config: dict, tokenizer, shape: DraftShape, anchors: int) -> tuple[dict, MaskChoice]:
    """The config.json of a new draft for a target (its config.json as a dict) and the mask token chosen."""
    target = TargetConfig.from_dict(target_config)
    layers = draft_target_layers(target, shape)
    mask = choose_mask_token(tokenizer, target.vocab_size, shape.mask_token_id)
    return draft_config_dict(target_config, shape, layers, mask, anchors), mask


def draft_target_layers(target: TargetConfig, shape: DraftShape) -> list[int]:
    """The target layers feeding a new draft: as the shape asks, else evenly spaced; checked against the target."""
    num_layers = target.num_hidden_layers
    layers = list(shape.target_layers) if shape.target_layers else default_target_layers(num_layers, shape.layers)
    if layers != sorted(set(layers)) or layers[0] < -1 or layers[-1] > num_layers - 2:
        raise DsparkError(f"the target-layers option {layers} must be strictly increasing ids in "
                          f"-1..{num_layers - 2} (the target has {num_layers} layers; its last layer's output is "
                          "post-norm and unusable).")
    return layers


def build_draft(config: dict, target) -> DSparkDraft:
    """A draft for this config whose embedding and lm_head are the target's, frozen (plus a trainable mask row
    when the config's vocabulary has one row more than the target's)."""
    embed = target.get_input_embeddings().weight.detach().float()
    lm_head = target.get_output_embeddings().weight.detach().float()
    draft = DSparkDraft(DraftConfig.from_dict(config))
    if draft.config.vocab_size == embed.shape[0]:
        tie_to_target(draft, embed, lm_head)
    else:
        tie_to_target(draft, None, lm_head)
        _extend_embedding(draft, embed)
    return draft


def _extend_embedding(draft: DSparkDraft, target_embed: torch.Tensor) -> None:
    """Own embedding = the target's rows (frozen) + one trainable mask row, initialised to their mean."""
    weight = torch.cat([target_embed, target_embed.mean(0, keepdim=True)])  # [V+1, H]
    draft.embed_tokens.weight = torch.nn.Parameter(weight)
    trainable_row = torch.zeros(weight.shape[0], 1)
    trainable_row[-1] = 1.0
    draft.embed_tokens.weight.register_hook(lambda grad: grad * trainable_row.to(grad))


def train_shared_weights(draft: DSparkDraft, shape: DraftShape) -> None:
    """Give the draft its own trainable copies of the target's embedding / lm_head when the shape asks for them
    (cloned: the frozen target keeps its weights; a trained embedding trains every row, an added mask row too)."""
    if shape.train_embeddings:
        draft.embed_tokens.weight = torch.nn.Parameter(draft.embed_tokens.weight.detach().clone())
        draft.shares_embed = False
    if shape.train_lm_head:
        draft.lm_head.weight = torch.nn.Parameter(draft.lm_head.weight.detach().clone())
        draft.shares_lm_head = False


def trainable_parameters(draft: DSparkDraft) -> list[torch.nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]
