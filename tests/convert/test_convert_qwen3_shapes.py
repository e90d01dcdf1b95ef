"""dspark convert TARGET --to gguf on a target shaped like the released Qwen3 checkpoints rather than the demo one
(tests/fixtures/target_factory.py write_qwen3): head_dim above hidden / heads, layer_types written out, added
tokens with `special: false`, ids no token has, a ByteLevel step without use_regex, a post-processor Sequence that
adds EOS; config values of the wrong type refused in one sentence. The real llama-server loads the file and
tokenizes and decodes as transformers (skipped without the llama.cpp build)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf
from llama_server import llama_server, needs_llamacpp
from target_factory import QWEN3_ADDED, QWEN3_CONFIG, QWEN3_PADDING, tiny_qwen3, write_qwen3

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    return write_qwen3(tmp_path_factory.mktemp("qwen3") / "target")


@pytest.fixture(scope="module")
def converted(qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3-gguf") / "target.gguf"
    convert_target_to_gguf(str(qwen3), out)
    return gguf.GGUFReader(out)


def _value(reader, key):
    return reader.fields[key].contents() if key in reader.fields else None


def _changed(qwen3: Path, tmp_path: Path, name: str, **changes) -> Path:
    """A copy of the fixture with `changes` merged into its `name` JSON file."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(qwen3, target)
    data = json.loads((target / name).read_text())
    (target / name).write_text(json.dumps({**data, **changes}))
    return target


def test_key_and_value_length_are_the_configs_head_dim(converted):
    """head_dim 32 with hidden 64 and 4 heads: llama.cpp reads the heads' width from key_length (64 / 4 = 16 would
    not fit attn_q's 4 x 32 rows)."""
    assert QWEN3_CONFIG["hidden_size"] // QWEN3_CONFIG["num_attention_heads"] != QWEN3_CONFIG["head_dim"]
    assert _value(converted, "qwen3.attention.key_length") == QWEN3_CONFIG["head_dim"]
    assert _value(converted, "qwen3.attention.value_length") == QWEN3_CONFIG["head_dim"]
    assert _value(converted, "qwen3.rope.freq_base") == QWEN3_CONFIG["rope_theta"]  # top-level, rope_scaling null
    attn_q = next(t for t in converted.tensors if t.name == "blk.0.attn_q.weight")
    assert [int(d) for d in attn_q.shape] == [QWEN3_CONFIG["hidden_size"], 4 * QWEN3_CONFIG["head_dim"]]


def test_token_types_are_llamacpps_converters(converted):
    """Added tokens with special false: USER_DEFINED, or CONTROL when they look special (<|...|>); ids no token has:
    [PADn], UNUSED (conversion/base.py get_vocab_base)."""
    tokens = _value(converted, "tokenizer.ggml.tokens")
    types = _value(converted, "tokenizer.ggml.token_type")
    think, fim_pad = QWEN3_ADDED
    assert tokens[think["id"]] == "<think>" and types[think["id"]] == gguf.TokenType.USER_DEFINED
    assert tokens[fim_pad["id"]] == "<|fim_pad|>" and types[fim_pad["id"]] == gguf.TokenType.CONTROL
    assert [tokens[i] for i in QWEN3_PADDING] == [f"[PAD{i}]" for i in QWEN3_PADDING]
    assert {types[i] for i in QWEN3_PADDING} == {gguf.TokenType.UNUSED}
    assert types[0] == gguf.TokenType.CONTROL and set(types[2:1024]) == {gguf.TokenType.NORMAL}
    assert len(tokens) == QWEN3_CONFIG["vocab_size"]


def test_bytelevel_without_use_regex_and_eos_from_the_post_processor_sequence(converted):
    """tokenizers' ByteLevel defaults use_regex to true (GPT-2's regex: gpt-2); the post-processor's Sequence holds
    a ByteLevel step then the TemplateProcessing whose single template ends with <|endoftext|>: add_eos only."""
    assert _value(converted, "tokenizer.ggml.pre") == "gpt-2"
    assert _value(converted, "tokenizer.ggml.add_eos_token") is True
    assert _value(converted, "tokenizer.ggml.add_bos_token") is False


@pytest.mark.parametrize("layer_types", [["full_attention", "sliding_attention"],
                                         ["sliding_attention", "full_attention"]])
def test_sliding_window_layers_are_refused_before_writing(qwen3, tmp_path, layer_types):
    """use_sliding_window false, but layer_types names sliding layers: transformers gives those layers a window."""
    target = _changed(qwen3, tmp_path, "config.json", layer_types=layer_types, sliding_window=16)
    with pytest.raises(DsparkError, match="sliding-window attention"):
        convert_target_to_gguf(str(target), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize(("changes", "said"), [
    ({"rope_scaling": "yarn"}, "rope_scaling is 'yarn' (an object is needed)"),
    ({"rope_parameters": "default"}, "rope_parameters is 'default' (an object is needed)"),
    ({"head_dim": "32"}, "head_dim is '32' (a positive integer is needed)"),
    ({"num_key_value_heads": 2.5}, "num_key_value_heads is 2.5"),
    ({"rope_theta": "1e6"}, "rope_theta is '1e6' (a positive number is needed)"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings is 'false' (true or false is needed)"),
    ({"use_sliding_window": 0}, "use_sliding_window is 0"),
    ({"layer_types": "full_attention"}, "layer_types has 'full_attention' entries"),
    ({"layer_types": [1, 2]}, "layer_types is [1, 2]"),
])
def test_wrongly_typed_config_values_are_one_sentence(qwen3, tmp_path, changes, said):
    """Through the CLI: exit 2, the file and the value named, no traceback, nothing written."""
    target = _changed(qwen3, tmp_path, "config.json", **changes)
    out = tmp_path / "out.gguf"
    result = CliRunner().invoke(app, ["convert", str(target), "-o", str(out), "--to", "gguf"])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split()) and "config.json" in result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize(("name", "changes", "said"), [
    ("tokenizer.json", {"pre_tokenizer": "ByteLevel"}, "pre_tokenizer is 'ByteLevel' (an object or null"),
    ("tokenizer.json", {"added_tokens": [{"content": "<think>", "special": False}]}, "added_tokens is not a list"),
    ("tokenizer.json", {"post_processor": 3}, "post_processor is 3"),
    ("tokenizer.json", {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a"]]}}, "model.merges has an"),
    ("tokenizer_config.json", {"chat_template": ["{{ messages }}"], "add_bos_token": "yes"}, None),
])
def test_wrongly_typed_tokenizer_values_are_one_sentence(qwen3, tmp_path, name, changes, said):
    """tokenizer.json's values are checked by type before they are read: a wrong type is one sentence naming the
    file and the key (exit 2); tokenizer_config.json's values of another type are not used (no default template,
    add_bos from the post-processor)."""
    target = _changed(qwen3, tmp_path, name, **changes)
    out = tmp_path / "out.gguf"
    result = CliRunner().invoke(app, ["convert", str(target), "-o", str(out), "--to", "gguf"])
    if said is None:
        assert result.exit_code == 0, result.output
        reader = gguf.GGUFReader(out)
        assert _value(reader, "tokenizer.chat_template") is None
        assert _value(reader, "tokenizer.ggml.add_bos_token") is False
        return
    assert result.exit_code == 2 and "Traceback" not in result.output and not out.exists(), result.output
    text = " ".join(result.output.split())
    assert "tokenizer.json cannot be read: " in text and said in text


@needs_llamacpp
def test_real_llamacpp_tokenizes_and_decodes_as_transformers(tmp_path):
    """The real llama-server on the converted file: /tokenize with the special tokens added equals the HF
    tokenizer's ids on text holding "[PADn]", <think> and <|fim_pad|> (a [PADn] typed USER_DEFINED would come back
    as its one id; a wrong add_eos drops the trailing EOS), and greedy decoding equals transformers' (a key_length
    of hidden / heads does not load). F32 KV cache, no flash attention, as for the Qwen2 target."""
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "scripts"))
    from llamacpp_check import complete, demo_prompts, post

    model, folder = tiny_qwen3(tmp_path / "qwen3")
    convert_target_to_gguf(str(folder), tmp_path / "t.gguf")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = ["a [PAD1027] b [PAD1031]", "x<think>y</think> <|fim_pad|>z", "plain words, 12 digits"]
    with llama_server(tmp_path / "t.gguf", extra=["-ctk", "f32", "-ctv", "f32", "-fa", "off"]) as url:
        for text in texts:
            ids = post(url, "/tokenize", {"content": text, "add_special": True})["tokens"]
            assert ids == tokenizer(text)["input_ids"], text
        for text in demo_prompts(3):
            ids = tokenizer.encode(text, add_special_tokens=False)
            with torch.no_grad():
                ours = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert complete(url, ids, 16)["tokens"] == ours[0, len(ids):].tolist(), text
