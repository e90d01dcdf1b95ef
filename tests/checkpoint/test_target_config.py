"""TargetConfig: one typed view of a target's config.json, its text config read by one rule."""

from __future__ import annotations

import pytest

from dspark_cli.runtime.checkpoint.stateful import family_of_config_dict
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.pair import context_limit

TEXT = {"model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
        "max_position_embeddings": 4096}


def test_a_multimodal_config_reads_its_text_config():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": TEXT,
           "vision_config": {"hidden_size": 32}}
    target = TargetConfig.from_dict(raw)
    assert target.raw is raw and target.text is TEXT
    assert (target.model_type, target.outer_model_type) == ("qwen3_5_text", "qwen3_5")
    assert (target.vocab_size, target.hidden_size, target.num_hidden_layers) == (512, 64, 4)
    assert target.max_position_embeddings == 4096 and context_limit(raw) == 4096
    assert target.architectures == ("Qwen3_5ForConditionalGeneration",)
    assert family_of_config_dict(raw).name == "Qwen3.5"


def test_a_plain_config_is_its_own_text_config():
    raw = {"architectures": ["Qwen3ForCausalLM", 7], "model_type": "qwen3", "vocab_size": 300, "hidden_size": 32,
           "num_hidden_layers": 2}
    target = TargetConfig.from_dict(raw)
    assert target.text is raw and target.model_type == target.outer_model_type == "qwen3"
    assert (target.vocab_size, target.hidden_size, target.num_hidden_layers) == (300, 32, 2)
    assert target.architectures == ("Qwen3ForCausalLM",)  # non-strings dropped
    assert target.max_position_embeddings is None and family_of_config_dict(raw) is None


def test_a_top_level_vocab_size_does_not_hide_text_config():
    """The one rule is transformers' get_text_config: text_config wins whenever it is an object."""
    target = TargetConfig.from_dict({"model_type": "paligemma", "vocab_size": 9, "text_config": TEXT})
    assert target.vocab_size == 512
    assert TargetConfig.from_dict({"vocab_size": 9, "text_config": "not an object"}).vocab_size == 9


def test_a_gemma4_target_keeps_its_outer_model_type():
    raw = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
           "text_config": {"model_type": "gemma4_text", "vocab_size": 262144}}
    target = TargetConfig.from_dict(raw)
    assert (target.model_type, target.outer_model_type) == ("gemma4_text", "gemma4")
    text_only = TargetConfig.from_dict(raw["text_config"])
    assert text_only.model_type == text_only.outer_model_type == "gemma4_text"


@pytest.mark.parametrize("value", [True, False, 0, -1, 2.5, "4096", None])
def test_max_position_embeddings_is_a_positive_int_or_none(value):
    for raw in ({"max_position_embeddings": value}, {"text_config": {"max_position_embeddings": value}}):
        assert TargetConfig.from_dict(raw).max_position_embeddings is None
        assert context_limit(raw) is None


def test_non_string_model_types_and_sizes_read_as_none():
    target = TargetConfig.from_dict({"model_type": ["x"], "vocab_size": True, "hidden_size": -4, "architectures": "A"})
    assert (target.model_type, target.outer_model_type, target.vocab_size, target.hidden_size) == (None,) * 4
    assert target.architectures == () and family_of_config_dict(target.raw) is None
