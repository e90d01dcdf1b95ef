"""runtime/train/demo_large.py: the demo target grown by inert layers computes the demo target's function (weights,
transformers' logits and greedy tokens, dspark's speculative loop and its acceptance, the GGUF, llama.cpp's tokens),
and scripts/build_demo.py --pair demo-large writes the pair and its GGUFs. A few inert layers stand for the
default's many: what holds for one holds for each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: F401 (demo_ggufs is a fixture)
from llamacpp_check import demo_prompts  # scripts/ is on sys.path once llama_server is imported

from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.train.demo_large import LargeRecipe, build_large_pair

ROOT = Path(__file__).resolve().parents[2]
EXTRA = 2
DEEP = LargeRecipe(extra_layers=EXTRA, mlp_width=None, float32=False)  # inert layers only, the demo's dtype
WIDE = LargeRecipe(extra_layers=0, mlp_width=1024)  # inert MLP units only, float32 (the default's kind, smaller)
DEPTH = 8 + EXTRA  # the demo target's 8 trained layers, then the inert ones
NEW_TOKENS = 24
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # written here, not imported: a test of the module


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> Path:
    return build_large_pair(tmp_path_factory.mktemp("large") / "pair", DEEP)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return build_large_pair(tmp_path_factory.mktemp("wide") / "pair", WIDE)


def test_inert_layers_write_zero_and_read_real_weights(large):
    """The original tensors unchanged; each new layer has all of a layer's tensors, its residual writes exactly
    zero and every other matrix a dense random one; the config counts the new layers; the draft's weights are the
    demo draft's bytes."""
    from safetensors.torch import load_file

    original = load_file(str(DEMO_DIR / "target" / "model.safetensors"))
    grown = load_file(str(large / "target" / "model.safetensors"))
    assert all(torch.equal(grown[name], tensor) for name, tensor in original.items())
    layer0 = sorted(name.removeprefix("model.layers.0.") for name in original if name.startswith("model.layers.0."))
    new = {f"model.layers.{i}.{name}" for i in range(8, DEPTH) for name in layer0}
    assert set(grown) == set(original) | new
    for name in sorted(new):
        tensor = grown[name]
        assert tensor.dtype == torch.bfloat16, name
        if name.endswith(ZEROED):
            assert torch.count_nonzero(tensor) == 0, name
        elif name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert torch.count_nonzero(tensor) == tensor.numel() and 0.015 < tensor.float().std() < 0.025, name
    config = json.loads((large / "target" / "config.json").read_text())
    assert config["num_hidden_layers"] == len(config["layer_types"]) == DEPTH
    draft = json.loads((large / "draft" / "config.json").read_text())
    assert draft == {**json.loads((DEMO_DIR / "draft" / "config.json").read_text()), "num_target_layers": DEPTH}
    for name in ("draft/model.safetensors", "target/tokenizer.json", "target/generation_config.json"):
        assert (large / name).read_bytes() == (DEMO_DIR / name).read_bytes(), name


def test_grow_target_is_reproducible_from_its_seed(large, tmp_path):
    """grow_target alone writes the pair's target byte for byte with the same seed, other weights with another."""
    from dspark_cli.runtime.train.demo_large import grow_target

    for seed, same in ((0, True), (1, False)):
        folder = grow_target(DEMO_DIR / "target", tmp_path / f"seed{seed}", LargeRecipe(EXTRA, None, False, seed))
        assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in (large / "target").iterdir())
        weights = (folder / "model.safetensors").read_bytes()
        assert (weights == (large / "target" / "model.safetensors").read_bytes()) == same
        assert (folder / "config.json").read_text() == (large / "target" / "config.json").read_text()


def test_inert_mlp_units_write_zero_and_read_real_weights(wide):
    """Every MLP has WIDE.mlp_width units: the demo target's first, then new gate / up rows dense random and new
    down_proj columns exactly zero; everything else the demo target's, in float32; the draft unchanged."""
    from safetensors.torch import load_file

    original = load_file(str(DEMO_DIR / "target" / "model.safetensors"))
    grown = load_file(str(wide / "target" / "model.safetensors"))
    assert set(grown) == set(original) and all(t.dtype == torch.float32 for t in grown.values())
    for name, tensor in original.items():
        tensor = tensor.float()
        if name.endswith(("gate_proj.weight", "up_proj.weight")):  # [units, hidden]
            assert torch.equal(grown[name][:768], tensor) and grown[name].shape == (1024, 256), name
            assert torch.count_nonzero(grown[name][768:]) == 256 * 256, name
        elif name.endswith("down_proj.weight"):  # [hidden, units]
            assert torch.equal(grown[name][:, :768], tensor) and torch.count_nonzero(grown[name][:, 768:]) == 0
        else:
            assert torch.equal(grown[name], tensor), name
    assert json.loads((wide / "target" / "config.json").read_text())["intermediate_size"] == 1024
    assert (wide / "draft" / "model.safetensors").read_bytes() == (DEMO_DIR / "draft" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("pair", ["large", "wide"])
def test_the_grown_target_has_the_demo_targets_logits_and_greedy_tokens(pair, request):
    """transformers, float32: logits bit-identical on a prompt, greedy tokens identical on the eval prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = request.getfixturevalue(pair)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    small = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32)
    grown = AutoModelForCausalLM.from_pretrained(folder / "target", dtype=torch.float32)
    assert len(grown.model.layers) == (DEPTH if pair == "large" else 8)
    for number, text in enumerate(demo_prompts(4)):
        ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
        with torch.no_grad():
            if number == 0:
                assert torch.equal(small(ids).logits, grown(ids).logits)  # [1, T, V]
            expected = small.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            got = grown.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert got.tolist() == expected.tolist(), text


def test_speculation_accepts_on_the_grown_target_as_on_the_demo_target(large):
    """dspark's loop with the demo draft: the target's greedy tokens and, round by round, the same acceptance as
    on the demo target (the draft reads layers 1, 3, 6, which the grown target shares). The demo draft itself
    would run with validate's DSP031 warning (num_target_layers 8); the pair's copy has none."""
    from dspark_cli.runtime.pair import Pair

    def load(target, draft) -> Pair:
        return Pair.check(str(target), str(draft), device="cpu", dtype="float32", temperature=0.0).load(
            progress=False)

    assert any(w.startswith("DSP031") for w in Pair.check(str(large / "target"), str(DEMO_DIR / "draft")).warnings)
    small, grown = load(DEMO_DIR / "target", DEMO_DIR / "draft"), load(large / "target", large / "draft")
    assert grown.warnings == small.warnings
    for text in demo_prompts(4):
        ids = small.encode(text)
        expected, got = small.generate(ids, max_new_tokens=NEW_TOKENS), grown.generate(ids, max_new_tokens=NEW_TOKENS)
        assert got.tokens == expected.tokens == grown.baseline(ids, max_new_tokens=NEW_TOKENS).tokens, text
        assert [r.accepted for r in got.stats.rounds] == [r.accepted for r in expected.stats.rounds], text


def test_the_gguf_holds_every_layer(large, tmp_path):
    """dspark convert's library half writes all DEPTH blocks, the inert ones' residual writes zero."""
    import gguf
    import numpy as np

    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf

    convert_target_to_gguf(str(large / "target"), tmp_path / "target.gguf")
    reader = gguf.GGUFReader(tmp_path / "target.gguf")
    assert int(reader.get_field("qwen3.block_count").contents()) == DEPTH
    tensors = {t.name: t for t in reader.tensors}
    assert {f"blk.{DEPTH - 1}.attn_output.weight", f"blk.{DEPTH - 1}.ffn_down.weight"} <= set(tensors)
    assert not np.any(tensors[f"blk.{DEPTH - 1}.ffn_down.weight"].data)
    assert convert_to_gguf(str(large / "draft"), tmp_path / "draft.gguf", target=str(large / "target"))[
        "target_layers"] == [2, 4, 7]


def test_build_script_writes_the_pair_and_its_ggufs(tmp_path):
    out = tmp_path / "demo-large"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_demo.py"), "--pair", "demo-large",
                          "--extra-layers", "1", "--mlp-width", "768", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((out / "target" / "config.json").read_text())["num_hidden_layers"] == 9
    assert (out / "MODEL_CARD.md").is_file() and (out / "draft" / "config.json").is_file()
    assert (out / "gguf" / "target.gguf").is_file() and (out / "gguf" / "draft.gguf").is_file()


@needs_llamacpp
@pytest.mark.parametrize("pair", ["large", "wide"])
def test_llamacpp_gives_the_demo_targets_tokens_and_log_probabilities(pair, request, demo_ggufs, tmp_path):
    """llama-server on the grown target's GGUF emits the demo target's GGUF's greedy tokens, each with the same top
    log-probabilities to the bit (llama.cpp adds the inert weights' zeros too). The wide pair is float32, so its
    reference is the demo target converted in float32 (llama.cpp multiplies bf16 and float32 matrices
    differently)."""
    from llamacpp_check import post
    from llamacpp_server import large_gguf

    from dspark_cli.runtime.pair import load_tokenizer

    grown, _ = large_gguf(request.getfixturevalue(pair), DEEP if pair == "large" else WIDE)
    if pair == "wide":
        same_in_float32 = LargeRecipe(extra_layers=0, mlp_width=None)
        demo_ggufs = large_gguf(build_large_pair(tmp_path / "f32", same_in_float32), same_in_float32)
    tokenizer = load_tokenizer(str(DEMO_DIR / "target"))
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in demo_prompts(4)]
    runs = []
    for target in (demo_ggufs[0], grown):
        with llama_server(target) as url:
            runs.append([post(url, "/completion", {"prompt": ids, "n_predict": 32, "temperature": 0.0, "top_k": 1,
                                                   "ignore_eos": True, "return_tokens": True, "cache_prompt": False,
                                                   "n_probs": 5}) for ids in prompts])
    for small, big in zip(*runs):
        assert big["tokens"] == small["tokens"] and len(big["tokens"]) == 32
        assert big["completion_probabilities"] == small["completion_probabilities"]
