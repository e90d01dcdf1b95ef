"""`dspark quantize --scope draft`: which layers become NVFP4 W4A16 (lm_head only when asked), the configs vLLM reads,
validate, a shared global scale per fused layer, dequantization at load, and lossless greedy decoding (float32)."""

import json

import pytest
import torch
from ckpt_factory import DraftSpec
from pair_factory import bigram_draft, bigram_target, write_byte_tokenizer
from safetensors import safe_open
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.pair import Pair

SPEC = DraftSpec(block_size=8, markov_rank=64)
runner = CliRunner()


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize_draft")
    target = bigram_target(root / "target", SPEC)
    write_byte_tokenizer(target)
    return target, bigram_draft(root / "draft", SPEC, target)


@pytest.fixture(scope="module")
def quantized(pair_dirs, tmp_path_factory):
    """The draft quantized twice through the CLI, q/k/v included: lm_head excluded (the default) and included."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, extra in (("no_head", ["--qkv"]), ("head", ["--qkv", "--lm-head"])):
        json_path = root / f"{name}.json"
        result = runner.invoke(app, ["quantize", str(pair_dirs[1]), "-o", str(root / name), "--scope", "draft",
                                     "--engine", "torch", "--json", str(json_path), *extra])
        assert result.exit_code == 0, result.output
        out[name] = root / name
        out[f"{name}_report"] = json.loads(json_path.read_text())
    return out


def tensors_of(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_linear_layers_are_nvfp4_and_the_rest_is_untouched(pair_dirs, quantized):
    source, written = tensors_of(pair_dirs[1]), tensors_of(quantized["no_head"])
    linears = [n for n in source if n.endswith("_proj.weight") or n == "fc.weight"]
    assert len(linears) == 2 * 7 + 1  # q/k/v/o, gate/up/down per layer, fc
    for name in linears:
        module = name.removesuffix(".weight")
        assert written[name].dtype == torch.uint8 and written[name].shape[1] * 2 == source[name].shape[1]
        assert written[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert written[f"{module}.weight_scale_2"].dtype == torch.float32
    for name in set(source) - set(linears):  # norms, embeddings, lm_head, Markov and confidence heads
        assert torch.equal(written[name], source[name]), name
    config = json.loads((quantized["no_head"] / "config.json").read_text())["quantization_config"]
    legacy = json.loads((quantized["no_head"] / "hf_quant_config.json").read_text())["quantization"]
    layers = {f"model.{n.removesuffix('.weight')}" for n in linears}
    assert set(config["quantized_layers"]) == layers == set(legacy["quantized_layers"])
    assert config["quant_method"] == "modelopt" and config["quant_algo"] == "MIXED_PRECISION"
    assert {e["quant_algo"] for e in config["quantized_layers"].values()} == {"W4A16_NVFP4"}
    assert quantized["no_head_report"]["lm_head"] is False


def test_the_lm_head_is_quantized_only_when_asked(quantized):
    assert tensors_of(quantized["no_head"])["lm_head.weight"].dtype != torch.uint8
    assert "lm_head" not in json.loads((quantized["no_head"] / "config.json").read_text())[
        "quantization_config"]["quantized_layers"]
    with_head = tensors_of(quantized["head"])
    assert with_head["lm_head.weight"].dtype == torch.uint8 and "lm_head.weight_scale_2" in with_head
    assert "lm_head" in json.loads((quantized["head"] / "config.json").read_text())["quantization_config"][
        "quantized_layers"]


def test_by_default_qkv_and_the_lm_head_stay_bf16_and_the_engines_are_named(pair_dirs, tmp_path):
    """vLLM refuses quantized q/k/v (DSP731) and a quantized lm_head (DSP732): the default leaves both out, and
    asking for them says which engines refuse the result."""
    json_path = tmp_path / "report.json"
    result = runner.invoke(app, ["quantize", str(pair_dirs[1]), "-o", str(tmp_path / "out"), "--scope", "draft",
                                 "--engine", "torch", "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    written, report = tensors_of(tmp_path / "out"), json.loads(json_path.read_text())
    source = tensors_of(pair_dirs[1])
    for name in ("layers.0.self_attn.q_proj.weight", "layers.1.self_attn.v_proj.weight", "lm_head.weight"):
        assert torch.equal(written[name], source[name]), name
    assert written["layers.0.self_attn.o_proj.weight"].dtype == torch.uint8 and written["fc.weight"].dtype == torch.uint8
    assert report["qkv"] is False and report["warnings"] == []
    assert not any("q_proj" in layer or "lm_head" in layer for layer in report["quantized_layers"])
    result = runner.invoke(app, ["quantize", str(pair_dirs[1]), "-o", str(tmp_path / "all"), "--scope", "draft",
                                 "--engine", "torch", "--qkv", "--lm-head"])
    assert result.exit_code == 0 and "DSP731" in result.output and "DSP732" in result.output


def test_fused_shards_share_one_global_scale(quantized):
    written = tensors_of(quantized["no_head"])
    for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        scales = {float(written[f"layers.0.{'self_attn' if 'q' in fused[0] else 'mlp'}.{p}.weight_scale_2"])
                  for p in fused}
        assert len(scales) == 1, fused


def test_validate_is_clean_and_the_weights_dequantize_at_load(pair_dirs, quantized):
    for name in ("no_head", "head"):
        assert validate_checkpoint(open_checkpoint(quantized[name])).errors == []
    draft = load_draft(quantized["head"], dtype=torch.float32)
    written = tensors_of(quantized["head"])
    for module in ("layers.1.mlp.down_proj", "fc", "lm_head"):
        weight = NVFP4Weight(written[f"{module}.weight"], written[f"{module}.weight_scale"],
                             written[f"{module}.weight_scale_2"])
        loaded = dict(draft.named_parameters())[f"{module}.weight"]
        assert torch.equal(loaded, dequantize_nvfp4(weight, torch.float32)), module
    original = load_draft(pair_dirs[1], dtype=torch.float32)
    error = (draft.fc.weight - original.fc.weight).norm() / original.fc.weight.norm()
    assert 0 < error < 0.2


def test_a_quantized_draft_decodes_losslessly(pair_dirs, quantized):
    target, _ = pair_dirs
    for name in ("no_head", "head"):
        pair = Pair.load(target, quantized[name], device="cpu", dtype="float32")
        prompt = "def add(a"
        assert pair.generate(prompt, max_new_tokens=24).tokens == pair.baseline(prompt, max_new_tokens=24).tokens


def test_refusals(pair_dirs, quantized, tmp_path):
    result = runner.invoke(app, ["quantize", str(quantized["no_head"]), "-o", str(tmp_path / "a"), "--scope", "draft"])
    assert result.exit_code == 2 and "already quantized" in result.output
    result = runner.invoke(app, ["quantize", str(pair_dirs[1]), "-o", str(tmp_path / "b"), "--lm-head"])
    assert result.exit_code == 2 and "--scope draft" in result.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
