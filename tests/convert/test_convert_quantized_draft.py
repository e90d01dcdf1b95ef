"""dspark convert --to gguf on a draft whose Linear layers are ModelOpt NVFP4 or FP8 (dspark quantize --scope draft):
each such weight is written dequantized as F32, bit for bit the weight dspark's runtime dequantizes at load
(kernels/nvfp4.py dequantize_nvfp4, kernels/fp8.py dequantize_fp8), its scales not written and FP8's input_scale
dropped (said in the summary); every other tensor as for the unquantized draft; --outtype quantizes from the
dequantized values; a malformed layer is one sentence. With the llama.cpp build (skipped without it), llama-server
runs each converted draft beside the demo target: tokens equal the target alone at T = 0, and the draft is accepted.

Mutations checked: reading the high nibble as element 2i (dequant._nvfp4) fails
test_dequantized_weights_are_the_runtimes_bit_for_bit; multiplying the FP8 weight by its input_scale too fails it;
file_type counting the stored uint8 / float8 bytes instead of the written F32 fails test_keys_and_tensor_set."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.kernels.fp8 import FP8Weight, dequantize_fp8
from dspark_cli.kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4
from dspark_cli.runtime.checkpoint.read import open_checkpoint
from dspark_cli.runtime.checkpoint.rules.gguf import validate_gguf
from dspark_cli.runtime.convert.dequant import e4m3_table, quantized_linears
from dspark_cli.runtime.convert.gguf import LAYER_TENSORS, TOP_TENSORS, convert_to_gguf
from quantized_demo import DRAFT, TARGET, quantized_demo  # noqa: F401 (a fixture)

gguf = pytest.importorskip("gguf")
runner = CliRunner()
KINDS = ("nvfp4", "nvfp4_head", "fp8")


@pytest.fixture(scope="module")
def converted(quantized_demo, tmp_path_factory):
    """kind -> (GGUFReader, summary), and "bf16" -> the unquantized demo draft's."""
    root = tmp_path_factory.mktemp("quantized_gguf")
    out = {}
    for kind, folder in [("bf16", DRAFT), *((k, quantized_demo[k]) for k in KINDS)]:
        summary = convert_to_gguf(str(folder), root / f"{kind}.gguf", target=str(TARGET))
        out[kind] = (gguf.GGUFReader(root / f"{kind}.gguf"), summary)
    return out


def gguf_name(on_disk: str) -> str:
    name = on_disk.removeprefix("model.")
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return f"blk.{index}.{LAYER_TENSORS[rest]}"
    return TOP_TENSORS[name]


def tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def test_e4m3_table_is_torchs():
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(e4m3_table(), ref, equal_nan=True) and np.isnan(e4m3_table()[[0x7F, 0xFF]]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_weights_are_the_runtimes_bit_for_bit(quantized_demo, converted, kind):
    ckpt = open_checkpoint(str(quantized_demo[kind]))
    linears = quantized_linears(ckpt)
    assert len(linears) == (9 if kind == "nvfp4_head" else 8)
    written = tensors(converted[kind][0])
    for name, linear in linears.items():
        module = name.removesuffix(".weight")
        if linear.format == "nvfp4":
            runtime = dequantize_nvfp4(NVFP4Weight(ckpt.load_tensor(name), ckpt.load_tensor(f"{module}.weight_scale"),
                                                   ckpt.load_tensor(f"{module}.weight_scale_2")))
        else:
            runtime = dequantize_fp8(FP8Weight(ckpt.load_tensor(name), ckpt.load_tensor(f"{module}.weight_scale")))
        tensor = written[gguf_name(name)]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32
        data = np.asarray(tensor.data).reshape(runtime.shape)
        assert np.array_equal(data.view(np.uint32), runtime.numpy().view(np.uint32)), name


@pytest.mark.parametrize("kind", KINDS)
def test_keys_and_tensor_set(converted, kind):
    """The same tensors as the unquantized draft's GGUF (no scale tensor), every one not quantized byte for byte;
    general.file_type F32, the dtype most matrix bytes are now written in."""
    bf16, ours = tensors(converted["bf16"][0]), tensors(converted[kind][0])
    assert set(ours) == set(bf16)
    dequantized = {t for t in ours if ours[t].tensor_type != bf16[t].tensor_type}
    assert all(ours[t].tensor_type == gguf.GGMLQuantizationType.F32 for t in dequantized)
    assert ("output.weight" in dequantized) == (kind == "nvfp4_head")
    for name in set(ours) - dequantized:
        assert bytes(ours[name].data) == bytes(bf16[name].data), name
    assert converted["bf16"][0].fields["general.file_type"].contents() == 32  # MOSTLY_BF16
    assert converted[kind][0].fields["general.file_type"].contents() == 0  # ALL_F32


def test_the_summary_names_what_was_dequantized_and_dropped(converted, quantized_demo, tmp_path):
    assert converted["nvfp4"][1]["dequantized"] == {"nvfp4": 8} and converted["nvfp4"][1]["dropped"] == []
    assert converted["fp8"][1]["dequantized"] == {"fp8": 8}
    assert len(converted["fp8"][1]["dropped"]) == 8 and all(n.endswith(".input_scale")
                                                             for n in converted["fp8"][1]["dropped"])
    assert "dequantized" not in converted["bf16"][1]
    result = runner.invoke(app, ["convert", str(quantized_demo["fp8"]), "--to", "gguf", "--target", str(TARGET),
                                 "-o", str(tmp_path / "d.gguf")])
    assert result.exit_code == 0, result.output
    assert "dequantized 8 FP8 Linear weights to F32" in result.output and "input_scale" in result.output


@pytest.mark.parametrize("kind", KINDS)
def test_validate_finds_nothing_in_the_gguf(converted, kind, tmp_path):
    reader = converted[kind][0]
    report = validate_gguf(str(reader.data.filename), str(TARGET))
    assert report.errors == [] and report.warnings == []


def test_outtype_quantizes_the_dequantized_values(quantized_demo, tmp_path):
    out = tmp_path / "q8.gguf"
    result = runner.invoke(app, ["convert", str(quantized_demo["nvfp4"]), "--to", "gguf", "--target", str(TARGET),
                                 "-o", str(out), "--outtype", "q8_0", "--json", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["dequantized"] == {"nvfp4": 8} and doc["tensor_types"]["Q8_0"] >= 8
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == types["fc.weight"] == "Q8_0"


def test_a_malformed_layer_is_one_sentence(quantized_demo, tmp_path):
    """An FP8 weight_scale that is not one value (validate's DSP317): refused, nothing written."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(quantized_demo["fp8"], folder)
    weights = load_file(folder / "model.safetensors")
    weights["fc.weight_scale"] = weights["fc.weight_scale"].reshape(1).repeat(2)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(DsparkError, match=r"fc\.weight_scale is F32 \[2\]; a per-tensor scale is one float32 value"):
        convert_to_gguf(str(folder), tmp_path / "x.gguf", target=str(TARGET))
    assert not (tmp_path / "x.gguf").exists()


def test_a_quantized_markov_head_is_still_refused(tmp_path):
    """scope markov's NVFP4 markov_w2 stays refused (llama.cpp's DSP722): only the Linear layers are dequantized."""
    result = runner.invoke(app, ["quantize", str(DRAFT), "-o", str(tmp_path / "m"), "--engine", "torch",
                                 "--sample-rows", "0"])
    assert result.exit_code == 0, result.output
    with pytest.raises(DsparkError, match="markov_w2 is NVFP4-quantized"):
        convert_to_gguf(str(tmp_path / "m"), tmp_path / "m.gguf", target=str(TARGET))


# --- the real llama-server (skipped without scripts/build_llamacpp.sh's build) -----------------------------------------

from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: E402,F401 (demo_ggufs is a fixture)


@needs_llamacpp
@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
def test_llama_server_runs_the_dequantized_draft_losslessly(demo_ggufs, converted, kind):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from llamacpp_check import complete, demo_prompts, tokenize

    target_gguf = demo_ggufs[0]
    draft_gguf = Path(converted[kind][0].data.filename)
    prompts = demo_prompts(3)
    with llama_server(target_gguf) as url:
        ids = [tokenize(url, text) for text in prompts]
        plain = [complete(url, p, 32)["tokens"] for p in ids]
    with llama_server(target_gguf, draft_gguf) as url:
        runs = [complete(url, p, 32) for p in ids]
    assert [run["tokens"] for run in runs] == plain  # verification is lossless at T = 0
    assert sum(run["timings"].get("draft_n_accepted", 0) for run in runs) > 0  # the draft is used, and right
