import json
import struct

import pytest
import torch
from ckpt_factory import DraftSpec, draft_config, draft_tensors, speculators_config, specforge_config, write_draft

from dspark_cli.runtime.checkpoint.read import CheckpointError, open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.config import DraftConfig, detect_format
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.checkpoint.layout import canonical_name, expected_draft_tensors, linear_modules, vllm_prefix


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


def test_gemma4_drafts_default_their_rope_and_activation_like_transformers():
    """A Gemma-4 draft config without the full-attention RoPE entry takes Gemma4TextConfig's default (proportional,
    a quarter of the frequencies rotate, theta 1e6); its activation is `hidden_activation` (Gemma's key), never
    `hidden_act`."""
    raw = draft_config(DraftSpec(family="gemma4"))
    assert DraftConfig.from_dict(raw).rope_partial_factor == 0.25
    for rope in (None, {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}):
        edited = {k: v for k, v in raw.items() if k != "rope_parameters"}
        if rope is not None:
            edited["rope_parameters"] = rope
        config = DraftConfig.from_dict(edited)
        assert (config.rope_partial_factor, config.rope_theta) == (0.25, 1e6)
    plain = DraftConfig.from_dict({**raw, "rope_parameters": {"full_attention": {"rope_type": "default",
                                                                                 "rope_theta": 5e5}}})
    assert (plain.rope_partial_factor, plain.rope_theta) == (1.0, 5e5)
    assert DraftConfig.from_dict({**raw, "hidden_activation": "gelu", "hidden_act": "silu"}).hidden_act == "gelu"
    unnamed = {k: v for k, v in raw.items() if k != "hidden_activation"}
    assert DraftConfig.from_dict({**unnamed, "hidden_act": "silu"}).hidden_act == "gelu_pytorch_tanh"


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
                                                                      "num_hidden_layers": 4}}))
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


# --- which files a checkpoint has: relative paths only, regular files only (issue 10 §2, §3) ---------------------


def test_a_checkpoint_under_a_dot_cache_folder_lists_every_file(tmp_path, spec):
    path = write_draft(tmp_path / ".cache" / "models" / "draft", spec, shards=2)
    (path / "training_args.bin").write_bytes(b"pickle")
    ckpt = open_checkpoint(path)
    assert len(ckpt.shards) == 2 and "config.json" in ckpt.files and ckpt.pickle_files == ["training_args.bin"]


def test_weights_of_any_name_are_found_under_a_dot_cache_folder(tmp_path, spec):
    path = write_draft(tmp_path / ".cache" / "draft", spec)
    (path / "model.safetensors").rename(path / "weights.safetensors")
    assert list(open_checkpoint(path).shards) == ["weights.safetensors"]


def test_local_dir_metadata_and_git_folders_inside_the_checkpoint_are_skipped(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec)
    for folder in (".cache/huggingface/download", ".git/lfs"):
        (path / folder).mkdir(parents=True)
        (path / folder / "model.safetensors.metadata").write_text("x")
    (path / "sub" / ".cache").mkdir(parents=True)
    (path / "sub" / "notes.md").write_text("kept")
    (path / "sub" / ".cache" / "x").write_text("skipped")
    assert open_checkpoint(path).files == ["config.json", "model.safetensors", "sub/notes.md"]


def test_only_regular_files_inside_the_checkpoint_are_listed(tmp_path, spec):
    import os

    path = write_draft(tmp_path / "d", spec)
    outside = tmp_path / "secret.txt"
    outside.write_text("not part of the draft")
    (path / "README.md").write_text("readme")
    (path / "alias.md").symlink_to("README.md")  # inside: kept
    (path / "leak.md").symlink_to(outside)  # outside: dropped
    (path / "zero.bin").symlink_to("/dev/zero")
    (path / "dangling.md").symlink_to(tmp_path / "nowhere")
    (path / "loop.md").symlink_to(path / "loop.md")
    os.mkfifo(path / "pipe.json")
    (path / "linked_folder").symlink_to(tmp_path, target_is_directory=True)  # not entered
    assert open_checkpoint(path).files == ["README.md", "alias.md", "config.json", "model.safetensors"]


def test_hub_snapshot_links_must_point_into_their_own_repos_blobs(tmp_path, spec):
    repo = tmp_path / "hub" / "models--org--draft"
    snapshot = repo / "snapshots" / "abc"
    source = write_draft(tmp_path / "src", spec)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (source / name).rename(repo / "blobs" / name.upper())
        (snapshot / name).symlink_to(f"../../blobs/{name.upper()}")
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "NOTES").write_text("another repo's blob")
    (snapshot / "notes.md").symlink_to("../../../models--org--other/blobs/NOTES")
    assert open_checkpoint(snapshot).files == ["config.json", "model.safetensors"]


# --- hostile files: never block, bounded reads, one sentence (issue 10 §3) -----------------------------------------


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) if the test blocks for 10 s, e.g. on a FIFO."""
    import signal

    def hung(*_):
        raise TimeoutError("blocked for 10 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json",
                                  "hf_quant_config.json"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused(tmp_path, spec, no_hang, name, kind):
    import os
    import shutil

    path = write_draft(tmp_path / "d", spec)
    if name == "model.safetensors.index.json":
        (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    victim = path / name
    if victim.exists():
        victim.unlink()
    {"fifo": lambda: os.mkfifo(victim), "dev-zero": lambda: victim.symlink_to("/dev/zero"),
     "folder": lambda: victim.mkdir()}[kind]()
    with pytest.raises(CheckpointError, match="not a regular file|not one of the checkpoint's files") as error:
        open_checkpoint(path)
    assert error.value.code == "DSP501" and str(victim) in error.value.message
    shutil.rmtree(path)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_target_config_that_is_not_a_regular_file_is_refused(tmp_path, no_hang, kind):
    import os

    (tmp_path / "t").mkdir()
    config = tmp_path / "t" / "config.json"
    os.mkfifo(config) if kind == "fifo" else config.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_target_config(tmp_path / "t")


def test_a_json_file_over_the_size_cap_is_refused_unread(tmp_path, spec):
    from dspark_cli.runtime.checkpoint.read import MAX_JSON_BYTES

    path = write_draft(tmp_path / "d", spec)
    with open(path / "config.json", "r+b") as handle:
        handle.truncate(MAX_JSON_BYTES + 1)  # sparse: no disk used
    with pytest.raises(CheckpointError, match=f"{MAX_JSON_BYTES + 1} bytes, more than the {MAX_JSON_BYTES}-byte"):
        open_checkpoint(path)


def test_a_link_leading_outside_the_checkpoint_is_not_read(tmp_path, spec):
    path = write_draft(tmp_path / "d", spec)
    (path / "config.json").rename(tmp_path / "config.json")
    (path / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="not one of the checkpoint's files"):
        open_checkpoint(path)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("document", [_deep(100_000), _deep(101), '{"a": ' * 101 + "1" + "}" * 101],
                         ids=["200KB", "101-arrays", "101-objects"])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "hf_quant_config.json"])
def test_deeply_nested_json_is_one_sentence(tmp_path, spec, name, document):
    path = write_draft(tmp_path / "d", spec)
    (path / name).write_text(document)
    with pytest.raises(CheckpointError, match="more than 100 levels deep") as error:
        open_checkpoint(path)
    assert error.value.code == "DSP502"


def _raw_shard(path, header_bytes: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)


def test_deeply_nested_safetensors_header_is_one_sentence(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    _raw_shard(tmp_path / "model.safetensors", _deep(100_000).encode())
    with pytest.raises(CheckpointError, match="header nests JSON") as error:
        open_checkpoint(tmp_path)
    assert error.value.code == "DSP503"


def test_header_length_limit_is_the_safetensors_librarys(tmp_path):
    """Over 100,000,000 bytes (safetensors' MAX_HEADER_SIZE) is refused before reading, as the library does."""
    from safetensors import safe_open

    from dspark_cli.runtime.checkpoint.read import MAX_HEADER_BYTES

    assert MAX_HEADER_BYTES == 100_000_000
    (tmp_path / "config.json").write_text("{}")
    shard = tmp_path / "model.safetensors"
    with open(shard, "wb") as handle:
        handle.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        handle.truncate(8 + MAX_HEADER_BYTES + 1 + 64)  # sparse
    with pytest.raises(CheckpointError, match="more than the 100000000 bytes the safetensors library accepts"):
        open_checkpoint(tmp_path)
    with pytest.raises(Exception, match="(?i)header ?too ?large"):
        safe_open(str(shard), framework="pt")


def test_tensor_count_is_capped_per_file_and_per_checkpoint(tmp_path, spec, monkeypatch):
    from dspark_cli.runtime.checkpoint import read as checkpoint

    monkeypatch.setattr(checkpoint, "MAX_TENSORS", 20)
    (tmp_path / "many").mkdir()
    (tmp_path / "many" / "config.json").write_text("{}")
    header = {f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(21)}
    _raw_shard(tmp_path / "many" / "model.safetensors", json.dumps(header).encode(), bytes(21))
    with pytest.raises(CheckpointError, match="model.safetensors declares 21 or more tensors, more than the 20"):
        open_checkpoint(tmp_path / "many")
    monkeypatch.setattr(json, "loads", None)  # the count is made before the header is parsed
    with pytest.raises(CheckpointError, match="model.safetensors declares 21 or more tensors, more than the 20"):
        checkpoint.read_safetensors_header(tmp_path / "many" / "model.safetensors")
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint, "MAX_TENSORS", 20)
    sharded = write_draft(tmp_path / "sharded", spec, shards=2)  # 31 tensors, 15 and 16 per shard
    with pytest.raises(CheckpointError, match="sharded declares 31 or more tensors, more than the 20"):
        open_checkpoint(sharded)


@pytest.mark.parametrize("reader", ["prompts", "training"])
def test_deeply_nested_jsonl_lines_are_one_sentence(tmp_path, reader):
    from dspark_cli.cli.generate import read_prompts
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.train.data import read_documents

    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine", "prompt": "fine"}\n' + _deep(100_000) + "\n")
    read = (lambda: read_prompts(path)) if reader == "prompts" else (lambda: read_documents([path]))
    with pytest.raises(DsparkError, match=r"data.jsonl.*2 nests JSON objects or arrays more than 100 levels deep"):
        read()


def test_tensor_count_is_exact_across_read_chunks(tmp_path, monkeypatch):
    """The streaming count reads 1 MiB at a time; 20,000 entries span two chunks and must count 20,000 exactly."""
    from dspark_cli.runtime.checkpoint import read as checkpoint

    monkeypatch.setattr(checkpoint, "MAX_TENSORS", 20_000)
    for count in (20_000, 20_001):
        header = {f"tensor.{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(count)}
        raw = json.dumps(header).encode()
        before_boundary = raw.rfind(b'"data_offsets"', 0, (1 << 20) - 7)
        raw = b"{" + b" " * ((1 << 20) - 7 - before_boundary) + raw[1:]  # one key straddles the chunk boundary
        assert raw.find(b'"data_offsets"', (1 << 20) - 7) == (1 << 20) - 7
        _raw_shard(tmp_path / "model.safetensors", raw, bytes(count))
        if count == 20_000:
            assert len(checkpoint.read_safetensors_header(tmp_path / "model.safetensors")[0]) == 20_000
        else:
            monkeypatch.setattr(json, "loads", None)  # refused by the streaming count, before any parsing
            with pytest.raises(CheckpointError, match="declares 20001 or more tensors"):
                checkpoint.read_safetensors_header(tmp_path / "model.safetensors")
