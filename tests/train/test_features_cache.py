"""`dspark features` and `dspark train --features`: the feature cache on disk (its cost per token, atomic and resumable
shards, the manifest checked before training), cached training equal to online training, and speculators' files."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import ranks
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file
from test_train import tiny_pair  # noqa: F401 - the tiny target + data fixture
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import DsparkError
from dspark_cli.runtime.train import feature_cache
from dspark_cli.runtime.train.data import SequenceBank
from dspark_cli.runtime.train.feature_cache import FeatureCache, shard_name
from dspark_cli.runtime.train.features import capture_target_features
from dspark_cli.runtime.train.features_run import claim, finish, plan_corpus, plan_speculators, write
from dspark_cli.runtime.train.new_draft import DraftShape, build_draft
from dspark_cli.runtime.train.options import TrainOptions
from dspark_cli.runtime.train.run import load_target_model, prepare_run
from dspark_cli.runtime.train.trainer import DraftTrainer

runner = CliRunner()
CPU = torch.device("cpu")
SHAPE = DraftShape(layers=1, block_size=4, markov_rank=8)
OPTIONS = TrainOptions(steps=5, batch_size=2, seq_len=32, anchors=6, lr=1e-2, seed=3)
FEATURES = ["--seq-len", "32", "--records-per-shard", "4", "--target-layers", "0,1", "--device", "cpu"]


@pytest.fixture(scope="module")
def cache(tiny_pair, tmp_path_factory) -> Path:  # noqa: F811
    """Features of the tiny pair's data, written by the command (layers 0 and 1, records of 32 tokens)."""
    out = tmp_path_factory.mktemp("features") / "cache"
    result = runner.invoke(app, ["features", "--target", str(tiny_pair[0]), "--data", str(tiny_pair[1]), "-o",
                                 str(out), *FEATURES])
    assert result.exit_code == 0, result.output
    (out.parent / "output.txt").write_text(result.output)
    return out


def _data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensor data: the file less its 8-byte length and its JSON header."""
    with path.open("rb") as handle:
        header = struct.unpack("<Q", handle.read(8))[0]
    return path.stat().st_size - 8 - header


def test_printed_cost_per_token_is_the_written_files(cache):
    """The cost printed before writing (bytes per token) is what each shard's tensor data takes, token for token:
    (2 layers + last) x 32 x 4 bytes + 8 (id) + 1 (mask) = 393."""
    output = " ".join((cache.parent / "output.txt").read_text().split())
    printed = int(re.search(r"([\d,]+) bytes per token", output).group(1).replace(",", ""))
    assert printed == 3 * 32 * 4 + 9
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["bytes_per_token"] == printed and manifest["records"] > 4  # several shards
    for shard in manifest["shards"]:
        assert _data_bytes(cache / shard["file"]) == shard["tokens"] * printed
        assert (cache / shard["file"]).stat().st_size == shard["bytes"]
    assert manifest["tokens"] == sum(s["tokens"] for s in manifest["shards"]) == manifest["records"] * 32


def test_cached_records_are_the_targets_features(tiny_pair, cache):  # noqa: F811
    """A record holds the target's own features of its tokens: the layers' outputs and the post-norm last state."""
    store = FeatureCache.open(cache)
    record = store.record(len(store) - 1)
    model = load_target_model(tiny_pair[0], CPU)
    expected = capture_target_features(model, record.tokens[None], [0, 1])
    assert torch.equal(record.layers, expected.layers[0]) and torch.equal(record.last_hidden, expected.last_hidden[0])
    assert record.loss_mask.all()


def _job(tiny_pair, records_per_shard=4):  # noqa: F811
    return plan_corpus(tiny_pair[0], [tiny_pair[1]], [0, 1], 32, torch.float32, CPU,
                       records_per_shard=records_per_shard)


def test_resume_keeps_whole_shards_and_never_reads_a_partial_one(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    """An interrupted run leaves its finished shards whole and no shard under its final name that is not whole; the
    cache is not readable before its manifest; a rerun keeps the whole shards, removes the temporary file and
    writes the rest."""
    out = tmp_path / "cache"
    job = _job(tiny_pair)
    feature_cache.start_cache_folder(out, job.spec, claim(job, out, force=False))
    real_save = safetensors.torch.save_file
    calls = []

    def interrupted(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:  # the third shard: Ctrl-C halfway through writing its file
            Path(filename).write_bytes(b"partial")
            raise KeyboardInterrupt
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write(job, out)
    assert sorted(p.name for p in out.glob("shard-*")) == [shard_name(0), shard_name(1)]
    assert not list(out.glob(".*.tmp"))  # the interrupted shard's temporary file is removed on the way out
    stale = out / f".{shard_name(3)}.999.tmp"  # one a killed process (no cleanup) left for a later shard
    stale.write_bytes(b"partial")
    with pytest.raises(DsparkError, match="manifest.json is missing"):
        FeatureCache.open(out)
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*")}

    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    job = _job(tiny_pair)
    assert claim(job, out, force=False).resume
    progress = write(job, out)
    finish(job, out)
    assert progress.kept == 2
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # not rewritten
    assert not stale.exists() and not list(out.glob(".*"))
    assert len(FeatureCache.open(out)) == job.records


def test_a_shard_changed_after_writing_is_refused_and_rewritten(tiny_pair, cache, tmp_path):  # noqa: F811
    """A shard cut short after the manifest was written: reading refuses it in one sentence, and a rerun of the
    command (the same options) writes it again."""
    import shutil

    copy_dir = tmp_path / "cache"
    shutil.copytree(cache, copy_dir)
    shard = copy_dir / shard_name(1)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DsparkError, match="the cache was changed after it was written"):
        FeatureCache.open(copy_dir)
    job = _job(tiny_pair)
    assert write(job, copy_dir).kept == len(job.shards) - 1
    finish(job, copy_dir)
    assert len(FeatureCache.open(copy_dir)) == job.records


def test_an_output_of_another_spec_is_refused(tiny_pair, cache):  # noqa: F811
    """Continuing into a folder written with other options is one sentence naming the key."""
    job = plan_corpus(tiny_pair[0], [tiny_pair[1]], [1], 32, torch.float32, CPU)
    with pytest.raises(DsparkError, match=r"spec.json: layer_ids is \[0, 1\] but this run makes \[1\]"):
        claim(job, cache, force=False)


def _train_args(tiny_pair, cache, out, *extra):  # noqa: F811
    return ["train", "--target", str(tiny_pair[0]), "--features", str(cache), "-o", str(out), "--layers", "1",
            "--block-size", "4", "--markov-rank", "8", "--batch-size", "2", "--seq-len", "32", "--anchors", "6",
            "--steps", "2", "--device", "cpu", "--tau-every", "0", *extra]


def _edit_spec(cache: Path, folder: Path, **changes) -> Path:
    import shutil

    shutil.copytree(cache, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["spec"].update(changes)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("flags, changes, message", [
    (["--target-layers", "1"], {}, r"manifest.json: spec key 'layer_ids' is \[0, 1\] but the draft reads target "
                                   r"layers \[1\]; train with --target-layers 0,1"),
    ([], {"hidden_size": 48}, r"spec key 'hidden_size' is 48 but the target's is 32"),
    ([], {"dtype": "bfloat16"}, r"spec key 'dtype' is bfloat16 but training on cpu runs the target in float32"),
    ([], {"template_hash": "0" * 64}, r"spec key 'template_hash' differs from this run's chat template"),
    ([], {"tokenizer_hash": "0" * 64}, r"spec key 'tokenizer_hash' differs from this target's tokenizer"),
])
def test_train_checks_the_manifest_before_training(tiny_pair, cache, tmp_path, flags, changes, message):  # noqa: F811
    folder = _edit_spec(cache, tmp_path / "edited", **changes) if changes else cache
    result = runner.invoke(app, _train_args(tiny_pair, folder, tmp_path / "out", *flags))
    assert result.exit_code == 2, result.output
    assert re.search(message, " ".join(result.output.split())), result.output
    assert not (tmp_path / "out").exists()


def test_cached_training_equals_online_training(tiny_pair, cache, tmp_path):  # noqa: F811
    """Same seed, same draws of records and anchors, float32: the cached run's losses over 5 steps are the online
    run's (the online trainer runs the whole target on the same records) and so are the weights."""
    cached = prepare_run(tiny_pair[0], [], tmp_path / "out", SHAPE, OPTIONS, device="cpu", features=cache).trainer
    assert all(p.device.type == "meta" for p in cached.target.get_decoder().layers.parameters())  # never loaded
    records = FeatureCache.open(cache)
    rows = torch.stack([records.tokens(i) for i in range(len(records))])  # [N, 32]
    target = load_target_model(tiny_pair[0], CPU)
    draft = build_draft(cached.draft.config.raw, target)
    draft.load_state_dict(cached.draft.state_dict())  # the same initial weights
    online = DraftTrainer(target, draft, SequenceBank(rows), OPTIONS, CPU)
    losses = [(cached.run_step().value, online.run_step().value) for _ in range(OPTIONS.steps)]
    assert [a for a, _ in losses] == [b for _, b in losses], losses
    for (name, a), b in zip(cached.draft.named_parameters(), online.draft.parameters()):
        assert torch.equal(a, b), name


# --- speculators' hs files ----------------------------------------------------------------------------------------

def _write_hs_files(model, folder: Path, samples: list[torch.Tensor]) -> None:
    """Files in speculators' layout for aux ids [1, 2, 3] of the 3-layer target: the inputs of layers 1 and 2 (the
    outputs of layers 0 and 1), then the last layer's output BEFORE the final norm."""
    folder.mkdir()
    for index, tokens in enumerate(samples):
        raw = capture_target_features(model, tokens[None], [0, 1, 2]).layers[0].view(tokens.numel(), 3, -1)
        save_file({"hidden_states": raw.to(torch.bfloat16).contiguous(), "token_ids": tokens},
                  str(folder / f"hs_{index}.safetensors"))


def test_speculators_files_read_as_the_contract(tiny_pair, tmp_path):  # noqa: F811
    """Converted speculators files hold dspark's layer ids (aux id - 1) and the post-norm last state (the target's
    final norm applied to the stored pre-norm one), and train checks them like any cache."""
    model = load_target_model(tiny_pair[0], CPU)
    samples = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (40, 33)]
    _write_hs_files(model, tmp_path / "hs", samples)
    out = tmp_path / "cache"
    job = plan_speculators(tiny_pair[0], tmp_path / "hs", (1, 2, 3), torch.bfloat16, CPU)
    assert list(job.spec.layer_ids) == [0, 1] and job.tokens == 73
    feature_cache.start_cache_folder(out, job.spec, claim(job, out, force=False))
    write(job, out)
    finish(job, out)
    store = FeatureCache.open(out)
    for index, tokens in enumerate(samples):
        record = store.record(index)
        expected = capture_target_features(model, tokens[None], [0, 1])
        assert torch.equal(record.tokens, tokens)
        assert torch.equal(record.layers, expected.layers[0].to(torch.bfloat16))
        norm_of_stored = model.get_decoder().norm(
            capture_target_features(model, tokens[None], [2]).layers[0].to(torch.bfloat16).float())
        assert torch.equal(record.last_hidden, norm_of_stored.to(torch.bfloat16))
        torch.testing.assert_close(record.last_hidden.float(), expected.last_hidden[0], rtol=0.02, atol=0.02)


@pytest.mark.parametrize("ids, message", [((1, 2), "must end with the target's layer count 3"),
                                          ((1, 5, 3), "holds 5, but an aux layer id must be in 0..2")])
def test_speculators_layer_ids_are_checked(tiny_pair, tmp_path, ids, message):  # noqa: F811
    (tmp_path / "hs").mkdir()
    save_file({"hidden_states": torch.zeros(4, 3, 32), "token_ids": torch.arange(4)},
              str(tmp_path / "hs" / "hs_0.safetensors"))
    with pytest.raises(DsparkError, match=message):
        plan_speculators(tiny_pair[0], tmp_path / "hs", ids, torch.float32, CPU)


def test_two_processes_write_the_same_cache(tiny_pair, cache, tmp_path):  # noqa: F811
    """Under torchrun each rank writes its own shards (i mod 2) into the same folder and rank 0 the manifest: the
    records are the one-process cache's, tensor for tensor."""
    out = tmp_path / "cache"
    result = ranks.run(["-m", "dspark_cli", "features", "--target", str(tiny_pair[0]), "--data", str(tiny_pair[1]),
                        "-o", str(out), *FEATURES, "--dist-timeout", "60"], 2, 180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("bytes per token") == 1  # rank 0 alone reports
    one, two = (json.loads((folder / "manifest.json").read_text()) for folder in (cache, out))
    assert one["shards"] == two["shards"] and one["spec"]["layer_ids"] == two["spec"]["layer_ids"]
    for shard in one["shards"]:
        a, b = load_file(str(cache / shard["file"])), load_file(str(out / shard["file"]))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), shard["file"]


def test_memory_check_counts_no_decoder_layer_from_features(tiny_pair, cache, tmp_path, monkeypatch):  # noqa: F811
    """The memory check before a run counts the target's decoder layers only when they load: with a device whose
    free memory lies between the two estimates, training from features starts and online training is refused."""
    from dspark_cli.runtime import devices
    from dspark_cli.runtime.train.checks import plan_draft, run_memory_estimate
    from dspark_cli.runtime.train.run import load_tokenizer_and_config

    shape = replace(SHAPE, target_layers=(0, 1))
    tokenizer, target = load_tokenizer_and_config(tiny_pair[0])
    config, _ = plan_draft(target, tokenizer, shape, OPTIONS, 32, 1000, None, CPU)
    whole = run_memory_estimate(target.text, config, shape, OPTIONS, 32, CPU).total
    head = run_memory_estimate({**target.text, "num_hidden_layers": 0}, config, shape, OPTIONS, 32, CPU).total
    assert head < whole
    monkeypatch.setattr(devices, "available_memory", lambda device: (whole + head) // 2)
    prepare_run(tiny_pair[0], [], tmp_path / "cached", shape, OPTIONS, device="cpu", features=cache)
    with pytest.raises(DsparkError, match="one training step needs about"):
        prepare_run(tiny_pair[0], [tiny_pair[1]], tmp_path / "online", shape, OPTIONS, device="cpu")


def test_ctrl_c_says_which_shards_were_kept(tiny_pair, tmp_path, monkeypatch):  # noqa: F811
    """Ctrl-C while the third of 6 shards is written: exit 130, and the message counts the whole shards kept and says how
    to continue."""
    real_save, calls = safetensors.torch.save_file, []

    def interrupted(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    out = tmp_path / "cache"
    result = runner.invoke(app, ["features", "--target", str(tiny_pair[0]), "--data", str(tiny_pair[1]), "-o",
                                 str(out), *FEATURES])
    assert result.exit_code == 130, result.output
    text = " ".join(result.output.split())
    assert re.search(r"interrupted: 2 of 6 shards in \S+ are whole and kept; run the same command again to continue",
                     text), text
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors", "shard-00001.safetensors",
                                                     "spec.json"]


def _retokenized(target: Path, folder: Path, change: str) -> Path:
    """A copy of the target whose tokenizer keeps its vocabulary but changes one thing that sets the ids."""
    import shutil

    shutil.copytree(target, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if change == "merges":
        merges = tokenizer["model"]["merges"]
        merges[0], merges[-1] = merges[-1], merges[0]
    elif change == "normalizer":
        tokenizer["normalizer"] = {"type": "Lowercase"}
    elif change == "pre_tokenizer":
        tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, tokenizer["pre_tokenizer"]]}
    elif change == "special":  # EOS moved to the other added special token: the definition itself is unchanged
        config["eos_token"] = next(token["content"] for token in tokenizer["added_tokens"] if token["id"] == 1)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change", ["merges", "normalizer", "pre_tokenizer", "special"])
def test_a_cache_of_another_tokenizer_with_the_same_vocabulary_is_refused(tiny_pair, cache, tmp_path,  # noqa: F811
                                                                          change):
    """Same vocabulary, same target weights: merges in another order, a normalizer, another pre-tokenizer step or
    another EOS id each change the ids of the same text, so the tokenizer hash differs (an unchanged copy's does not)
    and train --features refuses the cache before training."""
    from transformers import AutoTokenizer

    from dspark_cli.runtime.train.features import tokenizer_hash

    original = AutoTokenizer.from_pretrained(tiny_pair[0])
    target = _retokenized(tiny_pair[0], tmp_path / "target", change)
    other = AutoTokenizer.from_pretrained(target)
    assert other.get_vocab() == original.get_vocab()
    assert (other.eos_token_id != original.eos_token_id) == (change == "special")
    assert tokenizer_hash(other) != tokenizer_hash(original)
    assert tokenizer_hash(AutoTokenizer.from_pretrained(tiny_pair[0])) == tokenizer_hash(original)
    if change == "merges":
        args = _train_args((target, tiny_pair[1]), cache, tmp_path / "out")
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "spec key 'tokenizer_hash' differs from this target's tokenizer" in " ".join(result.output.split())
        assert not (tmp_path / "out").exists()
