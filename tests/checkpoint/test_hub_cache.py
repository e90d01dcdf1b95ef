"""Every command on checkpoints that live in a Hugging Face hub cache under a folder named `.cache`, offline.

The cache is laid out by the helpers `hf_hub_download` itself calls (`repo_folder_name`, and the private
`_create_symlink` / `_cache_commit_hash_for_specific_revision` of huggingface_hub.file_download), as it leaves it:
`models--org--name/blobs/<sha256>`, `snapshots/<commit>/<file> -> ../../blobs/<sha256>` (relative links) and
`refs/main` holding the commit. Commands get hub ids (`org/draft`) and resolve them with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from ckpt_factory import DraftSpec, write_draft
from pair_factory import bigram_draft, bigram_target, write_byte_tokenizer
from typer.testing import CliRunner

import dspark_cli.kernels  # noqa: F401  chooses the Triton interpreter before anything imports triton (issue 10 §6)
from dspark_cli.cli import app
from dspark_cli.runtime.checkpoint.read import open_checkpoint

runner = CliRunner()
SPEC = DraftSpec(block_size=8, markov_rank=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(hub: Path, repo_id: str, folder: Path) -> Path:
    """Store every file of `folder` in the cache `hub` as repo `repo_id` at COMMIT (refs/main); the snapshot path."""
    from huggingface_hub.file_download import (
        _cache_commit_hash_for_specific_revision,
        _create_symlink,
        repo_folder_name,
    )

    storage = hub / repo_folder_name(repo_id=repo_id, repo_type="model")
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        pointer = storage / "snapshots" / COMMIT / file.relative_to(folder)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=True)
    _cache_commit_hash_for_specific_revision(str(storage), "main", COMMIT)
    return storage / "snapshots" / COMMIT


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """A hub cache at <tmp>/.cache/huggingface/hub with org/target, org/draft, org/draft-sharded, org/draft-bin."""
    root = tmp_path_factory.mktemp("hub")
    staging, hub = root / "staging", root / ".cache" / "huggingface" / "hub"
    target = bigram_target(staging / "target", SPEC)
    write_byte_tokenizer(target)
    cache_repo(hub, "org/target", target)
    cache_repo(hub, "org/draft", bigram_draft(staging / "draft", SPEC, target))
    cache_repo(hub, "org/draft-sharded", write_draft(staging / "sharded", SPEC, shards=3))
    odd = write_draft(staging / "odd", SPEC)  # weights not named model*.safetensors, and a pickle file beside
    (odd / "model.safetensors").rename(odd / "weights.safetensors")
    (odd / "training_args.bin").write_bytes(b"pickle")
    cache_repo(hub, "org/draft-odd", odd)
    return hub


@pytest.fixture
def offline(hub, monkeypatch) -> Path:
    """HF_HUB_CACHE = the fixture cache and offline mode, for environment readers and huggingface_hub alike."""
    from huggingface_hub import constants

    for name, value in (("HF_HUB_CACHE", str(hub)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def test_the_cache_is_a_real_hub_cache(offline):
    from huggingface_hub import scan_cache_dir, snapshot_download

    folder = Path(snapshot_download("org/draft-sharded", local_files_only=True))
    assert ".cache" in folder.parts and (folder / "model.safetensors.index.json").is_symlink()
    assert not Path(str((folder / "config.json").readlink())).is_absolute()  # relative, as the hub writes it
    repos = {repo.repo_id: repo for repo in scan_cache_dir(offline).repos}
    assert set(repos) == {"org/target", "org/draft", "org/draft-sharded", "org/draft-odd"}
    assert {ref for revision in repos["org/draft"].revisions for ref in revision.refs} == {"main"}


@pytest.mark.parametrize("repo", ["org/draft", "org/draft-sharded"])
def test_open_checkpoint_lists_every_snapshot_file(offline, repo):
    ckpt = open_checkpoint(repo)
    assert "config.json" in ckpt.files and any(name.endswith(".safetensors") for name in ckpt.files)
    assert ckpt.tensors and ckpt.local_dir is not None and ".cache" in ckpt.local_dir.parts


@pytest.mark.parametrize("repo", ["org/draft", "org/draft-sharded"])
def test_validate(offline, repo):
    result = runner.invoke(app, ["validate", repo, "--target", "org/target", "--json", "-"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["exit_code"] == 0 and doc["resolved"]["tensors"] > 0


def test_validate_keeps_weights_of_any_name_and_the_pickle_warning(offline):
    result = runner.invoke(app, ["validate", "org/draft-odd", "--json", "-"])
    doc = json.loads(result.output)
    assert "error" not in doc, doc  # not a false "no .safetensors weights"
    assert doc["resolved"]["tensors"] > 0
    assert any("training_args.bin" in finding["message"] for finding in doc["findings"])


@pytest.mark.parametrize("repo, shards", [("org/draft", 1), ("org/draft-sharded", 3)])
def test_quantize_writes_the_weights(offline, tmp_path, repo, shards):
    out = tmp_path / "q"
    result = runner.invoke(app, ["quantize", repo, "-o", str(out), "--engine", "torch", "--sample-rows", "8"])
    assert result.exit_code == 0, result.output
    source = open_checkpoint(repo)
    written = open_checkpoint(out)
    assert len(written.shards) == shards and set(source.files) <= set(written.files)
    assert all(not (out / name).is_symlink() for name in written.files)
    assert "markov_head.markov_w2.weight_scale" in written.tensors
    if written.index is not None:
        assert all((out / name).is_file() for name in set(written.index["weight_map"].values()))
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_generate(offline):
    result = runner.invoke(app, ["generate", "hello world", "--target", "org/target", "--draft", "org/draft",
                                 "--max-new-tokens", "12", "--baseline"])
    assert result.exit_code == 0, result.output
    assert "greedy output identical to plain decoding" in result.output


def test_bench_markov(offline, tmp_path):
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "markov", "--draft", "org/draft", "--device", "cpu", "--block", "2",
                                 "--batch", "2", "--topk", "8", "--temperature", "0", "--reps", "1", "--warmup", "0",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["tokens_ok"] and doc["rank"] == SPEC.markov_rank


def test_train(offline, tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "trained"
    result = runner.invoke(app, ["train", "--target", "org/target", "--data", str(data), "-o", str(out),
                                 "--layers", "1", "--block-size", "4", "--markov-rank", "16", "--steps", "2",
                                 "--batch-size", "2", "--seq-len", "32", "--anchors", "4",
                                 "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
