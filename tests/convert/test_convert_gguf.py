"""dspark convert's GGUF writer (no llama.cpp binary): keys, tensor names and bytes as llama.cpp b11434's own
DSparkModel converter writes them (conversion/qwen.py), the target-layer numbering, refusals, exclusive output."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.convert.gguf import convert_to_gguf, llamacpp_target_layers
from dspark_cli.runtime.demo import DEMO_DIR

gguf = pytest.importorskip("gguf")
DRAFT, TARGET = DEMO_DIR / "draft", DEMO_DIR / "target"
# The demo draft as llama.cpp b11434's convert_hf_to_gguf.py writes it (run with --target-model-dir, its tokenizer
# pre-hash check answered "gpt-2"), plus output.weight: dspark keeps the draft's own lm_head.
EXPECTED_TENSORS = {
    "token_embd.weight", "output.weight", "output_norm.weight", "enc.output_norm.weight", "fc.weight",
    "markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias",
    *(f"blk.0.{name}.weight" for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                          "attn_k_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "draft.gguf"
    convert_to_gguf(str(DRAFT), out, target=str(TARGET))
    return gguf.GGUFReader(out)


def _value(reader, key):
    return reader.fields[key].contents()


def test_keys_are_llamacpps(converted):
    assert _value(converted, "general.architecture") == "dflash"
    assert _value(converted, "dflash.block_size") == 7
    assert _value(converted, "dflash.sample_from_anchor") is True
    assert _value(converted, "dflash.has_confidence_head") is True
    assert _value(converted, "dflash.block_count") == 1
    assert _value(converted, "dflash.attention.key_length") == 32
    assert _value(converted, "general.file_type") == 32  # MOSTLY_BF16
    assert _value(converted, "tokenizer.ggml.mask_token_id") == 1
    assert _value(converted, "tokenizer.ggml.model") == "gpt2"
    assert _value(converted, "tokenizer.ggml.pre") == "gpt-2"  # llama-vocab.cpp knows no "gpt2"
    assert len(_value(converted, "tokenizer.ggml.tokens")) == 1024
    assert _value(converted, "tokenizer.ggml.eos_token_id") == 0
    types = _value(converted, "tokenizer.ggml.token_type")
    assert types[:3] == [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.NORMAL]


def test_target_layers_are_deepspec_ids_plus_one(converted):
    """DeepSpec's [1, 3, 6] ("output of layer k") is llama.cpp's extract layers [2, 4, 7]."""
    ids = json.loads((DRAFT / "config.json").read_text())["target_layer_ids"]
    assert _value(converted, "dflash.target_layers") == [i + 1 for i in ids] == [2, 4, 7]
    assert llamacpp_target_layers([0, 5]) == [1, 6]


def test_tensor_names_and_bytes(converted):
    tensors = {t.name: t for t in converted.tensors}
    assert set(tensors) == EXPECTED_TENSORS
    ckpt = open_checkpoint(str(DRAFT))
    info = ckpt.tensors["markov_head.markov_w2.weight"]
    raw = np.fromfile(DRAFT / info.file, dtype=np.uint16, count=info.numel, offset=info.begin)
    w2 = tensors["markov_w2.weight"]
    assert w2.tensor_type == gguf.GGMLQuantizationType.BF16 and list(w2.shape) == [128, 1024]
    assert w2.data.tobytes() == raw.tobytes()
    norm = tensors["enc.output_norm.weight"]  # hidden_norm: BF16 widened to F32 exactly
    info = ckpt.tensors["hidden_norm.weight"]
    raw = np.fromfile(DRAFT / info.file, dtype=np.uint16, count=info.numel, offset=info.begin)
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(norm.data.view(np.uint32) >> 16, raw.astype(np.uint32))


def _draft_copy(tmp_path, **config):
    draft = tmp_path / "draft"
    shutil.copytree(DRAFT, draft)
    data = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**data, **config}))
    return draft


def test_gated_head_is_refused(tmp_path):
    draft = _draft_copy(tmp_path, markov_head_type="gated")
    with pytest.raises(DsparkError, match="vanilla head only"):
        convert_to_gguf(str(draft), tmp_path / "out.gguf", target=str(TARGET))
    assert not (tmp_path / "out.gguf").exists()


def test_a_gemma4_draft_is_refused_in_one_sentence(tmp_path):
    """llama.cpp's dflash model and its converter are Qwen3's: a Gemma-4 draft is a DsparkError naming its family."""
    from ckpt_factory import DraftSpec, write_draft

    draft = write_draft(tmp_path / "gemma4", DraftSpec(family="gemma4"))
    with pytest.raises(DsparkError, match="it is a Gemma-4 draft, and dspark converts Qwen3-family drafts only"):
        convert_to_gguf(str(draft), tmp_path / "out.gguf", target=str(TARGET))
    assert not (tmp_path / "out.gguf").exists()


def test_confidence_head_without_markov_input_is_refused(tmp_path):
    draft = _draft_copy(tmp_path, confidence_head_with_markov=False)
    with pytest.raises(DsparkError, match="conf_proj reads the hidden state and the Markov state"):
        convert_to_gguf(str(draft), tmp_path / "out.gguf", target=str(TARGET))


def test_output_is_exclusive_and_never_an_input(tmp_path):
    out = tmp_path / "draft.gguf"
    out.write_text("mine")
    with pytest.raises(DsparkError, match="force option"):
        convert_to_gguf(str(DRAFT), out, target=str(TARGET))
    assert out.read_text() == "mine"
    draft = _draft_copy(tmp_path)
    with pytest.raises(DsparkError, match="inside"):
        convert_to_gguf(str(draft), draft / "x.gguf", target=str(TARGET))
    convert_to_gguf(str(DRAFT), out, target=str(TARGET), force=True)
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "dflash"


def test_cli_names_flags(tmp_path):
    draft = _draft_copy(tmp_path, markov_head_type="rnn")
    result = CliRunner().invoke(app, ["convert", str(draft), "-o", str(tmp_path / "o.gguf"), "--to", "gguf",
                                      "--target", str(TARGET)])
    assert result.exit_code != 0 and "'rnn'" in result.output
    out = tmp_path / "ok.gguf"
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(out), "--to", "gguf", "--target", str(TARGET)])
    assert result.exit_code == 0 and out.is_file()
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(out), "--to", "gguf", "--target", str(TARGET)])
    assert result.exit_code == 2 and "--force" in result.output


def test_reduced_vocab_d2t_is_written_as_absolute_target_ids(tmp_path):
    """conversion/qwen.py DSparkModel.prepare_tensors: d2t offsets + arange, I64; the draft head keeps Vd rows."""
    from ckpt_factory import DraftSpec, reduced_vocab_d2t, write_draft

    draft = write_draft(tmp_path / "draft", DraftSpec(vocab_size=1024, draft_vocab_size=64))  # the demo target's
    out = tmp_path / "d.gguf"
    convert_to_gguf(str(draft), out, target=str(TARGET))
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    expected = reduced_vocab_d2t(64, 1024).numpy() + np.arange(64)
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    assert np.array_equal(np.asarray(tensors["d2t"].data).reshape(-1), expected)
    assert list(tensors["markov_w2.weight"].shape) == [32, 64] and list(tensors["output.weight"].shape) == [64, 64]
    assert {"blk.1.attn_q.weight", "blk.1.ffn_down.weight"} <= set(tensors)


def test_nvfp4_head_is_refused(tmp_path):
    from ckpt_factory import DraftSpec, nvfp4_markov_w2, write_draft

    spec = DraftSpec()
    draft = write_draft(tmp_path / "draft", spec, mutate=nvfp4_markov_w2(spec))
    with pytest.raises(DsparkError, match="NVFP4"):
        convert_to_gguf(str(draft), tmp_path / "out.gguf", target=str(TARGET))


# --- attention: the window keys and the causal flag from DraftConfig.layer_attention (docs/format.md §2.3) ----------

SLIDING, FULL = "sliding_attention", "full_attention"


def _attention_gguf(tmp_path, **config):
    """A two-layer draft (the demo target's vocabulary) with `config` over its keys, converted; its GGUF keys."""
    from ckpt_factory import DraftSpec, write_draft

    from dspark_cli.runtime.checkpoint.gguf_read import read_gguf

    draft = write_draft(tmp_path / "draft", DraftSpec(vocab_size=1024, extra_config=config))
    return read_gguf(convert_to_gguf(str(draft), tmp_path / "d.gguf", target=str(TARGET))["output"]).keys


def test_use_swa_beside_sliding_layer_types_keeps_the_named_layers(tmp_path):
    """vLLM's _resolve_layer_attention: use_swa makes every layer sliding only when layer_types names none, so the
    full_attention layer stays dense; swa_window_size wins over sliding_window."""
    keys = _attention_gguf(tmp_path, layer_types=[SLIDING, FULL], sliding_window=16, is_causal=False,
                           dflash_config={"use_swa": True, "swa_window_size": 8})
    assert keys["dflash.attention.sliding_window"] == 8
    assert keys["dflash.attention.sliding_window_pattern"] == [True, False]
    assert "dflash.attention.causal" not in keys


@pytest.mark.parametrize("config, causal", [
    ({"layer_types": [SLIDING, SLIDING], "sliding_window": 4}, True),  # sliding layers are causal by default
    ({"is_causal": True}, True),
    ({"dflash_config": {"causal": True}}, True),
    ({"is_causal": False, "dflash_config": {"causal": True}}, None),  # is_causal wins
    ({"layer_types": None, "sliding_window": 4, "dflash_config": {"use_swa": True}}, None),  # MiMo: non-causal
    ({}, None),  # DeepSpec's dense draft: no key, llama.cpp's default (non-causal)
])
def test_the_causal_flag_is_written_for_causal_layers_only(tmp_path, config, causal):
    """common/speculative.cpp reads `dflash.attention.causal` as a bool ("true"), non-causal when absent."""
    assert _attention_gguf(tmp_path, **config).get("dflash.attention.causal") is causal


def test_layers_of_differing_causality_are_refused(tmp_path):
    """A causal sliding layer beside a non-causal full one: llama.cpp has one flag for the draft, exit 2, no file."""
    from ckpt_factory import DraftSpec, write_draft

    draft = write_draft(tmp_path / "draft", DraftSpec(vocab_size=1024, extra_config={
        "layer_types": [SLIDING, FULL], "sliding_window": 4}))
    out = tmp_path / "d.gguf"
    with pytest.raises(DsparkError, match="differ in causality.*one causal flag for all its layers"):
        convert_to_gguf(str(draft), out, target=str(TARGET))
    result = CliRunner().invoke(app, ["convert", str(draft), "-o", str(out), "--to", "gguf", "--target", str(TARGET)])
    assert result.exit_code == 2 and "dflash.attention.causal" in result.output and not out.exists()


def test_validate_reports_the_causal_flag(tmp_path):
    """`dspark validate DRAFT.gguf` resolves causality as llama.cpp reads it: true only for a true bool."""
    from ckpt_factory import DraftSpec, write_draft

    from dspark_cli.runtime.checkpoint.rules.gguf import validate_gguf

    draft = write_draft(tmp_path / "draft", DraftSpec(vocab_size=1024, extra_config={"is_causal": True}))
    causal = convert_to_gguf(str(draft), tmp_path / "c.gguf", target=str(TARGET))["output"]
    dense = convert_to_gguf(str(DRAFT), tmp_path / "d.gguf", target=str(TARGET))["output"]
    assert validate_gguf(causal).resolved["causal"] is True
    assert validate_gguf(dense).resolved["causal"] is False
    from dspark_cli.cli.validate import gguf_rows

    assert ("causal", "True (dflash.attention.causal)") in gguf_rows(validate_gguf(causal).resolved)
