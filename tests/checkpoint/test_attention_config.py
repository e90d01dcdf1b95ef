"""How each draft layer attends, resolved from config.json as vLLM's qwen3_dflash.py `_resolve_layer_attention` and
`_dflash_layer_causal` resolve it (docs/format.md §2.3): one row per case of that function's table and of its
fallbacks, each written as the (window, causal) pairs vLLM builds."""

import pytest
from ckpt_factory import DraftSpec, draft_config

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig, LayerAttention

SLIDING, FULL = "sliding_attention", "full_attention"


def resolved(**changes) -> list[tuple[int | None, bool]] | None:
    """A 3-layer draft's config with `changes` (None deletes a key) -> [(window, causal)] per layer, or None."""
    config = {**draft_config(DraftSpec(num_hidden_layers=3)), **changes}
    config = {key: value for key, value in config.items() if value is not None}
    rules = DraftConfig.from_dict(config).layer_attention
    return None if rules is None else [(rule.window, rule.causal) for rule in rules]


CASES = {
    "DeepSpec: every layer full": ({}, [(None, False)] * 3),
    "sliding entries, causal by default": ({"layer_types": [SLIDING, FULL, SLIDING], "sliding_window": 8},
                                           [(8, True), (None, False), (8, True)]),
    "swa_window_size wins over sliding_window": (
        {"layer_types": [SLIDING, FULL, FULL], "sliding_window": 8, "dflash_config": {"swa_window_size": 5}},
        [(5, True), (None, False), (None, False)]),
    "use_swa without layer_types: every layer, non-causal (MiMo)": (
        {"layer_types": None, "dflash_config": {"use_swa": True, "swa_window_size": 6}}, [(6, False)] * 3),
    "use_swa over an all-full layer_types: every layer, non-causal": (
        {"dflash_config": {"use_swa": True, "swa_window_size": 6}}, [(6, False)] * 3),
    "use_swa with a sliding entry: that entry only": (
        {"layer_types": [FULL, SLIDING, FULL], "dflash_config": {"use_swa": True, "swa_window_size": 6}},
        [(None, False), (6, True), (None, False)]),
    "dflash_config.causal false: sliding but non-causal": (
        {"layer_types": [SLIDING, FULL, FULL], "sliding_window": 4, "dflash_config": {"causal": False}},
        [(4, False), (None, False), (None, False)]),
    "dflash_config.causal true: every layer causal": ({"dflash_config": {"causal": True}}, [(None, True)] * 3),
    "is_causal wins over dflash_config.causal": (
        {"is_causal": False, "layer_types": [SLIDING] * 3, "sliding_window": 4, "dflash_config": {"causal": True}},
        [(4, False)] * 3),
    "use_sliding_window alone adds no sliding layer (DSP048)": ({"use_sliding_window": True, "sliding_window": 4},
                                                                [(None, False)] * 3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_layer_attends_as_vllm_resolves_it(name):
    changes, expected = CASES[name]
    assert resolved(**changes) == expected


@pytest.mark.parametrize("changes", [
    {"layer_types": [SLIDING, FULL, FULL], "sliding_window": None},  # DSP028: no window
    {"layer_types": [SLIDING, FULL, FULL], "sliding_window": 0},
    {"layer_types": [SLIDING, FULL, FULL], "sliding_window": 8, "dflash_config": {"swa_window_size": None}},
    {"layer_types": [SLIDING, FULL]},  # DSP035: not one entry per layer
    {"layer_types": ["chunked_attention"] * 3},
])
def test_a_draft_vllm_cannot_build_is_refused_before_its_weights(changes):
    assert resolved(**changes) is None
    config = {key: value for key, value in {**draft_config(DraftSpec(num_hidden_layers=3)), **changes}.items()
              if value is not None}
    with pytest.raises(DsparkError, match="how every draft layer attends"):
        DraftConfig.from_dict(config).require_runnable("draft")


def test_only_a_layer_without_window_and_causality_is_dense():
    assert LayerAttention(None, False).dense
    assert not LayerAttention(None, True).dense and not LayerAttention(4, False).dense
