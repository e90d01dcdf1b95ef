"""The target's files checked before its weights are read (runtime/checkpoint/target_files.py)."""

import json

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.target_files import check_target_files

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}


def _target(tmp_path, **edits):
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, **edits}))
    return tmp_path


@pytest.mark.parametrize("built", [False, True], ids=["by-type", "transformers"])
def test_layer_types_must_match_the_depth_in_both_directions(tmp_path, built):
    """layer_types of exactly num_hidden_layers entries passes; shorter or longer is one sentence naming the file,
    without transformers (serve) as with it."""
    check_target_files(_target(tmp_path, layer_types=["full_attention"] * 4), config=built)
    for entries in (3, 5):
        with pytest.raises(DsparkError, match=r"config\.json .*cannot be built"):
            check_target_files(_target(tmp_path, layer_types=["full_attention"] * entries), config=built)
