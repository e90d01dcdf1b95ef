"""`dspark train` builds Gemma-4 drafts (`--draft-arch`, auto from a Gemma-4 target) and gated / RNN heads
(`--markov-head-type`); what it writes then validates, generates losslessly, evaluates, quantizes and yields a
`serve --dry-run` command, all through the Typer app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_factory import DraftSpec, tiny_target
from pair_factory import write_byte_tokenizer
from safetensors import safe_open
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.pair import Pair

runner = CliRunner()
CODE = "def add(a, b):\n    return a + b\n\n\nclass Counter:\n    def increment(self, step=1):\n        return step\n"
RUN = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--anchors", "6", "--block-size", "4",
       "--markov-rank", "16", "--mask-token-id", "250", "--device", "cpu"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train_families")
    out = {}
    specs = {"gemma4": DraftSpec(family="gemma4", target_layers=4), "qwen3": DraftSpec(target_layers=4),
             "gemma4-kv": DraftSpec(family="gemma4", target_layers=4, attention_k_eq_v=False)}
    for name, spec in specs.items():
        target = tiny_target(root / name, spec)
        write_byte_tokenizer(target)
        out[name] = target
    (root / "code.py").write_text(CODE * 8)
    out["data"] = root / "code.py"
    return out


@pytest.fixture(scope="module")
def trained(targets, tmp_path_factory) -> dict[str, Path]:
    """name -> a trained draft folder."""
    root = tmp_path_factory.mktemp("drafts")
    runs = {"gemma4": ("gemma4", []), "gemma4-rnn": ("gemma4", ["--markov-head-type", "rnn"]),
            "qwen3-gated": ("qwen3", ["--markov-head-type", "gated"]),
            "gemma4-kv": ("gemma4-kv", ["--engine", "vllm"])}
    out = {}
    for name, (family, extra) in runs.items():
        result = runner.invoke(app, ["train", "--target", str(targets[family]), "--data", str(targets["data"]),
                                     "-o", str(root / name), *RUN, *extra])
        assert result.exit_code == 0, result.output
        out[name] = root / name
    return out


def _report(draft: Path, target: Path):
    return validate_checkpoint(open_checkpoint(draft), json.loads((target / "config.json").read_text()))


def test_a_gemma4_target_without_k_eq_v_gets_a_draft_vllm_serves(targets, trained):
    """vLLM's Gemma-4 DSpark model asserts uniform attention_k_eq_v layers (DSP041): train writes k=v attention
    for a target with separate values too, and `--engine vllm` ends with exit 0 only when vLLM's rules accept."""
    assert json.loads((targets["gemma4-kv"] / "config.json").read_text())["attention_k_eq_v"] is False
    config = json.loads((trained["gemma4-kv"] / "config.json").read_text())
    assert config["attention_k_eq_v"] is True
    with safe_open(str(trained["gemma4-kv"] / "model.safetensors"), "pt") as f:
        assert not any(name.endswith("v_proj.weight") for name in f.keys())
    assert "DSP041" not in _report(trained["gemma4-kv"], targets["gemma4-kv"]).codes


def test_a_gemma4_target_gets_a_gemma4_draft_that_validates(targets, trained):
    config = json.loads((trained["gemma4"] / "config.json").read_text())
    assert config["architectures"] == ["Gemma4DSparkModel"] and config["model_type"] == "gemma4_text"
    assert (config["global_head_dim"], config["num_global_key_value_heads"]) == (32, 1)
    assert "per_layer_config" not in config and config["layer_types"] == ["full_attention"]
    with safe_open(str(trained["gemma4"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"embed_tokens.weight", "lm_head.weight", "layers.0.layer_scalar"} <= names  # vLLM shares nothing
    assert "layers.0.self_attn.v_proj.weight" not in names  # attention_k_eq_v
    assert _report(trained["gemma4"], targets["gemma4"]).errors == []


@pytest.mark.parametrize("name", ["gemma4", "gemma4-rnn", "qwen3-gated"])
def test_trained_drafts_generate_losslessly(targets, trained, name):
    family = name.split("-")[0]
    for markov, k in (("dense", None), ("topk", 8)):
        pair = Pair.load(targets[family], trained[name], device="cpu", dtype="float32", markov=markov, draft_topk=k)
        result = pair.generate("def add(a", max_new_tokens=20)
        assert result.tokens == pair.baseline("def add(a", max_new_tokens=20).tokens
    head = json.loads((trained[name] / "config.json").read_text())["markov_head_type"]
    assert head == {"gemma4": "vanilla", "gemma4-rnn": "rnn", "qwen3-gated": "gated"}[name]
    assert pair.draft.markov_head.type_name == head


def test_gated_and_rnn_drafts_keep_dsp012_but_run(targets, trained):
    for name, family in (("gemma4-rnn", "gemma4"), ("qwen3-gated", "qwen3")):
        assert [f.code for f in _report(trained[name], targets[family]).errors] == ["DSP012"]
    result = runner.invoke(app, ["serve", "--target", str(targets["gemma4"]), "--draft", str(trained["gemma4-rnn"]),
                                 "--dry-run"])
    assert result.exit_code == 1 and "DSP012" in result.output


def test_a_gated_head_quantizes_and_its_nvfp4_walk_is_lossless(targets, trained, tmp_path):
    quantized = tmp_path / "q"
    result = runner.invoke(app, ["quantize", str(trained["qwen3-gated"]), "-o", str(quantized), "--engine", "torch"])
    assert result.exit_code == 0, result.output
    assert [f.code for f in _report(quantized, targets["qwen3"]).errors] == ["DSP012"]
    pair = Pair.load(targets["qwen3"], quantized, device="cpu", dtype="float32", markov="auto", draft_topk=8)
    assert pair.settings.markov == "nvfp4" and pair.draft.w2_nvfp4 is not None
    assert pair.generate("class C", max_new_tokens=16).tokens == pair.baseline("class C", max_new_tokens=16).tokens


def test_a_trained_gemma4_draft_evaluates_quantizes_and_serves(targets, trained, tmp_path):
    target, draft = targets["gemma4"], trained["gemma4"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("def add(a, b):", "class Counter:")))
    result = runner.invoke(app, ["eval", "--target", str(target), "--draft", str(draft), "--data", str(prompts),
                                 "--max-new-tokens", "12", "--dtype", "float32", "--json", str(tmp_path / "e.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "e.json").read_text())
    quantized = tmp_path / "q"
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(quantized), "--engine", "torch"])
    assert result.exit_code == 0, result.output
    assert _report(quantized, target).errors == []
    pair = Pair.load(target, quantized, device="cpu", dtype="float32", markov="nvfp4", draft_topk=8)
    assert pair.draft.w2_nvfp4 is not None
    assert pair.generate("def add(a", max_new_tokens=16).tokens == pair.baseline("def add(a", max_new_tokens=16).tokens
    result = runner.invoke(app, ["serve", "--target", str(target), "--draft", str(quantized), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "vllm serve" in result.output and '"method": "dspark"' in result.output


def test_draft_arch_refusals(targets, tmp_path):
    for args, needle in ((["--draft-arch", "gemma4"], "needs a Gemma-4 target"),
                         (["--draft-arch", "llama"], "is not a draft family"),
                         (["--markov-head-type", "fir"], "is not a head type")):
        result = runner.invoke(app, ["train", "--target", str(targets["qwen3"]), "--data", str(targets["data"]),
                                     "-o", str(tmp_path / "x"), *RUN, *args])
        assert result.exit_code == 2, result.output
        assert needle in " ".join(result.output.split())
        assert not (tmp_path / "x").exists()


def test_no_free_mask_id_is_refused_for_gemma4(targets, tmp_path):
    args = [a for a in RUN if a not in ("--mask-token-id", "250")]
    result = runner.invoke(app, ["train", "--target", str(targets["gemma4"]), "--data", str(targets["data"]),
                                 "-o", str(tmp_path / "x"), *args])
    assert result.exit_code == 2 and "pass --mask-token-id" in " ".join(result.output.split())
    assert not (tmp_path / "x").exists()


def test_a_gemma4_rnn_run_resumes_and_refuses_another_family_or_head(targets, tmp_path):
    base = ["train", "--target", str(targets["gemma4"]), "--data", str(targets["data"]), "-o", str(tmp_path / "r")]
    first = runner.invoke(app, [*base, *RUN, "--markov-head-type", "rnn", "--save-every", "1"])
    assert first.exit_code == 0, first.output
    run = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--anchors", "6", "--device", "cpu",
           "--resume", str(tmp_path / "r" / "checkpoint-1")]
    for extra, needle in ((["--draft-arch", "qwen3"], "is a gemma4 draft"),
                          (["--markov-head-type", "gated"], "markov_head_type is 'rnn'")):
        result = runner.invoke(app, [*base, *run, *extra])
        assert result.exit_code == 2 and needle in " ".join(result.output.split()), result.output
    resumed = runner.invoke(app, [*base, *run])
    assert resumed.exit_code == 0, resumed.output
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (config["architectures"], config["markov_head_type"]) == (["Gemma4DSparkModel"], "rnn")


def test_a_multimodal_gemma4_target_trains_from_its_text_config(targets, tmp_path):
    """gemma-4-12B-it is a Gemma4ForConditionalGeneration (model_type gemma4): the draft is built from its
    text_config, as DeepSpec's get_gemma4_text_config does."""
    from transformers import AutoModelForCausalLM, Gemma4Config, Gemma4TextConfig

    from ckpt_factory import gemma4_text_config

    text = {k: v for k, v in gemma4_text_config(DraftSpec(family="gemma4"), 4).items() if k != "model_type"}
    target = tmp_path / "target"
    model = AutoModelForCausalLM.from_config(Gemma4Config(text_config=Gemma4TextConfig(**text), vision_config=None,
                                                          audio_config=None))
    model.save_pretrained(target)
    write_byte_tokenizer(target)
    result = runner.invoke(app, ["train", "--target", str(target), "--data", str(targets["data"]),
                                 "-o", str(tmp_path / "d"), *RUN])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (config["architectures"], config["target_model_type"], config["model_type"]) == (
        ["Gemma4DSparkModel"], "gemma4", "gemma4_text")
    assert _report(tmp_path / "d", target).errors == []
    pair = Pair.load(target, tmp_path / "d", device="cpu", dtype="float32")
    assert pair.generate("def add(a", max_new_tokens=12).tokens == pair.baseline("def add(a", max_new_tokens=12).tokens


# Gemma-4 variants transformers builds whose settings belong to the target alone: per-layer inputs (E2B / E4B, here
# with attention_k_eq_v false as those have), MoE blocks (26B-A4B), KV sharing (E2B / E4B's last layers) with the
# double-wide MLPs of the sharing layers.
GEMMA4_VARIANTS = {
    "per-layer-inputs": {"hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
                         "attention_k_eq_v": False},
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    "kv-shared": {"num_kv_shared_layers": 2, "use_double_wide_mlp": True},
}


@pytest.mark.parametrize("variant", GEMMA4_VARIANTS)
def test_every_gemma4_variant_gets_a_draft_validate_vllm_and_generate_accept(targets, tmp_path, variant):
    """train writes the target-only settings off in the draft's config (DSP045 passes); validate and vLLM's verdict
    accept the draft; generate is lossless, also on a KV-sharing target whose captured layer shares K/V (its
    hidden states must span the whole prompt)."""
    import torch
    from ckpt_factory import target_config
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from dspark_cli.runtime.engines import engine

    config = {**target_config(DraftSpec(family="gemma4", target_layers=4)), **GEMMA4_VARIANTS[variant]}
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{k: v for k, v in config.items()
                                                  if k not in ("architectures", "model_type")}))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    target, draft = tmp_path / "target", tmp_path / "draft"
    model.save_pretrained(target)
    write_byte_tokenizer(target)
    result = runner.invoke(app, ["train", "--target", str(target), "--data", str(targets["data"]), "-o", str(draft),
                                 *RUN, "--target-layers", "2"])
    assert result.exit_code == 0, result.output
    written = json.loads((draft / "config.json").read_text())
    assert {k: written[k] for k in ("hidden_size_per_layer_input", "enable_moe_block", "num_kv_shared_layers",
                                    "use_double_wide_mlp", "attention_k_eq_v")} == {
        "hidden_size_per_layer_input": 0, "enable_moe_block": False, "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False, "attention_k_eq_v": True}
    assert not {"vocab_size_per_layer_input", "num_experts", "top_k_experts", "moe_intermediate_size"} & set(written)
    report = _report(draft, target)
    assert report.errors == [] and engine("vllm").verdict(report, None).refused == []
    pair = Pair.load(target, draft, device="cpu", dtype="float32")
    assert pair.generate("def add(a", max_new_tokens=12).tokens == pair.baseline("def add(a", max_new_tokens=12).tokens
