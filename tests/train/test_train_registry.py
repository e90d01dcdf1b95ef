"""Training knows draft families only through the registry (checkpoint/families/): no family is named in train/'s
code, and a family registered there is picked by the train path without touching train/."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint import families
from dspark_cli.runtime.checkpoint.families import FAMILIES
from dspark_cli.runtime.checkpoint.target_config import TargetConfig
from dspark_cli.runtime.train import checks
from dspark_cli.runtime.train.new_draft import DraftShape, MaskChoice, draft_config_dict, draft_family

TRAIN = Path(checks.__file__).parent


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                   ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes
            if n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _code_words(path: Path) -> list[str]:
    """The string constants (docstrings left out) and identifiers of a module's code."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append(node.name)
        elif isinstance(node, ast.alias):
            words += [node.name, node.asname or ""]
    return words


def test_no_family_is_named_in_train_code():
    """Family names, architectures and target model types live in checkpoint/families/ alone."""
    needles = {needle for family in FAMILIES.values()
               for needle in (family.name, *family.architectures, *family.target_model_types)}
    assert {"qwen3", "gemma4", "Gemma4DSparkModel"} <= needles
    found = [(path.name, word, needle) for path in sorted(TRAIN.glob("*.py")) for word in _code_words(path)
             for needle in needles if needle in word]  # case-sensitive: the demo's Qwen3ForCausalLM is a target
    assert found == []


def _toy_config(target: TargetConfig, shape, target_layers, mask, anchors) -> dict:
    return {"architectures": ["ToyDSparkModel"], "model_type": "toy", "hidden_size": target.hidden_size,
            "num_hidden_layers": shape.layers, "target_layer_ids": list(target_layers),
            "mask_token_id": mask.token_id, "vocab_size": mask.vocab_size, "block_size": shape.block_size}


@pytest.fixture
def toy(monkeypatch):
    """A throwaway third family: the default draft of `toy` targets, and for them alone."""
    family = dataclasses.replace(FAMILIES["qwen3"], name="toy", architectures=("ToyDSparkModel",), title="Toy",
                                 draft_config=_toy_config, target_model_types=("toy", "toy_text"),
                                 needs_target="a Toy target (model_type toy)")
    monkeypatch.setitem(families.FAMILIES, "toy", family)
    return family


TOY_TARGET = {"model_type": "toy", "text_config": {"model_type": "toy_text", "vocab_size": 300, "hidden_size": 32,
                                                   "num_hidden_layers": 4}}
QWEN_TARGET = {"model_type": "qwen3", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64}


def test_a_registered_family_is_the_default_for_its_targets(toy):
    assert draft_family(TargetConfig.from_dict(TOY_TARGET), None) is toy
    config = draft_config_dict(TOY_TARGET, DraftShape(layers=1, block_size=4), [0, 2], MaskChoice(5, 300, ""), 4)
    assert config["architectures"] == ["ToyDSparkModel"] and config["hidden_size"] == 32
    assert draft_family(TargetConfig.from_dict(QWEN_TARGET), None).name == "qwen3"
    assert families.family_for(["ToyDSparkModel"]) is toy


def test_a_registered_family_is_a_draft_arch_choice_and_refuses_other_targets(toy):
    with pytest.raises(DsparkError, match="choose auto, qwen3, gemma4, dflash2, toy"):
        draft_family(TargetConfig.from_dict(QWEN_TARGET), "llama")
    with pytest.raises(DsparkError, match=r"the draft-arch option toy needs a Toy target \(model_type toy\); this target's "
                                          "model_type is 'qwen3'"):
        draft_family(TargetConfig.from_dict(QWEN_TARGET), "toy")
    assert draft_family(TargetConfig.from_dict(TOY_TARGET), "qwen3").name == "qwen3"  # Qwen3 drafts for any target


def test_a_resumed_checkpoint_of_a_registered_family_keeps_it(toy, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["ToyDSparkModel"], "num_hidden_layers": 1}')
    assert checks.checkpoint_shape(tmp_path).arch == "toy"


@pytest.mark.parametrize("model_type", ["gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"])
def test_gemma4_targets_default_to_the_gemma4_family(model_type):
    assert draft_family(TargetConfig.from_dict({"model_type": model_type}), None).name == "gemma4"
