import json
import struct

import pytest
import torch
from ckpt_factory import DraftSpec, draft_config, draft_tensors, speculators_config, specforge_config, write_draft

from dspark_cli.runtime.checkpoint import CheckpointError, open_checkpoint, read_target_config
from dspark_cli.runtime.config import DraftConfig, TargetConfig, detect_format
from dspark_cli.runtime.layout import canonical_name, expected_draft_tensors, linear_modules, vllm_prefix


def test_single_file_checkpoint_reads_headers(draft_dir, spec):
    ckpt = open_checkpoint(draft_dir)
    expected = draft_tensors(spec)
    assert set(ckpt.tensors) == set(expected)
    info = ckpt.tensors["markov_head.markov_w2.weight"]
    assert info.dtype == "BF16" and info.shape == (spec.vd, spec.markov_rank)
    assert torch.equal(ckpt.load_tensor("fc.weight"), expected["fc.weight"])


def test_sharded_checkpoint_reads_every_shard(tmp_path, spec):
    ckpt = open_checkpoint(write_draft(tmp_path / "d", spec, shards=3))
    assert len(ckpt.shards) == 3 and ckpt.index is not None
    assert set(ckpt.tensors) == set(draft_tensors(spec))


def test_truncated_file_is_reported(draft_dir):
    weights = draft_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated") as error:
        open_checkpoint(draft_dir)
    assert error.value.code == "DSP506" and error.value.exit_code == 2


def test_header_that_is_not_json(draft_dir):
    weights = draft_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8] = ord("#")
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(draft_dir)


def test_overlapping_tensors(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    raw = json.dumps(header).encode()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(CheckpointError, match="overlap"):
        open_checkpoint(tmp_path)


def test_index_shard_outside_folder(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec, shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../evil.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(path)


def test_config_resolution_order():
    raw = {"architectures": ["Qwen3DSparkModel"], "mask_token_id": 5, "dflash_config": {"mask_token_id": 7},
           "target_layer_ids": [1, 3], "eagle_aux_hidden_state_layer_ids": [2, 9], "markov_rank": 16}
    config = DraftConfig.from_dict(raw)
    assert (config.mask_token.value, config.mask_token.source) == (7, "dflash_config.mask_token_id")
    assert config.layer_ids == [1, 8] and config.target_layer_ids.source == "eagle_aux_hidden_state_layer_ids"
    assert config.hidden_state_indices == [2, 9]
    del raw["eagle_aux_hidden_state_layer_ids"]
    assert DraftConfig.from_dict(raw).hidden_state_indices == [2, 4]


def test_dflash_config_is_recognised(tmp_path):
    path = write_draft(tmp_path / "d", DraftSpec(markov_rank=0, confidence=False))
    config = DraftConfig.from_dict(open_checkpoint(path).config)
    assert config.kind == "dflash" and config.markov_rank == 0 and config.mask_token_id == 250


def test_expected_layout_matches_deepspec_tensors():
    for spec in (DraftSpec(), DraftSpec(attention_bias=True, draft_vocab_size=128, target_hidden_size=32),
                 DraftSpec(confidence_with_markov=False), DraftSpec(markov_rank=0, confidence=False)):
        expected = expected_draft_tensors(DraftConfig.from_dict(draft_config(spec)))
        tensors = draft_tensors(spec)
        assert set(tensors) <= set(expected)
        assert {n for n, e in expected.items() if e.required} <= set(tensors)
        for name, tensor in tensors.items():
            assert expected[name].matches(tuple(tensor.shape)), name


def test_vllm_prefixes_of_linear_layers():
    assert vllm_prefix("markov_head.markov_w2.weight") == "model.markov_head.markov_w2"
    assert vllm_prefix("lm_head.weight") == "lm_head"
    qkv = linear_modules(DraftConfig.from_dict(draft_config(DraftSpec())))[0]
    assert qkv.prefix == "model.layers.0.self_attn.qkv_proj"
    assert qkv.shard_prefixes == tuple(f"model.layers.0.self_attn.{x}_proj" for x in "qkv")


def test_canonical_names_drop_the_model_prefix_and_rename_dflash_aliases():
    assert canonical_name("model.layers.1.mlp.up_proj.weight") == "layers.1.mlp.up_proj.weight"
    assert canonical_name("midlayer.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert canonical_name("model.encoder.fc.weight") == "fc.weight"
    assert canonical_name("encoder.output_norm_enc.weight") == "hidden_norm.weight"
    assert canonical_name("d2t") == "d2t" and canonical_name("lm_head.weight") == "lm_head.weight"


def test_formats_are_recognised():
    spec = DraftSpec()
    assert detect_format(draft_config(spec)) == "deepspec"
    assert detect_format(draft_config(spec.with_(markov_rank=0))) == "dflash"
    assert detect_format(specforge_config(spec)) == "specforge"
    assert detect_format(speculators_config(spec)) == "speculators-dspark"
    assert detect_format({"architectures": ["DSparkDraftModel"], "model_type": "deepseek_v4"}) == "deepseek-v4"
    assert detect_format({"architectures": ["Qwen3ForCausalLM"]}) == "unknown"


def test_specforge_and_speculators_read_like_deepspec():
    spec = DraftSpec()
    plain = DraftConfig.from_dict(draft_config(spec))
    for raw in (specforge_config(spec), speculators_config(spec)):
        config = DraftConfig.from_dict(raw)
        assert config.kind == "dspark"
        for key in ("hidden_size", "num_hidden_layers", "vocab_size", "markov_rank", "mask_token_id", "layer_ids",
                    "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
            assert getattr(config, key) == getattr(plain, key), (raw.get("architectures"), key)
    assert DraftConfig.from_dict(specforge_config(spec)).nested_only == (
        "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def test_read_target_config_uses_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"],
                                                      "text_config": {"vocab_size": 512, "hidden_size": 64,
                                                                      "num_hidden_layers": 4}}))  # fmt: skip
    target = TargetConfig.from_dict(read_target_config(tmp_path))
    assert (target.vocab_size, target.hidden_size, target.num_hidden_layers) == (512, 64, 4)
    assert read_target_config(tmp_path / "config.json") == read_target_config(tmp_path)


def test_hf_quant_config_is_read_with_the_headers(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec)
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "MIXED_PRECISION"}}))
    assert open_checkpoint(path).hf_quant_config == {"quantization": {"quant_algo": "MIXED_PRECISION"}}


def test_gap_or_trailing_bytes_in_data_are_refused(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    raw = json.dumps(header).encode()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(CheckpointError, match="after its last tensor") as error:
        open_checkpoint(tmp_path)
    assert error.value.code == "DSP513"
