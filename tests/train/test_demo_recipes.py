"""The demo pairs' recipes: the attention pair's stays what built the shipped pair, the hybrid recipe builds a
Qwen3.5-style target, and a build resumes from its cached target and draft stages (microscopic recipes, no real
training)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.train.demo_build import (DRAFTS_STAGE_FILE, HYBRID_RECIPE, DemoRecipe, _target_key,
                                                 build_demo, model_card)
from dspark_cli.runtime.train.new_draft import DraftShape
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.tiny_target import HybridGeometry

# What built src/dspark_cli/runtime/assets/demo/ (MODEL_CARD.md there): changing any of it changes the attention
# pair, its cached target stage (the key below) and `build_demo.py --card-only`.
ATTENTION_RECIPE = {
    "vocab_size": 1024,
    "target": {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048},
    "target_steps": 2500, "target_batch_size": 8, "target_seq_len": 256, "target_lr": 0.002,
    "draft": {"layers": 1, "block_size": 7, "target_layers": [1, 3, 6], "markov_rank": 128, "confidence": True,
              "confidence_with_markov": True, "mask_token_id": None, "train_embeddings": False,
              "train_lm_head": False, "arch": None, "markov_head_type": "vanilla"},
    "draft_options": {"steps": 2000, "batch_size": 8, "seq_len": 256, "anchors": 32, "lr": 0.002,
                      "warmup_ratio": 0.04, "weight_decay": 0.0, "max_grad_norm": 1.0, "ce_alpha": 0.1,
                      "l1_alpha": 0.9, "confidence_alpha": 1.0, "decay_gamma": 4.0, "seed": 0, "save_every": 0},
    "distill_sequences": 2048, "distill_prompt_tokens": 32, "held_out_every": 25, "eval_prompts": 24,
    "eval_prompt_tokens": 48, "eval_new_tokens": 128, "seed": 0}
ATTENTION_TARGET_KEY = ["batch_size", "held_out_every", "lr", "python", "seed", "seq_len", "steps", "target",
                        "threads", "torch", "vocab_size"]

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''

MICRO_HYBRID = replace(
    HYBRID_RECIPE,
    target=HybridGeometry(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, full_attention_every=2,
                          linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                          linear_value_head_dim=16),
    target_steps=2, target_batch_size=2, target_seq_len=32,
    draft=DraftShape(layers=1, block_size=3, target_layers=(0,), markov_rank=8),
    draft_options=TrainOptions(steps=2, batch_size=2, seq_len=32, anchors=2, lr=1e-3),
    distill_sequences=4, distill_prompt_tokens=8, held_out_every=3, eval_prompts=2, eval_prompt_tokens=8,
    eval_new_tokens=8)


def test_the_attention_recipe_is_the_one_that_built_the_shipped_pair():
    recipe = DemoRecipe()
    assert json.loads(json.dumps(asdict(recipe))) == ATTENTION_RECIPE
    assert sorted(_target_key(recipe)) == ATTENTION_TARGET_KEY
    assert not recipe.hybrid and recipe.target.architecture == "Qwen3ForCausalLM"


def test_the_hybrid_geometry_builds_a_qwen3_5_target_three_linear_to_one_full():
    model = HYBRID_RECIPE.target.build(eos_token_id=0, seed=0)
    config = model.config
    assert type(model).__name__ == HYBRID_RECIPE.target.architecture == "Qwen3_5ForCausalLM"
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (config.hidden_size, config.linear_num_value_heads, config.vocab_size) == (256, 8, 1024)
    assert config.tie_word_embeddings and config.eos_token_id == 0
    assert HYBRID_RECIPE.hybrid and HYBRID_RECIPE.vocab_size == config.vocab_size


@pytest.fixture
def sources(tmp_path) -> list[Path]:
    files = []
    for i in range(6):
        files.append(tmp_path / "corpus" / f"m{i}.py")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_text(CODE.replace("Counter", f"Counter{i}") * (i + 2))
    return files


def test_a_hybrid_build_reuses_the_attention_tokenizer_and_resumes_from_its_stages(tmp_path, sources):
    if not (DEMO_DIR / "target" / "tokenizer.json").is_file():
        pytest.skip("the demo pair is not built (scripts/build_demo.py)")
    lines: list[str] = []
    first = build_demo(tmp_path / "out0", tmp_path / "work", MICRO_HYBRID, log=lines.append, sources=sources,
                       tokenizer_dir=DEMO_DIR / "target")
    assert (tmp_path / "out0/target/tokenizer.json").read_text() == (DEMO_DIR / "target/tokenizer.json").read_text()
    config = json.loads((tmp_path / "out0/target/config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["layer_types"] == ["linear_attention",
                                                                                        "full_attention"]
    assert (tmp_path / "work" / DRAFTS_STAGE_FILE).is_file()
    lines.clear()
    second = build_demo(tmp_path / "out1", tmp_path / "work", MICRO_HYBRID, log=lines.append, sources=sources,
                        tokenizer_dir=DEMO_DIR / "target")
    assert any(line.startswith("reusing the target") for line in lines)
    assert any(line.startswith("reusing the drafts") for line in lines)
    assert not any(line.startswith(("target step", "draft step")) for line in lines)  # nothing trained again
    fresh = build_demo(tmp_path / "out-fresh", tmp_path / "work-fresh", MICRO_HYBRID, log=lambda _: None,
                       sources=sources, tokenizer_dir=DEMO_DIR / "target")  # built again from nothing
    for name in ("target/model.safetensors", "draft/model.safetensors", "draft/config.json"):
        assert (tmp_path / "out0" / name).read_bytes() == (tmp_path / "out1" / name).read_bytes(), name
        assert (tmp_path / "out0" / name).read_bytes() == (tmp_path / "out-fresh" / name).read_bytes(), name
    assert [d.tau for d in fresh.drafts] == [d.tau for d in first.drafts]
    for stage in ("self-distillation data", "drafts"):  # cached: the time they took when they were built
        assert first.seconds[stage] == second.seconds[stage]
    assert [d.tau for d in first.drafts] == [d.tau for d in second.drafts]

    changed = replace(MICRO_HYBRID, draft_options=replace(MICRO_HYBRID.draft_options, steps=3))
    lines.clear()
    build_demo(tmp_path / "out2", tmp_path / "work", changed, log=lines.append, sources=sources,
               tokenizer_dir=DEMO_DIR / "target")
    assert any(line.startswith("reusing the target") for line in lines)  # the target's recipe did not change
    assert not any(line.startswith("reusing the drafts") for line in lines)  # the drafts' did

    card = model_card(first, MICRO_HYBRID)
    assert card.startswith("# dspark hybrid demo pair") and "Qwen3_5ForCausalLM: hidden 32, 2 layers" in card
    assert "short name, demo-hybrid" in card and "the attention demo pair's" in card
    assert "Goal for this pair: τ ≥ 3.0 at T = 0" in card


def test_a_tokenizer_of_another_size_is_refused(tmp_path, sources):
    if not (DEMO_DIR / "target" / "tokenizer.json").is_file():
        pytest.skip("the demo pair is not built (scripts/build_demo.py)")
    recipe = replace(MICRO_HYBRID, vocab_size=512)
    with pytest.raises(ValueError, match="the tokenizer has 1024 ids, the recipe wants 512"):
        build_demo(tmp_path / "out", tmp_path / "work", recipe, log=lambda _: None, sources=sources,
                   tokenizer_dir=DEMO_DIR / "target")
