"""The stateful target families dspark drafts for, torch-free (serve and the pre-load checks read it).

model/target_state.py does the rollback; docs/stateful.md has the family x command matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_cli.runtime.checkpoint.target_config import TargetConfig


@dataclass(frozen=True)
class Family:
    """A stateful target family dspark rolls back exactly (each is checked by tests/model/test_stateful_targets.py)."""

    name: str  # for people: "Qwen3.5", "Mamba2", ...
    mixer: str  # the decoder-layer attribute holding the stateful mixer (its forward takes the cache)
    block_scoring: bool = True  # False: the target scores drafted tokens one at a time (see the module doc)
    only_layer_type: str | None = None  # the mixer attribute is stateful only on layers of this layer_types entry


# By the text config's model_type.
FAMILIES: dict[str, Family] = {
    "qwen3_5_text": Family("Qwen3.5", "linear_attn"),
    "qwen3_5_moe_text": Family("Qwen3.5-MoE", "linear_attn"),
    "qwen3_next": Family("Qwen3-Next", "linear_attn"),
    "falcon_h1": Family("Falcon-H1", "mamba"),
    "jamba": Family("Jamba", "mamba", block_scoring=False),
    "bamba": Family("Bamba", "mamba"),
    "granitemoehybrid": Family("Granite-4 hybrid", "mamba"),
    "lfm2": Family("LFM2", "conv"),
    "lfm2_moe": Family("LFM2-MoE", "conv"),
    "mamba2": Family("Mamba2", "mixer"),
    "minimax": Family("MiniMax", "self_attn", only_layer_type="linear_attention"),
}




def supported_names() -> str:
    return ", ".join(family.name for family in FAMILIES.values())


def family_of_config_dict(config: dict) -> Family | None:
    """The Family of a target's config.json (a dict; a multimodal config by its text_config), None otherwise."""
    model_type = TargetConfig.from_dict(config).model_type
    if model_type in ("qwen3_5", "qwen3_5_moe"):  # AutoModelForCausalLM loads their text model
        model_type += "_text"
    return FAMILIES.get(model_type)


def one_at_a_time_warning(family: Family) -> str:
    return (f"{family.name} targets score drafted tokens one forward at a time (transformers' {family.name} layers "
            "cannot continue a cached sequence with several tokens at once): the output is exact, but speculation "
            "cannot be faster than plain decoding on this target.")
