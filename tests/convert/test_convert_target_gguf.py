"""dspark convert TARGET --to gguf (no llama.cpp binary): the demo Qwen3 target read back with the `gguf` package's
reader, every key, tensor and tokenizer array against the source files; the pre-tokenizer chosen by its regexes;
special ids and flags; refusals before anything is written. tests/engines/test_llamacpp_real.py runs the file in
the real llama-server."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.convert.gguf_vocab import GPT2_REGEX, LLAMA3_REGEX, QWEN2_REGEX, pre_tokenizer_name
from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf
from dspark_cli.runtime.demo import DEMO_DIR

gguf = pytest.importorskip("gguf")
TARGET = DEMO_DIR / "target"
CONFIG = json.loads((TARGET / "config.json").read_text())
TOKENIZER = json.loads((TARGET / "tokenizer.json").read_text())
LAYER_NAMES = {  # HF name inside model.layers.N -> llama.cpp's inside blk.N (llama-arch.cpp LLM_ARCH_QWEN3)
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "target.gguf"
    convert_target_to_gguf(str(TARGET), out)
    return gguf.GGUFReader(out)


def _value(reader, key):
    return reader.fields[key].contents() if key in reader.fields else None


def _source(folder, name: str) -> np.ndarray:
    """The safetensors tensor as numpy, BF16 as float32 (its bits are F32's top half)."""
    info = open_checkpoint(str(folder)).tensors[name]
    dtype = {"BF16": np.uint16, "F32": np.float32}[info.dtype]
    data = np.fromfile(folder / info.file, dtype=dtype, count=info.numel, offset=info.begin).reshape(info.shape)
    return (data.astype(np.uint32) << 16).view(np.float32) if info.dtype == "BF16" else data


def _as_float(tensor) -> np.ndarray:
    """A GGUF tensor's values in numpy's row-major shape (the reverse of GGUF's dims)."""
    data = np.asarray(tensor.data)
    if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:
        data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return data.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def test_keys_are_llamacpps_qwen3(converted):
    head_dim = CONFIG["head_dim"]
    expected = {
        "general.architecture": "qwen3", "qwen3.block_count": CONFIG["num_hidden_layers"],
        "qwen3.context_length": CONFIG["max_position_embeddings"], "qwen3.embedding_length": CONFIG["hidden_size"],
        "qwen3.feed_forward_length": CONFIG["intermediate_size"],
        "qwen3.attention.head_count": CONFIG["num_attention_heads"],
        "qwen3.attention.head_count_kv": CONFIG["num_key_value_heads"],
        "qwen3.attention.key_length": head_dim, "qwen3.attention.value_length": head_dim,
        "general.file_type": 32,  # MOSTLY_BF16: the demo's matrices are BF16
    }
    assert {key: _value(converted, key) for key in expected} == expected
    assert _value(converted, "qwen3.rope.freq_base") == CONFIG["rope_parameters"]["rope_theta"]
    assert _value(converted, "qwen3.attention.layer_norm_rms_epsilon") == pytest.approx(CONFIG["rms_norm_eps"])


def test_tensors_are_the_sources_named_as_llamacpp_loads_them(converted):
    """Every HF tensor under its llama.cpp name, numpy shape = reversed GGUF dims, values exact; matrices BF16 as
    stored, vectors F32; no output.weight (tied: llama.cpp's qwen3 falls back to token_embd)."""
    tensors = {t.name: t for t in converted.tensors}
    expected = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(CONFIG["num_hidden_layers"]):
        for hf, ours in LAYER_NAMES.items():
            expected[f"blk.{i}.{ours}.weight"] = f"model.layers.{i}.{hf}.weight"
    assert set(tensors) == set(expected)
    for name, source in expected.items():
        want = _source(TARGET, source)
        tensor = tensors[name]
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F32 if want.ndim == 1
                                      else gguf.GGMLQuantizationType.BF16), name
        assert np.array_equal(_as_float(tensor), want), name


def test_tokenizer_arrays_equal_tokenizer_json(converted):
    vocab = {**TOKENIZER["model"]["vocab"], **{t["content"]: t["id"] for t in TOKENIZER["added_tokens"]}}
    by_id = {index: token for token, index in vocab.items()}
    assert _value(converted, "tokenizer.ggml.model") == "gpt2"
    assert _value(converted, "tokenizer.ggml.pre") == "gpt-2"
    assert _value(converted, "tokenizer.ggml.tokens") == [by_id[i] for i in range(CONFIG["vocab_size"])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in TOKENIZER["model"]["merges"]]
    assert _value(converted, "tokenizer.ggml.merges") == merges and len(merges) > 700
    special = {t["id"] for t in TOKENIZER["added_tokens"] if t["special"]}
    assert _value(converted, "tokenizer.ggml.token_type") == [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(CONFIG["vocab_size"])]


def test_special_ids_and_flags(converted):
    """The demo: <|endoftext|> (0) is eos and pad (tokenizer_config.json) and bos (config.json's bos_token_id);
    neither BOS nor EOS is added (no add_bos_token, a post-processor without special tokens)."""
    assert _value(converted, "tokenizer.ggml.eos_token_id") == 0
    assert _value(converted, "tokenizer.ggml.padding_token_id") == 0
    assert _value(converted, "tokenizer.ggml.bos_token_id") == CONFIG["bos_token_id"] == 0
    assert _value(converted, "tokenizer.ggml.add_bos_token") is False
    assert _value(converted, "tokenizer.ggml.add_eos_token") is False
    assert _value(converted, "tokenizer.chat_template") is None


def _target_copy(tmp_path, config=None, tokenizer=None, tokenizer_config=None):
    target = tmp_path / "target"
    shutil.copytree(TARGET, target)
    for name, changes in (("config.json", config), ("tokenizer.json", tokenizer),
                          ("tokenizer_config.json", tokenizer_config)):
        if changes:
            data = json.loads((target / name).read_text())
            (target / name).write_text(json.dumps({**data, **changes}))
    return target


def test_flags_ids_and_template_follow_the_tokenizer_files(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    target = _target_copy(tmp_path, tokenizer_config={"bos_token": "<|mask|>", "add_bos_token": True,
                                                       "chat_template": template})
    out = tmp_path / "t.gguf"
    convert_target_to_gguf(str(target), out)
    reader = gguf.GGUFReader(out)
    assert _value(reader, "tokenizer.ggml.bos_token_id") == 1
    assert _value(reader, "tokenizer.ggml.add_bos_token") is True
    assert _value(reader, "tokenizer.chat_template") == template
    post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|mask|>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}]}
    target = _target_copy(tmp_path / "b", tokenizer={"post_processor": post})
    convert_target_to_gguf(str(target), tmp_path / "b.gguf")
    assert _value(gguf.GGUFReader(tmp_path / "b.gguf"), "tokenizer.ggml.add_bos_token") is True


def _split(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}


@pytest.mark.parametrize(("pre_tokenizer", "ignore_merges", "name"), [
    ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, False, "gpt-2"),
    (_split(GPT2_REGEX), False, "gpt-2"),
    (_split(QWEN2_REGEX), False, "qwen2"),  # a real Qwen3's tokenizer.json
    (_split(LLAMA3_REGEX), True, "llama-bpe"),
])
def test_pre_tokenizer_is_named_by_its_regex(tmp_path, pre_tokenizer, ignore_merges, name):
    tokenizer = {**TOKENIZER, "pre_tokenizer": pre_tokenizer,
                 "model": {**TOKENIZER["model"], "ignore_merges": ignore_merges}}
    assert pre_tokenizer_name(tmp_path / "tokenizer.json", tokenizer) == name
    target = _target_copy(tmp_path, tokenizer={"pre_tokenizer": pre_tokenizer, "model": tokenizer["model"]})
    convert_target_to_gguf(str(target), tmp_path / "t.gguf")
    assert _value(gguf.GGUFReader(tmp_path / "t.gguf"), "tokenizer.ggml.pre") == name


@pytest.mark.parametrize(("pre_tokenizer", "ignore_merges", "match"), [
    (_split(r"\p{N}{1,3}| ?\p{L}+"), False, r"regex `\\p\{N\}\{1,3\}\| \?\\p\{L\}\+`"),
    (_split(LLAMA3_REGEX), False, "ignore_merges False"),  # llama.cpp's llama-bpe always ignores merges
    ({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}, False, "pre-tokenizer step"),
    ({"type": "Whitespace"}, False, "pre-tokenizer step"),
])
def test_unknown_pre_tokenizer_is_refused_naming_it(tmp_path, pre_tokenizer, ignore_merges, match):
    target = _target_copy(tmp_path, tokenizer={"pre_tokenizer": pre_tokenizer,
                                               "model": {**TOKENIZER["model"], "ignore_merges": ignore_merges}})
    with pytest.raises(DsparkError, match=match):
        convert_target_to_gguf(str(target), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def _with_tensors(target, **extra):
    """Rewrite the target's safetensors with `extra` tensors added (None drops one)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(target / "model.safetensors")
    for name, value in extra.items():
        name = name.replace("__", ".")
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})


def test_untied_target_writes_output_weight(tmp_path):
    import torch

    target = _target_copy(tmp_path, config={"tie_word_embeddings": False})
    head = torch.randn(CONFIG["vocab_size"], CONFIG["hidden_size"]).to(torch.bfloat16)
    _with_tensors(target, lm_head__weight=head)
    out = tmp_path / "t.gguf"
    convert_target_to_gguf(str(target), out)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert np.array_equal(_as_float(tensors["output.weight"]), head.float().numpy())


@pytest.mark.parametrize(("config", "tensors", "match"), [
    ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]}, {}, "stateful Qwen3-Next"),
    ({"text_config": {"model_type": "qwen3"}}, {}, "multimodal"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, {}, "'llama' model"),
    ({"attention_bias": True}, {}, "biases, which llama.cpp's qwen3 model does not load"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, {}, "rope scaling is 'yarn'"),
    ({"use_sliding_window": True}, {}, "sliding-window"),
    ({"tie_word_embeddings": False}, {}, "no tensor for llama.cpp's output.weight"),
    ({}, {"model__layers__0__self_attn__k_norm__weight": None}, "no tensor for llama.cpp's blk.0.attn_k_norm"),
    ({}, {"model__layers__0__self_attn__rotary__inv_freq": "f32"}, "loads no tensor like"),
])
def test_unsupported_targets_are_refused_before_writing(tmp_path, config, tensors, match):
    import torch

    target = _target_copy(tmp_path, config=config)
    if tensors:
        _with_tensors(target, **{k: torch.ones(4) if v == "f32" else v for k, v in tensors.items()})
    with pytest.raises(DsparkError, match=match):
        convert_target_to_gguf(str(target), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_cli_tells_a_target_from_a_draft(tmp_path):
    out = tmp_path / "t.gguf"
    result = CliRunner().invoke(app, ["convert", str(TARGET), "-o", str(out), "--to", "gguf"])
    assert result.exit_code == 0 and "qwen3 GGUF" in result.output and "pre-tokenizer gpt-2" in result.output
    assert _value(gguf.GGUFReader(out), "general.architecture") == "qwen3"
    result = CliRunner().invoke(app, ["convert", str(TARGET), "-o", str(tmp_path / "u.gguf"), "--to", "gguf",
                                      "--target", str(TARGET)])
    assert result.exit_code == 2 and "drop it" in result.output and not (tmp_path / "u.gguf").exists()
    result = CliRunner().invoke(app, ["convert", str(TARGET), "-o", str(out), "--to", "gguf"])
    assert result.exit_code == 2 and "--force" in result.output
    target = _target_copy(tmp_path, config={"use_sliding_window": True})
    result = CliRunner().invoke(app, ["convert", str(target), "-o", str(tmp_path / "s.gguf"), "--to", "gguf"])
    assert result.exit_code == 2 and "sliding-window" in result.output and "Traceback" not in result.output


def test_qwen2_target_has_biases_and_no_qk_norms(tmp_path):
    """A Qwen2 (float32, untied): llama.cpp's qwen2 keys, Q/K/V biases as blk.N.attn_{q,k,v}.bias, no Q/K norms,
    every tensor F32 and equal to the model's parameter."""
    from target_factory import qwen2_tensors, write_qwen2

    folder = write_qwen2(tmp_path / "qwen2")
    out = tmp_path / "q.gguf"
    convert_target_to_gguf(str(folder), out)
    reader = gguf.GGUFReader(out)
    assert _value(reader, "general.architecture") == "qwen2" and _value(reader, "qwen2.block_count") == 2
    assert _value(reader, "qwen2.attention.head_count_kv") == 2 and _value(reader, "general.file_type") == 0
    tensors = {t.name: t for t in reader.tensors}
    params = qwen2_tensors()
    expected = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
    for i in range(2):
        for hf, ours in LAYER_NAMES.items():
            if not hf.endswith("_norm") or "layernorm" in hf:
                expected[f"blk.{i}.{ours}.weight"] = f"model.layers.{i}.{hf}.weight"
        for x in "qkv":
            expected[f"blk.{i}.attn_{x}.bias"] = f"model.layers.{i}.self_attn.{x}_proj.bias"
    assert set(tensors) == set(expected)
    for name, source in expected.items():
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(_as_float(tensors[name]), params[source].numpy()), name
    _with_tensors(folder, model__layers__1__self_attn__v_proj__bias=None)
    with pytest.raises(DsparkError, match="no tensor for llama.cpp's blk.1.attn_v.bias"):
        convert_target_to_gguf(str(folder), tmp_path / "r.gguf")
