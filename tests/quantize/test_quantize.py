"""`dspark quantize`: written files, quant configs, refusals, atomicity and the CLI (tiny fixture checkpoints)."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_factory import DraftSpec, draft_tensors, drop, replace_tensor, write_draft
from safetensors import safe_open
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, quantize_nvfp4
from dspark_cli.runtime.quantize import write as quantize_module
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_safetensors_header
from dspark_cli.runtime.quantize.write import (
    MARKOV_W2,
    MARKOV_W2_GLOBAL_SCALE,
    MARKOV_W2_SCALE,
    bias_agreement,
    quant_configs,
    quantize_checkpoint,
    weight_error,
)
from dspark_cli.runtime.checkpoint.rules import validate_checkpoint

SPEC = DraftSpec(markov_rank=64)
NEW_TENSORS = (MARKOV_W2, MARKOV_W2_SCALE, MARKOV_W2_GLOBAL_SCALE)


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by name, read with safetensors."""
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def folder_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def raise_interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.fixture
def draft(tmp_path):
    path = write_draft(tmp_path / "draft", SPEC)
    (path / "tokenizer.json").write_text('{"model": "tiny"}')
    (path / "extra").mkdir()
    (path / "extra" / "notes.txt").write_text("kept as is")
    return path


# --- what is written --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
def test_output_holds_nvfp4_head_and_unchanged_tensors(tmp_path, shards):
    source = write_draft(tmp_path / "draft", SPEC, shards=shards)
    report = quantize_checkpoint(source, tmp_path / "out", engine="torch")
    out = tmp_path / "out"
    written, original = load_all(out), draft_tensors(SPEC)

    vd, r = SPEC.vd, SPEC.markov_rank
    assert written[MARKOV_W2].dtype == torch.uint8 and written[MARKOV_W2].shape == (vd, r // 2)
    assert written[MARKOV_W2_SCALE].dtype == torch.float8_e4m3fn and written[MARKOV_W2_SCALE].shape == (vd, r // 16)
    assert written[MARKOV_W2_GLOBAL_SCALE].dtype == torch.float32 and written[MARKOV_W2_GLOBAL_SCALE].shape == ()
    expected = quantize_nvfp4(original[MARKOV_W2])
    assert same_bits(written[MARKOV_W2], expected.packed)
    assert same_bits(written[MARKOV_W2_SCALE], expected.scale)
    assert same_bits(written[MARKOV_W2_GLOBAL_SCALE], expected.global_scale)
    assert set(written) == set(original) | set(NEW_TENSORS)
    for name, tensor in original.items():
        if name != MARKOV_W2:
            assert same_bits(written[name], tensor), name

    assert report.shape == (vd, r) and report.source_dtype == "BF16" and report.engine == "torch"
    assert report.bytes_before == vd * r * 2
    assert report.bytes_after == vd * r // 2 + vd * r // 16 + 4
    assert report.compression_ratio == pytest.approx(report.bytes_before / report.bytes_after)
    assert 0.05 < report.relative_frobenius_error < 0.15 and report.cosine > 0.99  # NVFP4 on Gaussian weights
    assert report.bias is not None and report.bias.rows == quantize_module.DEFAULT_SAMPLE_ROWS
    assert not report.all_zero and report.warnings == []
    json.dumps(report.to_dict())  # JSON-ready


def test_sharded_output_links_other_shards_and_updates_index(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC, shards=3)
    report = quantize_checkpoint(source, tmp_path / "out", engine="torch")
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    old_index = json.loads((source / "model.safetensors.index.json").read_text())
    w2_shard = old_index["weight_map"][MARKOV_W2]

    assert report.rewritten_shard == w2_shard
    assert all(index["weight_map"][name] == w2_shard for name in NEW_TENSORS)
    assert {k: v for k, v in index["weight_map"].items() if k not in NEW_TENSORS} == {
        k: v for k, v in old_index["weight_map"].items() if k != MARKOV_W2
    }
    headers = [read_safetensors_header(p)[0] for p in out.glob("*.safetensors")]
    assert index["metadata"]["total_size"] == sum(info.nbytes for h in headers for info in h.values())
    assert sorted(report.linked_files) == sorted(set(old_index["weight_map"].values()) - {w2_shard})
    for name in report.linked_files:
        assert os.stat(out / name).st_ino == os.stat(source / name).st_ino
    assert open_checkpoint(out).tensors[MARKOV_W2].file == w2_shard


def test_rewritten_shard_keeps_metadata_and_alignment(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC)
    quantize_checkpoint(source, tmp_path / "out", engine="torch")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    header, metadata = read_safetensors_header(tmp_path / "out" / "model.safetensors")
    assert metadata == {"format": "pt"}
    for info in header.values():
        element = info.nbytes // max(info.numel, 1)
        assert info.begin % element == 0, info.name


def test_configs_and_other_files(draft, tmp_path):
    quantize_checkpoint(draft, tmp_path / "out", engine="torch")
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    original = json.loads((draft / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == original

    layer = {"model.markov_head.markov_w2": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}
    quant = config["quantization_config"]
    assert quant["quant_method"] == "modelopt" and quant["quant_algo"] == "MIXED_PRECISION"
    assert quant["quantized_layers"] == layer and quant["ignore"] == []
    assert quant["config_groups"] == {"group_0": {
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "targets": ["model.markov_head.markov_w2"],
    }}
    legacy = json.loads((out / "hf_quant_config.json").read_text())
    assert legacy["producer"]["name"] == "modelopt"
    assert legacy["quantization"] == {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                      "exclude_modules": [], "quantized_layers": layer}
    assert (out / "tokenizer.json").read_text() == '{"model": "tiny"}'
    assert (out / "extra" / "notes.txt").read_text() == "kept as is"


def test_config_json_form_is_modelopts_conversion_of_the_legacy_form():
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config").convert_hf_quant_config_format
    hf_quant_config, quantization_config = quant_configs()
    assert convert(hf_quant_config) == quantization_config


def test_engines_write_identical_bytes(tmp_path):
    pytest.importorskip("modelopt.torch.quantization.qtensor")
    source = write_draft(tmp_path / "draft", SPEC.with_(vocab_size=512, seed=3))
    quantize_checkpoint(source, tmp_path / "torch", engine="torch")
    quantize_checkpoint(source, tmp_path / "modelopt", engine="modelopt")
    by_torch, by_modelopt = load_all(tmp_path / "torch"), load_all(tmp_path / "modelopt")
    for name in NEW_TENSORS:
        assert same_bits(by_torch[name], by_modelopt[name]), name
    assert (tmp_path / "torch" / "model.safetensors").read_bytes() == (
        tmp_path / "modelopt" / "model.safetensors"
    ).read_bytes()


def test_all_zero_head_dequantizes_to_zeros(tmp_path):
    zeros = torch.zeros(SPEC.vd, SPEC.markov_rank, dtype=torch.bfloat16)
    source = write_draft(tmp_path / "draft", SPEC, mutate=replace_tensor(MARKOV_W2, zeros))
    report = quantize_checkpoint(source, tmp_path / "out", engine="torch")
    written = load_all(tmp_path / "out")
    weight = NVFP4Weight(written[MARKOV_W2], written[MARKOV_W2_SCALE], written[MARKOV_W2_GLOBAL_SCALE])
    assert not weight.packed.any()
    assert torch.equal(weight.scale.float(), torch.ones(SPEC.vd, SPEC.markov_rank // 16))
    assert weight.global_scale.item() == 1.0
    assert torch.equal(dequantize_nvfp4(weight), torch.zeros(SPEC.vd, SPEC.markov_rank))
    assert report.all_zero and report.relative_frobenius_error == 0.0 and report.cosine == 1.0
    assert any("all zeros" in w for w in report.warnings)


def test_rank_not_multiple_of_64_warns(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC.with_(markov_rank=48))
    report = quantize_checkpoint(source, tmp_path / "out", engine="torch")
    assert any("multiple of 64" in w for w in report.warnings)
    assert load_all(tmp_path / "out")[MARKOV_W2_SCALE].shape == (SPEC.vd, 3)


# --- the figures --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("screen", [torch.bfloat16, torch.float32])  # whichever matmul is faster on the CPU
def test_figures_match_a_direct_computation(monkeypatch, screen):
    monkeypatch.setattr(quantize_module, "_ERROR_CHUNK_ROWS", 100)
    monkeypatch.setattr(quantize_module, "_BIAS_CHUNK_ROWS", 7)
    monkeypatch.setattr(quantize_module, "fast_matmul_dtype", lambda: screen)
    gen = torch.Generator().manual_seed(1)
    w2 = torch.randn(300, 32, generator=gen).bfloat16()
    embeds = torch.randn(50, 32, generator=gen).bfloat16().float()
    weight = quantize_nvfp4(w2)
    approx, exact = dequantize_nvfp4(weight).double(), w2.double()

    error, approx_bf16 = weight_error(w2, weight)
    assert torch.equal(approx_bf16, approx.bfloat16())
    assert error.relative_frobenius == pytest.approx(float((approx - exact).norm() / exact.norm()), rel=1e-5)
    a, b = approx.flatten(), exact.flatten()
    assert error.cosine == pytest.approx(float(a @ b / (a.norm() * b.norm())), rel=1e-6)
    assert error.max_abs == float((approx - exact).abs().max())

    agreement = bias_agreement(embeds, w2, weight, approx_bf16)
    reference, quantized = embeds.double() @ exact.T, embeds.double() @ approx.T  # [50, 300], exact
    top_ref, top_q = reference.topk(16).indices, quantized.topk(16).indices
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_ref, top_q)) / (16 * 50)
    assert agreement.rows == 50
    assert agreement.top1_agreement == int((reference.argmax(-1) == quantized.argmax(-1)).sum()) / 50
    assert agreement.top16_overlap == pytest.approx(overlap)
    rel = float((quantized - reference).norm() / reference.norm())
    assert agreement.relative_error == pytest.approx(rel, rel=1e-2)  # from the screen biases
    assert 0.5 < agreement.top1_agreement < 1 and 0.05 < agreement.relative_error < 0.15  # NVFP4 visibly moves it


def test_bias_sample_is_seeded_and_capped(draft, tmp_path):
    small = quantize_checkpoint(draft, tmp_path / "a", engine="torch", sample_rows=40)
    again = quantize_checkpoint(draft, tmp_path / "b", engine="torch", sample_rows=40)
    skipped = quantize_checkpoint(draft, tmp_path / "c", engine="torch", sample_rows=0)
    everything = quantize_checkpoint(draft, tmp_path / "d", engine="torch", sample_rows=10_000)
    assert small.bias.rows == 40 and small.bias == again.bias
    assert skipped.bias is None
    assert everything.bias.rows == SPEC.vocab_size


# --- refusals -----------------------------------------------------------------------------------------------------


def nan_head(spec):
    w2 = draft_tensors(spec)[MARKOV_W2].clone()
    w2[3, 5] = float("nan")
    return w2


def inf_head(spec):
    w2 = draft_tensors(spec)[MARKOV_W2].clone()
    w2[0, 0] = float("inf")
    return w2


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        (SPEC, dict(mutate=replace_tensor(MARKOV_W2, nan_head(SPEC))), "NaN or Inf"),
        (SPEC, dict(mutate=replace_tensor(MARKOV_W2, inf_head(SPEC))), "NaN or Inf"),
        (SPEC.with_(markov_rank=40), {}, "not a multiple of the NVFP4 group size 16"),
        (SPEC, dict(mutate=drop(MARKOV_W2)), "has no tensor 'markov_head.markov_w2.weight'"),
        (SPEC, dict(mutate=replace_tensor(MARKOV_W2_SCALE, torch.ones(256, 4))), "already holds an NVFP4"),
        (SPEC, dict(mutate=replace_tensor(MARKOV_W2, torch.zeros(256, 32, dtype=torch.uint8))), "already holds"),
        (SPEC, dict(edit={"quantization_config": {"quant_method": "modelopt"}}), "already quantized"),
        (SPEC, dict(mutate=replace_tensor(MARKOV_W2, torch.ones(256, 64, dtype=torch.int32))), "2-D float"),
    ],
    ids=["nan", "inf", "rank-40", "missing", "weight_scale", "uint8-weight", "quantization_config", "int-weight"],
)
def test_refusals(tmp_path, spec, kwargs, message):
    source = write_draft(tmp_path / "draft", spec, **kwargs)
    before = folder_digest(source)
    with pytest.raises(DsparkError, match=message) as error:
        quantize_checkpoint(source, tmp_path / "out", engine="torch")
    assert error.value.exit_code == 2
    assert not (tmp_path / "out").exists() and folder_digest(source) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_modelopt_engine_without_modelopt_points_to_torch(draft, tmp_path, monkeypatch):
    from dspark_cli.kernels import nvfp4

    def missing(w):
        raise ImportError("No module named 'modelopt'")

    monkeypatch.setattr(nvfp4, "quantize_nvfp4_modelopt", missing)
    with pytest.raises(DsparkError, match="the engine option torch") as error:
        quantize_checkpoint(draft, tmp_path / "out", engine="modelopt")
    assert error.value.exit_code == 2 and not (tmp_path / "out").exists()


def test_refuses_quantizing_its_own_output(draft, tmp_path):
    quantize_checkpoint(draft, tmp_path / "once", engine="torch")
    with pytest.raises(DsparkError, match="already"):
        quantize_checkpoint(tmp_path / "once", tmp_path / "twice", engine="torch")


def test_refuses_legacy_quant_config_file(draft, tmp_path):
    (draft / "hf_quant_config.json").write_text("{}")
    with pytest.raises(DsparkError, match="hf_quant_config.json"):
        quantize_checkpoint(draft, tmp_path / "out", engine="torch")


@pytest.mark.parametrize("where", ["inside", "same", "parent"])
def test_refuses_output_overlapping_the_input(draft, where):
    out = {"inside": draft / "q", "same": draft, "parent": draft.parent}[where]
    before = folder_digest(draft.parent)
    with pytest.raises(DsparkError, match="input checkpoint"):
        quantize_checkpoint(draft, out, engine="torch", force=True)
    assert folder_digest(draft.parent) == before


def test_existing_output_needs_force(draft, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(DsparkError, match="the force option"):
        quantize_checkpoint(draft, out, engine="torch")
    assert (out / "old.txt").exists()
    quantize_checkpoint(draft, out, engine="torch", force=True)
    assert not (out / "old.txt").exists() and MARKOV_W2_SCALE in load_all(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "out"]  # no temp or .old folder left


# --- input safety and atomicity -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2])
def test_hub_checkpoint_from_the_offline_cache(tmp_path, monkeypatch, shards):
    """A hub id read from the local cache, whose snapshot files are relative symlinks to blobs (as the hub lays
    them out): OUT must hold the data, never a copy of a symlink."""
    import huggingface_hub.constants

    built = write_draft(tmp_path / "built", SPEC, shards=shards)
    repo = tmp_path / "cache" / "models--owner--tiny-draft"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for file in built.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    report = quantize_checkpoint("owner/tiny-draft", tmp_path / "out", engine="torch")
    assert report.source == "owner/tiny-draft"
    out = tmp_path / "out"
    assert not any(p.is_symlink() for p in out.iterdir())
    assert set(load_all(out)) == set(draft_tensors(SPEC)) | set(NEW_TENSORS)
    assert load_all(out)["fc.weight"].equal(draft_tensors(SPEC)["fc.weight"])


def test_input_is_unchanged(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC, shards=2)
    before = folder_digest(source)
    quantize_checkpoint(source, tmp_path / "out", engine="torch")
    assert folder_digest(source) == before


def test_interrupt_while_writing_leaves_nothing(draft, tmp_path, monkeypatch):
    before = folder_digest(draft)
    monkeypatch.setattr(quantize_module, "rewrite_safetensors", raise_interrupt)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(draft, tmp_path / "out", engine="torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    assert folder_digest(draft) == before


def test_interrupt_with_force_keeps_the_old_output(draft, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    monkeypatch.setattr(quantize_module, "_write_json", raise_interrupt)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(draft, out, engine="torch", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "out"]
    assert [p.name for p in out.iterdir()] == ["old.txt"]


# --- CLI ----------------------------------------------------------------------------------------------------------

runner = CliRunner()


def words(text: str) -> str:
    """Text with rich's line wrapping and panel borders undone."""
    return " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def test_cli_json_report(draft, tmp_path):
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(tmp_path / "out"), "--engine", "torch",
                                 "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["engine"] == "torch" and report["quantized_layer"] == "model.markov_head.markov_w2"
    assert report["shape"] == [SPEC.vd, SPEC.markov_rank] and report["compression_ratio"] > 3
    assert set(report["bias"]) == {"rows", "top1_agreement", "top16_overlap", "relative_error"}


def test_cli_json_keeps_warnings_on_stderr(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC.with_(markov_rank=48))
    result = runner.invoke(app, ["quantize", str(source), "-o", str(tmp_path / "out"), "--engine", "torch",
                                 "--json", "-"])
    assert result.exit_code == 0
    assert "multiple of 64" in json.loads(result.stdout)["warnings"][0]
    assert "multiple of 64" in words(result.stderr)


def test_cli_table_and_warning(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC.with_(markov_rank=48))
    result = runner.invoke(app, ["quantize", str(source), "-o", str(tmp_path / "out"), "--engine", "torch"])
    assert result.exit_code == 0, result.output
    assert "top-1 agreement" in words(result.stdout) and "model.markov_head.markov_w2" in result.stdout
    assert "warning:" in result.stderr and "multiple of 64" in words(result.stderr)


def test_cli_refusal_is_one_sentence_exit_2(draft, tmp_path):
    (tmp_path / "out").mkdir()
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(tmp_path / "out"), "--engine", "torch"])
    assert result.exit_code == 2
    assert "already exists" in words(result.stderr) and "Traceback" not in result.output


def test_cli_interrupt_exit_130(draft, tmp_path, monkeypatch):
    monkeypatch.setattr(quantize_module, "rewrite_safetensors", raise_interrupt)
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(tmp_path / "out"), "--engine", "torch"])
    assert result.exit_code == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_cli_help_states_the_runtime_default():
    result = runner.invoke(app, ["quantize", "--help"])
    assert f"(default {quantize_module.DEFAULT_SAMPLE_ROWS};" in words(result.stdout)


def test_cli_rejects_unknown_engine(draft, tmp_path):
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(tmp_path / "out"), "--engine", "fp4"])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()


# --- dspark validate on the output --------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2])
def test_output_passes_validate_as_nvfp4(tmp_path, shards):
    source = write_draft(tmp_path / "draft", SPEC, shards=shards)
    quantize_checkpoint(source, tmp_path / "out", engine="torch")
    report = validate_checkpoint(open_checkpoint(tmp_path / "out"), deep=True)
    assert report.errors == [] and report.warnings == []
    assert any("NVFP4" in finding.message for finding in report.findings)
