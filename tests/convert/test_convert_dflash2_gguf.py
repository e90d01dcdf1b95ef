"""dspark convert's DFlash2 GGUF (runtime/convert/dflash2_gguf.py): the keys, names, shapes and bytes llama.cpp
b11434's converter writes for a DFlash2DraftModel (conversion/qwen.py DFlashModel, gguf-py tensor_mapping.py), the
start-up refusals of src/models/dflash.cpp checked before anything is written, and the real llama-server loading the
file and drafting with it on the demo target."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.convert.gguf import convert_to_gguf
from dspark_cli.runtime.demo import DEMO_DIR

from dflash2_hf import write_dflash2_draft
from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: F401 (demo_ggufs: a fixture)

gguf = pytest.importorskip("gguf")
TARGET = DEMO_DIR / "target"
SELECTOR = {  # DFlash2 name -> llama.cpp name (gguf-py tensor_mapping.py, conversion/qwen.py's `.weight`)
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
CONV = {
    "layers.0.attention_conv.base_kernel": "blk.0.attn_conv_base",
    "layers.0.attention_conv.kernel_projection.weight": "blk.0.attn_conv_proj.weight",
    "layers.0.mlp_conv.base_kernel": "blk.0.ffn_conv_base",
    "layers.0.mlp_conv.kernel_projection.weight": "blk.0.ffn_conv_proj.weight",
}


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    return write_dflash2_draft(tmp_path_factory.mktemp("dflash2") / "draft")


@pytest.fixture(scope="module")
def draft_gguf(draft, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dflash2_gguf") / "draft.gguf"
    convert_to_gguf(str(draft), out, target=str(TARGET))
    return out


def _fields(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}, {t.name: t for t in reader.tensors}


def test_selector_keys_and_no_dspark_keys(draft_gguf):
    keys, _ = _fields(draft_gguf)
    assert keys["general.architecture"] == "dflash"
    assert [keys[f"dflash.{k}"] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                          "selector_top_k")] == [3, 16, 32, 8]
    assert keys["dflash.block_size"] == 8 and keys["tokenizer.ggml.mask_token_id"] == 1
    assert keys["dflash.target_layers"] == [2, 4, 7]
    # conversion/qwen.py's DFlashModel writes neither DSpark key for a DFlash2 draft
    assert "dflash.sample_from_anchor" not in keys and "dflash.has_confidence_head" not in keys
    assert "dflash.logit_scale" not in keys  # no output_multiplier in this draft's dflash_config


def test_output_multiplier_and_softcap_become_llamacpp_keys(tmp_path):
    folder = write_dflash2_draft(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"].update(output_multiplier=0.5, final_logit_softcapping=30.0)
    (folder / "config.json").write_text(json.dumps(config))
    convert_to_gguf(str(folder), tmp_path / "d.gguf", target=str(TARGET))
    keys, _ = _fields(tmp_path / "d.gguf")
    assert keys["dflash.logit_scale"] == 0.5 and keys["dflash.final_logit_softcapping"] == 30.0


def test_selector_and_conv_tensors_are_the_checkpoints_untransposed(draft, draft_gguf):
    """Each tensor as stored: numpy shape [V, r] is ggml's {r, V}, the loader's shape (dflash.cpp); a transposed
    codebook or projection would have the other shape and other bytes."""
    source = load_file(str(draft / "model.safetensors"))
    _, tensors = _fields(draft_gguf)
    for name, gguf_name in {**SELECTOR, **CONV}.items():
        written, stored = tensors[gguf_name], source[name].numpy()
        assert list(written.shape) == list(reversed(stored.shape)), gguf_name
        assert np.array_equal(np.asarray(written.data).reshape(stored.shape), stored), gguf_name
    assert list(tensors["selector_hidden.weight"].shape) == [256, 32]  # {n_embd, rank}
    assert list(tensors["blk.0.attn_conv_base"].shape) == [256, 3, 2]  # {n_embd, kernel, 2}
    assert list(tensors["blk.0.attn_conv_proj.weight"].shape) == [256, 2 * 3 * 16]  # {n_embd, 2*K*H/g}
    assert "token_embd.weight" not in tensors and "output.weight" not in tensors  # the target's are shared


def test_bfloat16_conv_base_kernels_are_widened_to_f32_exactly(tmp_path):
    """conversion/base.py keeps a tensor whose name does not end in `.weight` F32; the codebooks stay BF16."""
    folder = write_dflash2_draft(tmp_path / "d", dtype=torch.bfloat16)
    convert_to_gguf(str(folder), tmp_path / "d.gguf", target=str(TARGET))
    _, tensors = _fields(tmp_path / "d.gguf")
    base = tensors["blk.0.ffn_conv_base"]
    assert base.tensor_type == gguf.GGMLQuantizationType.F32
    stored = load_file(str(folder / "model.safetensors"))["layers.0.mlp_conv.base_kernel"].float().numpy()
    assert np.array_equal(np.asarray(base.data).reshape(stored.shape), stored)
    assert tensors["selector_successor.weight"].tensor_type == gguf.GGMLQuantizationType.BF16


@pytest.mark.parametrize("changes, words", [
    ({"conv_group_size": 24}, "not a multiple of conv_group_size 24"),
    ({"selector_top_k": 16}, "below selector_top_k·(selector_top_k + 1) = 272"),
    ({"selector_rank": None}, "lacks a positive selector_rank"),
])
def test_llamacpp_startup_refusals_are_refused_before_writing(tmp_path, changes, words):
    folder = write_dflash2_draft(tmp_path / "d")
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(DsparkError, match="cannot be converted to a llama.cpp GGUF faithfully") as error:
        convert_to_gguf(str(folder), tmp_path / "d.gguf", target=str(TARGET))
    assert words in str(error.value)
    assert not (tmp_path / "d.gguf").exists()


@needs_llamacpp
def test_real_llama_server_loads_and_drafts_losslessly(draft_gguf, demo_ggufs):
    """llama.cpp b11434 loads dspark's DFlash2 GGUF beside the demo target (its DFlash2 start-up checks pass), drafts
    with it (spec type draft-dflash) and its greedy tokens equal the target's alone."""
    import urllib.request

    target, _ = demo_ggufs
    body = {"prompt": "def fibonacci(n):", "n_predict": 24, "temperature": 0, "cache_prompt": False,
            "return_tokens": True}

    def complete(url: str) -> dict:
        request = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)

    with llama_server(target, draft_gguf, spec=["--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]) as url:
        drafted = complete(url)
    with llama_server(target) as url:
        plain = complete(url)
    assert drafted["tokens"] == plain["tokens"] and len(plain["tokens"]) == 24
    assert drafted["timings"]["draft_n"] > 0
