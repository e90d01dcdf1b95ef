"""Is the engine profile of the runs' pair (verdict.check_pair)? `dspark convert --to gguf` records the converted
folder's fingerprint in the GGUF (checkpoint/fingerprint.py SOURCE_KEY), `dspark bench engine` copies it into the
profile, and `dspark plan` compares it with the fingerprints of the runs' target and draft folders: another pair's
profile is refused in one sentence naming the option that forces it, which turns the refusal into a note."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fake_llama_server import demo_ggufs
from verdict_inputs import DRAFT, TARGET, accepting, eval_run, profile_doc

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.bench.engine import gguf_metadata, model_file
from dspark_cli.runtime.checkpoint.fingerprint import (
    SAMPLE_BYTES,
    SAMPLES,
    SOURCE_KEY,
    file_fingerprint,
    folder_fingerprint,
)
from dspark_cli.runtime.measure.engine_profile import read_engine_profile
from dspark_cli.runtime.measure.verdict import check_pair


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    return demo_ggufs(tmp_path_factory.mktemp("ggufs"))


@pytest.fixture(scope="module")
def changed_draft(tmp_path_factory) -> Path:
    """A copy of the demo draft folder with one byte of its safetensors changed (inside a sampled window)."""
    folder = tmp_path_factory.mktemp("changed") / "draft"
    shutil.copytree(DRAFT, folder)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    assert size > SAMPLES * SAMPLE_BYTES  # a sampled fingerprint: the byte is put where a sample reads
    offset = 8 * ((size - SAMPLE_BYTES) // (SAMPLES - 1)) + 1000
    with open(weights, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))
    return folder


def profile_of(tmp_path, target: dict, draft: dict):
    doc = profile_doc(theta=lambda m, i: 10.0 + m, plain=lambda r, c, i: 22.0, delta=lambda n, r, c, i: 5.0, block=7,
                      concurrencies=[1], contexts=[16], draft_ns=[7])
    doc["models"] = {"target": target, "draft": draft}
    return read_engine_profile(tmp_path / "costs.json", doc)


def runs(draft=DRAFT, target=TARGET):
    return [eval_run([[accepting(7, 7)] * 25] * 2, block=7, draft=draft, target=target)]


def test_convert_records_the_source_folders_fingerprint(ggufs):
    target, draft = ggufs
    assert gguf_metadata(str(draft), [SOURCE_KEY])[SOURCE_KEY] == folder_fingerprint(DRAFT)
    assert gguf_metadata(str(target), [SOURCE_KEY])[SOURCE_KEY] == folder_fingerprint(TARGET)
    assert folder_fingerprint(DRAFT) != folder_fingerprint(TARGET)
    assert model_file(str(draft)) == {"path": str(draft.resolve()), "fingerprint": file_fingerprint(draft),
                                      "source": folder_fingerprint(DRAFT)}
    assert model_file(None) == {"path": None, "fingerprint": None, "source": None}


def test_a_changed_byte_or_a_renamed_file_changes_the_fingerprint(changed_draft, tmp_path):
    assert folder_fingerprint(changed_draft) != folder_fingerprint(DRAFT)
    same = tmp_path / "same"
    shutil.copytree(DRAFT, same)
    (same / "README.md").write_text("not a weight: not fingerprinted")
    assert folder_fingerprint(same) == folder_fingerprint(DRAFT)  # where it lies and other files do not count
    os.rename(same / "model.safetensors", same / "model-00001.safetensors")
    assert folder_fingerprint(same) != folder_fingerprint(DRAFT)  # the file names do
    assert folder_fingerprint(tmp_path / "nowhere") is None and folder_fingerprint("Qwen/Qwen3-0.6B") is None


def test_the_runs_own_pair_passes(ggufs, tmp_path):
    target, draft = ggufs
    profile = profile_of(tmp_path, model_file(str(target)), model_file(str(draft)))
    assert check_pair(runs(), profile, other_pair=False) == []
    assert check_pair(runs(), profile, other_pair=True) == []


def test_another_draft_is_refused_in_one_sentence_unless_forced(ggufs, changed_draft, tmp_path):
    target, draft = ggufs
    profile = profile_of(tmp_path, model_file(str(target)), model_file(str(draft)))
    with pytest.raises(DsparkError) as refused:
        check_pair(runs(draft=changed_draft), profile, other_pair=False)
    message = str(refused.value)
    assert message == (f"the engine profile {tmp_path / 'costs.json'} cannot be used for these runs: its draft file "
                       f"{draft.resolve()} was converted from another folder than the runs' draft {changed_draft}; "
                       "profile this pair's engine with `dspark bench engine`, or pass the other-pair option to plan "
                       "with it anyway.")
    notes = check_pair(runs(draft=changed_draft), profile, other_pair=True)
    assert notes == [f"planned with another pair's engine profile: its draft file {draft.resolve()} was converted "
                     f"from another folder than the runs' draft {changed_draft}."]


def test_a_profile_without_sources_or_runs_of_a_hub_id_cannot_be_matched(ggufs, tmp_path):
    target, draft = ggufs
    unknown = {"path": "/elsewhere/target.gguf", "fingerprint": None, "source": None}
    profile = profile_of(tmp_path, unknown, model_file(str(draft)))
    with pytest.raises(DsparkError, match="its target file /elsewhere/target.gguf records no source folder .not "
                                          "written by `dspark convert`.*pass the other-pair option"):
        check_pair(runs(), profile, other_pair=False)
    assert len(check_pair(runs(), profile, other_pair=True)) == 1
    matched = profile_of(tmp_path, model_file(str(target)), model_file(str(draft)))
    with pytest.raises(DsparkError, match="the runs' target Qwen/Qwen3-0.6B is not a local checkpoint folder"):
        check_pair(runs(target="Qwen/Qwen3-0.6B"), matched, other_pair=False)
