"""validate on llama.cpp draft GGUFs and the silent-degradation rules: the mis-export corpus (tests/fixtures/
misexport.py) all flagged with one sentence and a fix, the good drafts and their GGUFs with no finding, the GGUF
reader's layer-id convention, convert's window keys, the CLI's exit codes and its torch-free import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from misexport import (
    DRAFT,
    FOLDER_CASES,
    GGUF_CASES,
    HYBRID_DRAFT,
    HYBRID_TARGET,
    TARGET,
    WINDOW,
    FolderCase,
    build_folder,
    build_gguf,
    convert,
    good_gguf,
    rewrite_gguf,
)
from typer.testing import CliRunner
from llama_server import llama_server, needs_llamacpp
from llamacpp_server import pair_gguf  # scripts/, on the path once llama_server is imported

from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.gguf_read import read_gguf
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.rules import CODES, READ_ERRORS, validate_checkpoint
from dspark_cli.runtime.checkpoint.rules.gguf import validate_gguf

runner = CliRunner()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """dspark convert's GGUFs of both shipped drafts, and the demo target's GGUF."""
    work = tmp_path_factory.mktemp("gguf")
    target_gguf, draft_gguf = pair_gguf(TARGET, DRAFT, work / "demo")
    hybrid = good_gguf(work, HYBRID_DRAFT, HYBRID_TARGET)
    return {"target": target_gguf, "draft": draft_gguf, "hybrid": hybrid}


def assert_one_sentence_with_fix(report, code: str) -> None:
    """Flagged with this code and no other (the rest of the mis-exported draft is sound)."""
    assert set(report.codes) == {code}, (code, report.codes)
    found = [f for f in report.findings if f.code == code]
    for finding in found:
        assert finding.message.endswith(".") and "\n" not in finding.message and finding.hint
        assert finding.severity == CODES[code][0]


# --- the good drafts: no finding --------------------------------------------------------------------------------

def test_good_ggufs_have_no_finding(tmp_path, good):
    copy = rewrite_gguf(good["draft"], tmp_path / "copy.gguf", {}, {})  # the corpus's rewriting changes nothing
    assert validate_gguf(str(copy), str(good["target"]), deep=True).findings == []
    for target in (good["target"], str(TARGET)):
        report = validate_gguf(str(good["draft"]), str(target), deep=True)
        assert report.findings == [] and report.skipped == []
    assert validate_gguf(str(good["hybrid"]), str(HYBRID_TARGET), deep=True).findings == []


def test_good_folders_have_no_new_finding():
    for draft, target in ((DRAFT, TARGET), (HYBRID_DRAFT, HYBRID_TARGET)):
        report = validate_checkpoint(open_checkpoint(draft), read_target_config(target), deep=True)
        assert report.findings == []


def test_gguf_layer_ids_are_deepspec_ids_plus_one(good):
    """llama.cpp stores the input of layer k; validate reports DeepSpec's ids, the folder's target_layer_ids."""
    assert read_gguf(good["draft"]).keys["dflash.target_layers"] == [2, 4, 7]
    resolved = validate_gguf(str(good["draft"])).resolved
    assert resolved["target_layer_ids"] == json.loads((DRAFT / "config.json").read_text())["target_layer_ids"]
    assert validate_gguf(str(good["hybrid"])).resolved["target_layer_ids"] == [0, 1, 2]


# --- the corpus: every one flagged ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", GGUF_CASES, ids=[c.name for c in GGUF_CASES])
def test_misexported_gguf_is_flagged(tmp_path, good, case):
    path = build_gguf(case, tmp_path, good["draft"] if case.draft == DRAFT else good["hybrid"])
    target = good["target"] if case.target == TARGET else case.target
    report = validate_gguf(str(path), str(target), deep=True)
    assert_one_sentence_with_fix(report, case.code)


@pytest.mark.parametrize("case", FOLDER_CASES, ids=[c.name for c in FOLDER_CASES])
def test_misexported_folder_is_flagged(tmp_path, case):
    report = validate_checkpoint(open_checkpoint(build_folder(case, tmp_path / "d")), read_target_config(TARGET),
                                 deep=True)
    assert_one_sentence_with_fix(report, case.code)


def test_corpus_covers_every_gguf_code():
    gguf_codes = {code for code in CODES if code.startswith("DSP8")}
    assert {c.code for c in GGUF_CASES} >= gguf_codes
    assert len(GGUF_CASES) + len(FOLDER_CASES) >= 10


def test_truncated_gguf_is_a_read_error(tmp_path, good):
    path = tmp_path / "cut.gguf"
    data = good["draft"].read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(Exception) as caught:
        validate_gguf(str(path))
    assert getattr(caught.value, "code", None) == "DSP801" and "DSP801" in READ_ERRORS


def test_damaged_gguf_is_one_read_error_or_a_report(tmp_path, good):
    """Truncated at many points and with header bytes overwritten (seeded): a report or DSP801, nothing else, and
    no corrupt length is ever allocated (the reader checks it against the bytes left)."""
    import random

    from dspark_cli.runtime.checkpoint.read import CheckpointError

    data = good["draft"].read_bytes()
    header_end = min(t.begin for t in read_gguf(good["draft"]).tensors.values())
    rng = random.Random(36)
    damaged = [data[:cut] for cut in range(0, header_end + 64, max(1, header_end // 40))]
    for _ in range(40):
        copy = bytearray(data)
        at = rng.randrange(4, header_end)
        copy[at:at + 8] = bytes(rng.randrange(256) for _ in range(8))
        damaged.append(bytes(copy))
    path = tmp_path / "damaged.gguf"
    for blob in damaged:
        path.write_bytes(blob)
        try:
            validate_gguf(str(path), deep=True)
        except CheckpointError as error:
            assert error.code in ("DSP801", "DSP501")


# --- convert carries the window keys -------------------------------------------------------------------------------

def test_convert_writes_the_window_keys(tmp_path):
    folder = build_folder(FolderCase("window", "-", config=WINDOW), tmp_path / "w")
    keys = read_gguf(convert(folder, TARGET, tmp_path / "w.gguf")).keys
    assert keys["dflash.attention.sliding_window"] == 64
    assert keys["dflash.attention.sliding_window_pattern"] == [True]
    assert validate_gguf(str(tmp_path / "w.gguf"), str(TARGET)).findings == []
    dense = read_gguf(convert(DRAFT, TARGET, tmp_path / "d.gguf")).keys
    assert "dflash.attention.sliding_window" not in dense


def test_convert_refuses_sliding_layers_without_a_window(tmp_path):
    from dspark_cli.errors import DsparkError

    folder = build_folder(FolderCase("no window", "-", config={"layer_types": ["sliding_attention"]}), tmp_path / "w")
    with pytest.raises(DsparkError, match="no window size"):
        convert(folder, TARGET, tmp_path / "w.gguf")
    assert not (tmp_path / "w.gguf").exists()


# --- the command line ----------------------------------------------------------------------------------------------

def test_cli_exit_codes_on_gguf(tmp_path, good):
    ok = runner.invoke(app, ["validate", str(good["draft"]), "--target", str(good["target"]), "--json", "-"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["format"] == "gguf-dflash"
    bad = build_gguf(GGUF_CASES[0], tmp_path, good["draft"])
    flagged = runner.invoke(app, ["validate", str(bad)])
    assert flagged.exit_code == 1
    text = " ".join(flagged.stdout.split())
    assert "DSP805" in text and "fix:" in text and "llama.cpp would fail to load or mis-serve" in text
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good["draft"].read_bytes()[:64])
    unreadable = runner.invoke(app, ["validate", str(cut)])
    assert unreadable.exit_code == 2 and "DSP801" in unreadable.stderr
    refused = runner.invoke(app, ["validate", str(good["draft"]), "--engine", "sglang"])
    assert refused.exit_code == 2


@needs_llamacpp
def test_llama_server_agrees_with_validate(tmp_path, good):
    """The real llama-server b11434: the good GGUF serves; two GGUFs validate calls errors do not (an abort, a load
    failure), so validate's claims about them hold."""
    with llama_server(good["target"], good["draft"], startup_timeout=120):
        pass
    for index, name in enumerate(("block size dropped (llama-server aborts)",
                                  "window without the pattern (fails to load)")):
        case = next(c for c in GGUF_CASES if c.name == name)
        (tmp_path / str(index)).mkdir()
        bad = build_gguf(case, tmp_path / str(index), good["draft"])
        with pytest.raises(RuntimeError, match="exited"):
            with llama_server(good["target"], bad, startup_timeout=120):
                pass


def test_validate_gguf_imports_no_torch(good):
    script = (
        "import sys\n"
        "from dspark_cli.cli import app\n"
        "try:\n"
        f"    app(['validate', {str(good['draft'])!r}, '--target', {str(good['target'])!r}, '--deep', '--json', '-'])\n"
        "except SystemExit as exit:\n"
        "    code = exit.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'triton', 'safetensors') if m in sys.modules]\n"
        "print(code, heavy, file=sys.stderr)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.stderr.strip().splitlines()[-1] == "0 []"
