"""`dspark quantize --scope draft --format fp8` on the shipped demo pair: ModelOpt's per-tensor FP8 bit for bit, the
calibrated static input scales, the configs vLLM reads, validate's FP8 rules, the runtime's W8A8 emulation, lossless
greedy decoding, and the acceptance guard (passes a faithful quantization, refuses a broken one)."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.measure.evaluation import read_prompt_set
from dspark_cli.runtime.model.draft_io import load_draft
from dspark_cli.runtime.pair import Pair
from dspark_cli.kernels import fp8
from dspark_cli.runtime.quantize import draft_scope

runner = CliRunner()
TARGET, DRAFT = DEMO_DIR / "target", DEMO_DIR / "draft"
LINEARS = [f"layers.0.self_attn.{p}_proj" for p in "qkvo"] + [f"layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
LINEARS.append("fc")
CALIBRATION_TOKENS = 8


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    """Two calibration prompts (code) and four held-out guard prompts (prose)."""
    root = tmp_path_factory.mktemp("fp8_prompts")
    code, prose = (read_prompt_set(DEMO_DIR / f"eval_{name}.jsonl").prompts for name in ("code", "prose"))
    (root / "calibration.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in code[:2]))
    (root / "guard.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prose[:4]))
    return root / "calibration.jsonl", root / "guard.jsonl"


def run_quantize_fp8(out, prompt_files, *extra):
    json_path = out.parent / f"{out.name}.json"
    result = runner.invoke(app, ["quantize", str(DRAFT), "-o", str(out), "--scope", "draft", "--format", "fp8",
                                 "--engine", "torch", "-t", str(TARGET), "--calibration", str(prompt_files[0]),
                                 "--calibration-tokens", str(CALIBRATION_TOKENS), "--json", str(json_path), *extra])
    return result, (json.loads(json_path.read_text()) if json_path.exists() else None)


@pytest.fixture(scope="module")
def written(prompt_files, tmp_path_factory):
    """The demo draft in FP8, q/k/v included: guarded with the lm_head excluded, and with its lm_head."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, extra in (("no_head", ["--qkv", "--guard-prompts", str(prompt_files[1]), "--guard-tokens", "16"]),
                        ("head", ["--qkv", "--lm-head"])):
        result, report = run_quantize_fp8(root / name, prompt_files, *extra)
        assert result.exit_code == 0, result.output
        out[name], out[f"{name}_report"] = root / name, report
    return out


def fused_with(module: str) -> list[str]:
    """The shards vLLM fuses `module` with (itself included)."""
    for fused in (("q", "k", "v"), ("gate", "up")):
        names = [module.rsplit(".", 1)[0] + f".{p}_proj" for p in fused]
        if module in names:
            return names
    return [module]


def tensors_of(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_fp8_is_modelopts_bit_for_bit_and_uses_the_whole_e4m3_range():
    weight = torch.randn(96, 80, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ours = fp8.quantize_fp8(weight)
    amax = float(weight.float().abs().max())
    assert float(ours.scale) == float(torch.tensor(amax, dtype=torch.float32) / 448.0)
    assert float(ours.data.float().abs().max()) == 448.0  # the largest weight lands on E4M3's largest code
    assert torch.equal(fp8.dequantize_fp8(ours).abs().max(), torch.tensor(amax))
    pytest.importorskip("modelopt")
    theirs = fp8.quantize_fp8_modelopt(weight)
    assert torch.equal(ours.data.view(torch.uint8), theirs.data.view(torch.uint8))
    assert torch.equal(ours.scale, theirs.scale)
    zero = fp8.quantize_fp8(torch.zeros(4, 8))
    assert float(zero.scale) == 1.0 and not zero.data.float().any()


def test_every_linear_layer_is_fp8_with_one_scale_per_fused_layer(written):
    source, quantized = tensors_of(DRAFT), tensors_of(written["no_head"])
    for module in LINEARS:
        assert quantized[f"{module}.weight"].dtype == torch.float8_e4m3fn
        assert quantized[f"{module}.weight"].shape == source[f"{module}.weight"].shape
        for scale in ("weight_scale", "input_scale"):
            assert quantized[f"{module}.{scale}"].dtype == torch.float32 and quantized[f"{module}.{scale}"].dim() == 0
    for fused in (("q", "k", "v"), ("gate", "up")):
        part = "self_attn" if fused[0] == "q" else "mlp"
        for scale in ("weight_scale", "input_scale"):
            assert len({float(quantized[f"layers.0.{part}.{p}_proj.{scale}"]) for p in fused}) == 1, (fused, scale)
    joint = torch.cat([source[f"layers.0.self_attn.{p}_proj.weight"].float() for p in "qkv"])
    assert float(quantized["layers.0.self_attn.q_proj.weight_scale"]) == float(joint.abs().max() / 448.0)
    untouched = set(source) - {f"{m}.weight" for m in LINEARS}
    assert "lm_head.weight" in untouched
    for name in untouched:
        assert torch.equal(quantized[name], source[name]), name
    with_head = tensors_of(written["head"])
    assert with_head["lm_head.weight"].dtype == torch.float8_e4m3fn and "lm_head.input_scale" in with_head


def test_configs_are_mixed_precision_fp8_as_modelopt_writes_them(written):
    config = json.loads((written["no_head"] / "config.json").read_text())["quantization_config"]
    legacy = json.loads((written["no_head"] / "hf_quant_config.json").read_text())
    layers = {f"model.{m}" for m in LINEARS}
    assert config["quantized_layers"] == {layer: {"quant_algo": "FP8"} for layer in layers}
    assert legacy["quantization"]["quantized_layers"] == config["quantized_layers"]
    assert config["config_groups"]["group_0"]["input_activations"] == {"dynamic": False, "num_bits": 8,
                                                                       "type": "float"}
    pytest.importorskip("modelopt")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    assert convert_hf_quant_config_format(legacy) == config


def test_input_scales_are_the_calibrated_input_range_over_448(written, prompt_files):
    """An independent observer on the unquantized pair, over the same calibration decoding: amax / 448 per layer
    (the shards of a fused layer share the largest)."""
    pair = Pair.load(TARGET, DRAFT, device="cpu", dtype="float32", temperature=0.0)
    seen = {}
    for module in LINEARS:
        pair.draft.get_submodule(module).register_forward_hook(
            lambda m, args, _, name=module: seen.__setitem__(name, max(seen.get(name, 0.0),
                                                                       float(args[0].abs().max()))))
    for prompt in read_prompt_set(prompt_files[0]).prompts:
        pair.generate(prompt, max_new_tokens=CALIBRATION_TOKENS)
    quantized = tensors_of(written["no_head"])
    for module in LINEARS:
        expected = max(seen[m] for m in fused_with(module)) / 448.0
        assert float(quantized[f"{module}.input_scale"]) == pytest.approx(expected, rel=1e-6), module


def test_the_runtime_runs_the_layers_as_vllms_w8a8(written):
    draft = load_draft(written["head"], dtype=torch.float32)
    quantized = tensors_of(written["head"])
    for module in ("layers.0.mlp.down_proj", "fc", "lm_head"):
        weight = fp8.FP8Weight(quantized[f"{module}.weight"], quantized[f"{module}.weight_scale"])
        layer = draft.get_submodule(module)
        assert torch.equal(layer.weight, fp8.dequantize_fp8(weight)), module
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
        x[0, 0] = 1e4  # beyond 448 * input_scale: clipped, as vLLM's static quantization clips it
        expected = torch.nn.functional.linear(fp8.fake_quantize_fp8(x, quantized[f"{module}.input_scale"]),
                                              fp8.dequantize_fp8(weight))
        assert torch.equal(layer(x), expected), module


def test_validate_is_clean_and_decoding_stays_lossless(written):
    for name in ("no_head", "head"):
        report = validate_checkpoint(open_checkpoint(written[name]), deep=True)
        assert report.errors == [] and report.resolved["quantized_linear_layers"] == {
            "fp8": len(LINEARS) + (name == "head")}
    pair = Pair.load(TARGET, written["head"], device="cpu", dtype="float32")
    for prompt in ("def parse(line):\n", "The river"):
        assert pair.generate(prompt, max_new_tokens=24).tokens == pair.baseline(prompt, max_new_tokens=24).tokens


def test_the_guard_passes_a_faithful_fp8_draft(written):
    guard = written["no_head_report"]["guard"]
    assert guard["passed"] and guard["prompts"] == 4
    assert guard["quantized"]["tau"] > 1.5 and abs(guard["tau_drop"]["estimate"]) <= 0.1


def test_the_guard_refuses_a_broken_quantization(prompt_files, tmp_path, monkeypatch):
    """Every FP8 code zero (valid scales): validate finds nothing, the draft proposes junk, τ falls to about 1."""
    faithful = fp8.quantize_fp8

    def broken(weight, scale=None):
        good = faithful(weight, scale)
        return fp8.FP8Weight(torch.zeros_like(good.data), good.scale)

    monkeypatch.setattr(draft_scope.fp8, "quantize_fp8", broken)
    guard = ["--guard-prompts", str(prompt_files[1]), "--guard-tokens", "16"]
    result, _ = run_quantize_fp8(tmp_path / "refused", prompt_files, *guard)
    assert result.exit_code == 2 and "lost too much acceptance" in result.output
    assert not (tmp_path / "refused").exists()
    result, report = run_quantize_fp8(tmp_path / "warned", prompt_files, *guard, "--guard-warn")
    assert result.exit_code == 0 and "acceptance guard failed" in result.output
    assert not report["guard"]["passed"] and report["guard"]["tau_drop"]["estimate"] > 0.5


def copy_with(folder, tmp_path, name, change_tensors=None, change_config=None):
    out = tmp_path / name
    shutil.copytree(folder, out)
    if change_tensors:
        tensors = tensors_of(folder)
        change_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    if change_config:
        for file in ("config.json", "hf_quant_config.json"):
            document = json.loads((out / file).read_text())
            change_config(document.get("quantization_config") or document["quantization"])
            (out / file).write_text(json.dumps(document))
    return out


@pytest.mark.parametrize("name, tensors, config, code", [
    ("no input_scale", lambda t: t.pop("fc.input_scale"), None, "DSP318"),
    ("per-channel weight_scale", lambda t: t.__setitem__(
        "fc.weight_scale", t["fc.weight_scale"].repeat(t["fc.weight"].shape[0])), None, "DSP317"),
    ("transposed", lambda t: t.__setitem__("fc.weight", t["fc.weight"].t().contiguous()), None, "DSP316"),
    ("not listed", None, lambda q: q["quantized_layers"].pop("model.fc"), "DSP319"),
    ("listed as NVFP4", None, lambda q: q["quantized_layers"].__setitem__(
        "model.fc", {"quant_algo": "W4A16_NVFP4", "group_size": 16}), "DSP319"),
    ("zero input_scale", lambda t: t.__setitem__("fc.input_scale", torch.tensor(0.0)), None, "DSP609"),
])
def test_validate_names_each_broken_fp8_layout(written, tmp_path, name, tensors, config, code):
    folder = copy_with(written["no_head"], tmp_path, "broken", tensors, config)
    report = validate_checkpoint(open_checkpoint(folder), deep=True)
    assert code in {f.code for f in report.errors}, (name, [(f.code, f.message) for f in report.findings])


def test_fp8_refusals(prompt_files, tmp_path):
    base = ["quantize", str(DRAFT), "-o", str(tmp_path / "x")]
    result = runner.invoke(app, [*base, "--scope", "draft", "--format", "fp8"])
    assert result.exit_code == 2 and "--target" in result.output and "--calibration" in result.output
    result = runner.invoke(app, [*base, "--format", "fp8"])
    assert result.exit_code == 2 and "--scope draft" in result.output
    result = runner.invoke(app, [*base, "--scope", "draft", "--calibration", str(prompt_files[0])])
    assert result.exit_code == 2 and "NVFP4 W4A16 needs none" in result.output
    result = runner.invoke(app, [*base, "--guard-prompts", str(prompt_files[1])])
    assert result.exit_code == 2 and "--target" in result.output
    assert not (tmp_path / "x").exists()
