import json
import struct

import pytest
import torch
from ckpt_factory import DraftSpec, draft_tensors, write_draft

from dspark_cli.runtime.checkpoint import CheckpointError, open_checkpoint
from dspark_cli.runtime.config import DraftConfig


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
