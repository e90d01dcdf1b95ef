"""convert --to gguf --outtype: dspark's Q8_0 / Q4_0 blocks (against the format, the gguf package's reference
quantizers and llama.cpp's llama-quantize byte for byte), which tensors stay unquantized, --leave-output, Q4_K_M
through llama-quantize, and the quantized pair in the real llama-server (tokens equal plain decoding of the same
quantized target)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.convert.gguf_kquant import quantize_q4_k
from dspark_cli.runtime.convert.gguf_quant import (
    QUANTIZERS,
    quantize_file,
    quantize_q4_0,
    quantize_q8_0,
    tensor_plan,
)
from dspark_cli.runtime.demo import DEMO_DIR
from dspark_cli.runtime.engines.llamacpp import build_binary

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from llama_server import demo_ggufs, llama_server, needs_llamacpp  # noqa: E402, F401 (demo_ggufs is a fixture)

DRAFT, TARGET = DEMO_DIR / "draft", DEMO_DIR / "target"
QUANTIZE = build_binary("llama-quantize")
needs_quantize = pytest.mark.skipif(not QUANTIZE.is_file(), reason="no llama-quantize: run scripts/build_llamacpp.sh")


def _rows(seed: int = 0) -> np.ndarray:
    """[8, 96] float32 with the blocks that test the rules: a zero block, exact halves after scaling, a
    magnitude tie of opposite signs (Q4_0 keeps the first), large and tiny values."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((8, 96)).astype(np.float32)
    rows[0, :32] = 0.0
    rows[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # x / d lands on halves
    rows[1, 31] = 127.0  # d = 1
    rows[2, :32] = 0.25
    rows[2, 5], rows[2, 9] = -3.0, 3.0  # equal magnitudes: the first, -3, sets d
    rows[3] *= 1e4
    rows[4] *= 1e-6
    return rows


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_blocks_equal_the_gguf_reference_quantizer(kind):
    rows = _rows()
    ours = QUANTIZERS[kind.lower()](rows)
    reference = gguf.quants.quantize(rows, gguf.GGMLQuantizationType[kind])
    assert ours.shape == reference.shape == (8, 96 // 32 * (34 if kind == "Q8_0" else 18))
    assert ours.tobytes() == reference.tobytes()


@pytest.mark.parametrize("quantize, kind, bound", [
    (quantize_q8_0, "Q8_0", 0.5 / 127),  # half a step of d = max / 127
    (quantize_q4_0, "Q4_0", 1 / 8),  # a step of |d| = max / 8: the largest value of the other sign clips to 7d
])
def test_blocks_decode_to_the_values(quantize, kind, bound):
    """Read back by gguf's decoder (32-value blocks, the F16 scale first), each value is within the format's
    error of its block's largest magnitude (plus the scale's F16 rounding)."""
    rows = _rows(1)
    rows[4] *= 1e4  # the tiny row's scale is below F16's normal range: the format's limit, not tested here
    decoded = gguf.quants.dequantize(quantize(rows), gguf.GGMLQuantizationType[kind]).reshape(rows.shape)
    largest = np.abs(rows.reshape(-1, 32)).max(axis=1, keepdims=True)
    error = np.abs(decoded - rows).reshape(-1, 32)
    assert np.all(error <= largest * (bound + 2e-3))


@pytest.mark.parametrize("name, shape, out", [
    ("blk.0.attn_q.weight", (256, 256), "Q4_0"),
    ("output.weight", (256, 1024), "Q4_0"),
    ("markov_w2.weight", (128, 1024), "Q4_0"),
    ("conf_proj.weight", (384, 1), "BF16"),  # [hidden + rank, 1]: one row, ggml's 1-D
    ("blk.0.attn_norm.weight", (256,), "BF16"),
    ("blk.0.ffn_norm.weight", (256, 2), "BF16"),  # a norm by name
    ("d2t", (1024, 2), "BF16"),  # not a weight
    ("fc.weight", (100, 256), "F16"),  # rows not whole 32-value blocks: llama.cpp's F16 fallback
])
def test_which_tensors_are_quantized(name, shape, out):
    assert tensor_plan(name, shape, "BF16", "q4_0").out_type == out


@pytest.mark.parametrize("name, shape, out", [
    ("fc.weight", (768, 256), "Q4_K"),
    ("markov_w1.weight", (128, 1024), "Q5_0"),  # rank 128: not whole 256-value super-blocks (llama.cpp's fallback)
    ("fc.weight", (100, 256), "F16"),
])
def test_which_tensors_are_q4_k(name, shape, out):
    assert tensor_plan(name, shape, "BF16", "q4_k").out_type == out


def test_q4_k_reproduces_values_on_its_grid():
    """Sub-blocks of q x 63/16 (q = 0..15): the largest sub-block scale is 63/16, so the super-block scale
    d = (63/16) / 63 = 1/16 is exact in F16 and gguf's decoder gives the values back exactly (a super-block scale
    of max / 62 or max / 64 would not)."""
    levels = np.tile(np.arange(16, dtype=np.float32), 2 * 8)  # [256]: every sub-block holds 0..15 twice
    rows = (levels * np.float32(63 / 16)).reshape(1, 256)
    decoded = gguf.quants.dequantize(quantize_q4_k(rows), gguf.GGMLQuantizationType.Q4_K).reshape(rows.shape)
    assert np.array_equal(decoded, rows)


def test_q4_k_blocks_decode_close_to_the_values():
    rows = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    decoded = gguf.quants.dequantize(quantize_q4_k(rows), gguf.GGMLQuantizationType.Q4_K).reshape(rows.shape)
    assert np.linalg.norm(decoded - rows) / np.linalg.norm(rows) < 0.1


def test_leave_output_keeps_the_lm_head():
    assert tensor_plan("output.weight", (256, 1024), "BF16", "q8_0", keep_output=True).out_type == "BF16"
    assert tensor_plan("token_embd.weight", (256, 1024), "BF16", "q8_0", keep_output=True).out_type == "Q8_0"


@pytest.fixture(scope="module")
def unquantized(tmp_path_factory) -> Path:
    from dspark_cli.runtime.convert.gguf import convert_to_gguf

    out = tmp_path_factory.mktemp("unquantized") / "draft.gguf"
    convert_to_gguf(str(DRAFT), out, target=str(TARGET))
    return out


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_convert_outtype_writes_the_types_and_keeps_keys(tmp_path, unquantized):
    out = tmp_path / "draft-q8.gguf"
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(out), "--to", "gguf", "--target", str(TARGET),
                                      "--outtype", "q8_0", "--leave-output"])
    assert result.exit_code == 0, result.output
    types = _types(out)
    assert types["output.weight"] == "BF16"  # --leave-output
    assert types["markov_w2.weight"] == types["fc.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["conf_proj.weight"] == "BF16" and types["output_norm.weight"] == "F32"
    reader, source = gguf.GGUFReader(out), gguf.GGUFReader(unquantized)
    assert reader.fields["general.file_type"].contents() == 7  # MOSTLY_Q8_0
    keys = set(source.fields) - {"general.file_type"}
    assert all(reader.fields[k].contents() == source.fields[k].contents() for k in keys if not k.startswith("GGUF."))
    assert "Q8_0" in result.output and "MB" in result.output


def test_an_unknown_outtype_is_one_sentence(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(tmp_path / "d.gguf"), "--to", "gguf",
                                      "--target", str(TARGET), "--outtype", "q3_k"])
    assert result.exit_code == 2
    assert "q8_0, q4_0, q4_k, q4_k_m" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "d.gguf").exists()


@needs_quantize
@pytest.mark.parametrize("kind, files", [("q8_0", 2), ("q4_0", 2), ("q4_k", 1)])
def test_files_equal_llama_quantize_pure(tmp_path, demo_ggufs, kind, files):
    """Every tensor of the draft and the target (Q4_K: the draft, whose Q5_0 fallbacks it has too; its search is the
    slow one), as dspark writes it, is llama-quantize --pure's: type and bytes."""
    for source in demo_ggufs[::-1][:files]:
        ours, theirs = tmp_path / f"ours-{source.name}", tmp_path / f"theirs-{source.name}"
        quantize_file(source, ours, kind)
        subprocess.run([str(QUANTIZE), "--pure", str(source), str(theirs), kind.upper(), "1"], check=True,
                       capture_output=True)
        mine = {t.name: t for t in gguf.GGUFReader(ours).tensors}
        reference = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
        assert mine.keys() == reference.keys()
        for name, tensor in reference.items():
            assert mine[name].tensor_type == tensor.tensor_type, name
            assert mine[name].data.tobytes() == tensor.data.tobytes(), name


@needs_quantize
def test_q4_k_m_is_llama_quantizes_mixture(tmp_path):
    out = tmp_path / "draft-q4km.gguf"
    result = CliRunner().invoke(app, ["convert", str(DRAFT), "-o", str(out), "--to", "gguf", "--target", str(TARGET),
                                      "--outtype", "q4_k_m"])
    assert result.exit_code == 0, result.output
    types = _types(out)
    assert types["fc.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["markov_w1.weight"] == "Q5_0"  # rank 128: not whole 256-value super-blocks
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 15  # MOSTLY_Q4_K_M


@needs_llamacpp
@needs_quantize
def test_quantized_pair_in_llamacpp_equals_its_plain_target(tmp_path, demo_ggufs):
    """llama-server loads a Q4_K_M target and a Q4_0 draft dspark wrote; at T=0 the speculative tokens equal the
    quantized target's alone."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from llamacpp_check import complete, demo_prompts

    target, draft = tmp_path / "target.gguf", tmp_path / "draft.gguf"
    quantize_file(demo_ggufs[0], target, "q4_k_m")
    quantize_file(demo_ggufs[1], draft, "q4_0")
    prompts = [[int(i) for i in ids] for ids in _encoded(demo_prompts(3))]
    with llama_server(target) as url:
        plain = [complete(url, ids, 24)["tokens"] for ids in prompts]
    with llama_server(target, draft) as url:
        answers = [complete(url, ids, 24) for ids in prompts]
    assert [a["tokens"] for a in answers] == plain
    assert sum(a["timings"].get("draft_n_accepted", 0) for a in answers) > 0


def _encoded(texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in texts]
