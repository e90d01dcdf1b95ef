"""A user's files are never lost or overwritten: output/input overlap, --json/--plot paths, exclusive output
folders, symlinks and modes in quantize's copies, the umask, SIGTERM/Ctrl-C and atomic train checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ckpt_factory import DraftSpec, write_draft
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.errors import EXIT_TERMINATED, DsparkError, Terminated
from dspark_cli.runtime.io import outputs as files
from dspark_cli.runtime.quantize import write as quantize_module
from dspark_cli.runtime.io.outputs import (atomic_output_dir, atomic_write_text, check_output_file,
                                      refuse_input_overlap)
from dspark_cli.runtime.checkpoint.read import list_checkpoint_files
from dspark_cli.runtime.quantize.write import quantize_checkpoint

SPEC = DraftSpec(markov_rank=64)
runner = CliRunner()


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def words(text: str) -> str:
    return " ".join(text.translate(str.maketrans("│╭╮╰╯─", "      ")).split())


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def draft(tmp_path):
    return write_draft(tmp_path / "draft", SPEC)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


# --- the overlap guard ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where, message", [("same", "is the"), ("inside", "is inside"), ("parent", "contains")])
def test_overlap_guard_refuses_same_inside_and_containing(tmp_path, where, message):
    data = tmp_path / "data"
    data.mkdir()
    out = {"same": data, "inside": data / "sub" / "out", "parent": tmp_path}[where]
    with pytest.raises(DsparkError, match=message):
        refuse_input_overlap(out, [("training data", data)], "output folder")


def test_overlap_guard_resolves_symlinks_and_the_current_folder(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "link").symlink_to(data)
    with pytest.raises(DsparkError, match="is the training data"):
        refuse_input_overlap(tmp_path / "link", [("training data", data)])
    with pytest.raises(DsparkError, match="is inside"):
        refuse_input_overlap(tmp_path / "link" / "out", [("training data", data)])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DsparkError, match="contains"):
        refuse_input_overlap(Path("."), [("training data", Path("data"))])


def test_overlap_guard_allows_siblings_with_a_common_prefix(tmp_path):
    refuse_input_overlap(tmp_path / "data2", [("training data", tmp_path / "data"), ("target", None)])


# --- dspark train -o: refused before anything is deleted ---------------------------------------------------------------


@pytest.fixture
def train_inputs(tmp_path):
    """(target folder, data folder, a foreign checkpoint folder), fake: the output checks run before any loading."""
    target, data, ckpt = tmp_path / "target", tmp_path / "work" / "data", tmp_path / "other" / "checkpoint-2"
    for folder, name in ((target, "config.json"), (data, "a.txt"), (ckpt, "trainer_state.json")):
        folder.mkdir(parents=True)
        (folder / name).write_text("{}")
    return target, data, ckpt


@pytest.mark.parametrize("out_of", ["data", "data/sub", "work", "target", "target/draft", "."])
@pytest.mark.parametrize("force", [False, True])
def test_train_refuses_an_output_overlapping_its_inputs(tmp_path, train_inputs, monkeypatch, out_of, force):
    target, data, _ = train_inputs
    monkeypatch.chdir(tmp_path / "work")
    out = {"data": data, "data/sub": data / "sub", "work": tmp_path / "work", "target": target,
           "target/draft": target / "draft", ".": Path(".")}[out_of]
    before = digest(tmp_path)
    args = ["train", "--target", str(target), "--data", str(data), "-o", str(out), "--device", "cpu"]
    result = runner.invoke(app, args + (["--force"] if force else []))
    assert result.exit_code == 2, result.output
    assert "output folder" in words(result.stderr) and "Traceback" not in result.output
    assert digest(tmp_path) == before


def test_train_refuses_an_output_holding_a_data_file(tmp_path, train_inputs):
    from dspark_cli.runtime.train.output import check_output

    target, data, _ = train_inputs
    with pytest.raises(DsparkError, match="contains the training data"):
        check_output(data.parent, target, [data / "a.txt"], None, None, force=True)
    assert (data / "a.txt").exists()


def test_train_resume_into_another_existing_folder_needs_force(tmp_path, train_inputs):
    from dspark_cli.runtime.train.output import check_output

    target, data, ckpt = train_inputs
    out = tmp_path / "draft"
    out.mkdir()
    (out / "model.safetensors").write_text("a finished draft")
    with pytest.raises(DsparkError, match="already exists"):
        check_output(out, target, [data], ckpt, None, force=False)
    claim = check_output(ckpt.parent, target, [data], ckpt, None, force=False)  # continue a run in place
    assert claim.in_place
    with pytest.raises(DsparkError, match="holds the checkpoint to resume"):  # force would delete it
        check_output(ckpt.parent, target, [data], ckpt, None, force=True)


@pytest.mark.parametrize("appeared", ["empty", "full"])
def test_train_output_created_meanwhile_is_refused(tmp_path, train_inputs, appeared):
    from dspark_cli.runtime.train.output import check_output, create_output

    target, data, _ = train_inputs
    out = tmp_path / "out"
    claim = check_output(out, target, [data], None, None, force=False)
    out.mkdir()  # another run got there while this one loaded its target
    if appeared == "full":
        (out / "config.json").write_text("theirs")
    with pytest.raises(DsparkError, match="created by someone else"):
        create_output(out, claim)
    assert appeared == "empty" or (out / "config.json").read_text() == "theirs"


def test_outputs_that_are_files_or_under_files_are_refused(tmp_path, train_inputs, draft):
    from dspark_cli.runtime.train.output import check_output

    target, data, _ = train_inputs
    (tmp_path / "file").write_text("mine")
    with pytest.raises(DsparkError, match="is not a folder"):
        check_output(tmp_path / "file", target, [data], None, None, force=True)
    with pytest.raises(DsparkError, match="is not a folder"):
        check_output(tmp_path / "file" / "out", target, [data], None, None, force=False)
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(tmp_path / "file" / "q"), "--engine", "torch"])
    assert result.exit_code == 2 and "is not a folder" in words(result.stderr) and "Traceback" not in result.output
    assert (tmp_path / "file").read_text() == "mine"


def test_train_accepts_an_existing_empty_folder(tmp_path, train_inputs):
    from dspark_cli.runtime.train.output import check_output, create_output

    target, data, _ = train_inputs
    out = tmp_path / "out"
    out.mkdir()
    create_output(out, check_output(out, target, [data], None, None, force=False))
    assert out.is_dir()


# --- --json / --plot paths ------------------------------------------------------------------------------------------


def test_output_file_check(tmp_path, draft):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    (tmp_path / "plain.txt").write_text("")
    inputs = [("prompts file", prompts), ("draft checkpoint", draft)]
    check_output_file("-", inputs, "--json file")
    check_output_file(None, inputs, "--json file")
    check_output_file(tmp_path / "new" / "report.json", inputs, "--json file")
    for path, message in ((prompts, "is the prompts file"), (draft / "config.json", "is inside the draft"),
                          (draft / "model.safetensors", "is inside the draft"), (tmp_path, "contains"),
                          (tmp_path / "new_folder", "is a folder"), (tmp_path / "plain.txt" / "x.json", "not a folder")):
        if path.name == "new_folder":
            path.mkdir()
        with pytest.raises(DsparkError, match=message):
            check_output_file(path, inputs, "--json file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any folder")
def test_output_file_in_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(DsparkError, match="not writable"):
            check_output_file(folder / "r.json", [], "--json file")
    finally:
        folder.chmod(0o700)


def test_generate_json_refuses_the_drafts_config_before_running(tmp_path):
    import shutil

    from dspark_cli.runtime.demo import demo_pair

    target_dir, draft_dir = (shutil.copytree(path, tmp_path / path.name) for path in demo_pair())
    before = (draft_dir / "config.json").read_bytes()
    result = runner.invoke(app, ["generate", "hi", "--target", str(target_dir), "--draft", str(draft_dir),
                                 "--json", str(draft_dir / "config.json"), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "is inside the draft checkpoint" in words(result.stderr)
    assert (draft_dir / "config.json").read_bytes() == before


@pytest.mark.parametrize("case", ["prompts", "folder"])
def test_generate_json_refuses_the_prompts_file_and_folders(tmp_path, case):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    target = {"prompts": prompts, "folder": tmp_path}[case]
    result = runner.invoke(app, ["generate", "--prompts", str(prompts), "--json", str(target), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert ("is the prompts file" if case == "prompts" else "contains the prompts file") in words(result.stderr)
    assert prompts.read_text() == "hello\n"


@pytest.mark.parametrize("option, name, message", [
    ("--json", "config.json", "is inside the draft checkpoint"),
    ("--plot", "model.safetensors", "is inside the draft checkpoint"),
    ("--json", "", "is the draft checkpoint"),
])
def test_bench_refuses_outputs_in_the_draft_before_running(draft, option, name, message):
    before = digest(draft)
    result = runner.invoke(app, ["bench", "markov", "--draft", str(draft), option, str(draft / name)])
    assert result.exit_code == 2, result.output
    assert message in words(result.stderr)
    assert digest(draft) == before


def test_bench_refuses_a_folder_and_the_same_file_twice(tmp_path):
    result = runner.invoke(app, ["bench", "markov", "--json", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder" in words(result.stderr)
    result = runner.invoke(app, ["bench", "markov", "--json", str(tmp_path / "a"), "--plot", str(tmp_path / "a")])
    assert result.exit_code == 2 and "--plot file" in words(result.stderr) and "is the --json file" in words(result.stderr)


# --- exclusive, atomic output folders -----------------------------------------------------------------------------------


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "portable"])
@pytest.mark.parametrize("appeared", ["empty", "full"])
def test_output_folder_that_appears_meanwhile_is_never_replaced(tmp_path, monkeypatch, renameat2, appeared):
    if not renameat2:
        monkeypatch.setattr(files, "_renameat2", None)
    elif files._renameat2 is None:
        pytest.skip("renameat2 is Linux-only")
    out = tmp_path / "out"
    with pytest.raises(DsparkError, match="appeared while"):
        with atomic_output_dir(out) as folder:
            (folder / "mine.txt").write_text("mine")
            out.mkdir()  # another run finished first
            if appeared == "full":
                (out / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp folder left
    assert [p.name for p in out.iterdir()] == ([] if appeared == "empty" else ["theirs.txt"])


def test_portable_rename_refuses_an_existing_destination(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_renameat2", None)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        files.rename_noreplace(tmp_path / "a", tmp_path / "b")
    files.rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c").is_dir() and (tmp_path / "b").read_text() == "b"


def test_two_quantize_runs_racing_for_one_output(draft, tmp_path, monkeypatch):
    """The second run to finish fails in one sentence and the first run's output is kept."""
    real = quantize_module.write_quantized_checkpoint
    out = tmp_path / "out"

    def first_run_finishes_meanwhile(*args, **kwargs):
        result = real(*args, **kwargs)
        monkeypatch.setattr(quantize_module, "write_quantized_checkpoint", real)
        quantize_checkpoint(draft, out, engine="torch")
        (out / "first.txt").write_text("first")
        return result

    monkeypatch.setattr(quantize_module, "write_quantized_checkpoint", first_run_finishes_meanwhile)
    result = runner.invoke(app, ["quantize", str(draft), "-o", str(out), "--engine", "torch"])
    assert result.exit_code == 2 and "appeared while" in words(result.stderr)
    assert (out / "first.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "out"]


def test_force_replaces_despite_a_stale_old_folder(draft, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    (tmp_path / ".out.old").mkdir()  # left by an older dspark that was killed mid-replace
    (tmp_path / ".out.old" / "x").write_text("x")
    quantize_checkpoint(draft, out, engine="torch", force=True)
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    assert not (out / "old.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "draft", "out"]


def test_force_replaces_an_output_file(tmp_path):
    out = tmp_path / "out"
    out.write_text("a file")
    with atomic_output_dir(out, force=True) as folder:
        (folder / "new.txt").write_text("new")
    assert (out / "new.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_json_report_appearing_meanwhile_is_never_replaced(tmp_path, monkeypatch):
    """emit_json without force publishes exclusively: a file that appears after the up-front check (another run) is
    left as it is and the temporary file removed; with force it is replaced; '-' is stdout."""
    from dspark_cli.cli.render import emit_json

    if files._renameat2 is None:
        pytest.skip("needs renameat2: elsewhere the rename is a check, then a rename")
    path = tmp_path / "report.json"
    path.write_text("theirs")
    with pytest.raises(DsparkError, match="already exists"):
        emit_json({"a": 1}, path)
    real = os.path.lexists
    monkeypatch.setattr(files.os.path, "lexists", lambda p: False if Path(p) == path else real(p))
    with pytest.raises(DsparkError, match="appeared while"):
        emit_json({"a": 1}, path)  # past the check: the rename itself refuses
    monkeypatch.undo()
    assert path.read_text() == "theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    emit_json({"a": 1}, path, force=True)
    assert json.loads(path.read_text()) == {"a": 1}


# --- quantize: only regular files inside the checkpoint, modes kept ------------------------------------------------------


def test_quantize_skips_files_that_lead_outside_the_checkpoint(draft, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the draft")
    (draft / "README.md").symlink_to(secret)
    (draft / "passwd").symlink_to("/etc/passwd")
    (draft / "tokenizer.json").write_text("{}")
    report = quantize_checkpoint(draft, tmp_path / "out", engine="torch")
    out = tmp_path / "out"
    assert not (out / "README.md").exists() and not (out / "passwd").exists()
    assert (out / "tokenizer.json").read_text() == "{}"
    assert sum("README.md was not copied" in w for w in report.warnings) == 1
    assert any("passwd was not copied" in w for w in report.warnings)


def test_quantize_refuses_a_weight_shard_outside_the_checkpoint(tmp_path):
    source = write_draft(tmp_path / "draft", SPEC, shards=2)
    shard = sorted(source.glob("model-*.safetensors"))[-1]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    with pytest.raises(DsparkError, match="inside the checkpoint"):
        quantize_checkpoint(source, tmp_path / "out", engine="torch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "elsewhere.safetensors"]


def test_checkpoint_files_count_hub_blobs_of_the_same_repo_only(tmp_path):
    repo = tmp_path / "hub" / "models--org--draft"
    snapshot, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "abc").write_text("weights")
    (snapshot / "model.safetensors").symlink_to(os.path.relpath(blobs / "abc", snapshot))
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    (other / "def").write_text("someone else's")
    (snapshot / "README.md").symlink_to(other / "def")
    (snapshot / "folder").mkdir()
    os.mkfifo(snapshot / "fifo")
    assert list_checkpoint_files(snapshot) == (["model.safetensors"], ["README.md", "fifo"])  # folders: not files
    plain = tmp_path / "plain"  # a folder not named like a hub snapshot gets no blobs/ allowance
    plain.mkdir()
    (plain / "x").symlink_to(blobs / "abc")
    assert list_checkpoint_files(plain) == ([], ["x"])


def test_quantize_keeps_file_modes(tmp_path, umask_027):
    source = write_draft(tmp_path / "draft", SPEC, shards=2)
    (source / "tokenizer.json").write_text("{}")
    for path in source.iterdir():
        path.chmod(0o600)
    out = tmp_path / "out"
    quantize_checkpoint(source, out, engine="torch")
    assert mode(out) == 0o750  # 0777 minus the umask, not mkdtemp's 0700
    assert {p.name: mode(p) for p in out.iterdir() if p.name != "hf_quant_config.json"} == {
        p.name: 0o600 for p in source.iterdir()}
    assert mode(out / "hf_quant_config.json") == 0o640  # a new file: 0666 minus the umask


# --- the umask --------------------------------------------------------------------------------------------------------


def test_atomic_files_and_folders_follow_the_umask(tmp_path, umask_027):
    atomic_write_text(tmp_path / "new.json", "{}")
    assert mode(tmp_path / "new.json") == 0o640
    (tmp_path / "mine.json").write_text("old")
    (tmp_path / "mine.json").chmod(0o600)
    atomic_write_text(tmp_path / "mine.json", "new")
    assert mode(tmp_path / "mine.json") == 0o600  # a replaced file keeps its mode
    with atomic_output_dir(tmp_path / "out") as folder:
        (folder / "a").write_text("a")
    assert mode(tmp_path / "out") == 0o750


# --- interrupts ---------------------------------------------------------------------------------------------------------

SLOW_QUANTIZE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dspark_cli.runtime.quantize import write as quantize

    real, marker = quantize.write_quantized_checkpoint, Path(sys.argv[1])

    def slow(*args, **kwargs):
        result = real(*args, **kwargs)
        marker.write_text("written")
        time.sleep(120)
        return result

    quantize.write_quantized_checkpoint = slow
    from dspark_cli.cli import main
    sys.argv = ["dspark", *sys.argv[2:]]
    main()
""")


@pytest.mark.parametrize("signum, code, word", [(signal.SIGTERM, EXIT_TERMINATED, "terminated"),
                                                (signal.SIGINT, 130, "interrupted")])
def test_signal_during_quantize_leaves_nothing(draft, tmp_path, signum, code, word):
    """A real `dspark quantize` process, signalled once its temporary output folder is written."""
    parent, marker = tmp_path / "outputs", tmp_path / "written"
    parent.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-c", SLOW_QUANTIZE, str(marker), "quantize", str(draft),
                                "-o", str(parent / "out"), "--engine", "torch"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), process.communicate(timeout=60)
        assert [p.name for p in parent.iterdir()][0].startswith(".out.")  # the temporary folder is there
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, stderr
    assert f"{word}: nothing was written" in words(stderr) and "Traceback" not in stderr
    assert list(parent.iterdir()) == []


# --- train: checkpoints whole or not at all, and a truthful interrupt message -------------------------------------------


@pytest.fixture(scope="module")
def tiny_train_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder with tokenizer, data file): a random 2-layer Qwen3 and a little text."""
    from dspark_cli.runtime.train.tiny_target import TargetGeometry, build_tokenizer

    root = tmp_path_factory.mktemp("train")
    data = root / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    tokenizer = build_tokenizer([data], vocab_size=300)
    target = TargetGeometry(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16).build(tokenizer.eos_token_id, 0)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    return root / "target", data


def train_args(pair: tuple[Path, Path], out: Path) -> list[str]:
    return ["train", "--target", str(pair[0]), "--data", str(pair[1]), "-o", str(out), "--steps", "4",
            "--save-every", "2", "--batch-size", "2", "--seq-len", "32", "--layers", "1", "--block-size", "4",
            "--markov-rank", "8", "--device", "cpu"]


@pytest.mark.parametrize("out_existed", [False, True])
def test_train_interrupted_during_a_checkpoint_save_leaves_no_half_checkpoint(tmp_path, tiny_train_pair,
                                                                              monkeypatch, out_existed):
    import safetensors.torch

    real = safetensors.torch.save_file

    def stop_at_trainer_state(tensors, filename, *args, **kwargs):
        if Path(filename).name == "trainer_state.safetensors":
            raise Terminated()
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", stop_at_trainer_state)
    out = tmp_path / "out"
    if out_existed:
        out.mkdir()
    result = runner.invoke(app, train_args(tiny_train_pair, out))
    assert result.exit_code == EXIT_TERMINATED, result.output
    # neither checkpoint-2 (half written) nor its temporary folder; an empty folder this run made is removed
    if out_existed:
        assert list(out.iterdir()) == [] and f"no checkpoint was written in {out}" in words(result.stderr)
    else:
        assert not out.exists() and "terminated: nothing was written" in words(result.stderr)


def test_train_interrupt_names_the_checkpoint_it_kept(tmp_path, tiny_train_pair, monkeypatch):
    from dspark_cli.runtime.train.trainer import DraftTrainer

    real = DraftTrainer.run_step

    def interrupt_at_step_3(self):
        if self.step == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(DraftTrainer, "run_step", interrupt_at_step_3)
    out = tmp_path / "out"
    result = runner.invoke(app, train_args(tiny_train_pair, out))
    assert result.exit_code == 130, result.output
    assert f"the latest checkpoint {out / 'checkpoint-2'} was kept" in words(result.stderr)
    assert "nothing was written" not in result.stderr
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == [
        "config.json", "model.safetensors", "trainer_state.json", "trainer_state.safetensors"]


def test_train_interrupted_before_writing_removes_the_folder_it_created(tmp_path, tiny_train_pair, monkeypatch):
    from dspark_cli.runtime.train.trainer import DraftTrainer

    monkeypatch.setattr(DraftTrainer, "run_step", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    result = runner.invoke(app, train_args(tiny_train_pair, tmp_path / "out"))
    assert result.exit_code == 130 and "interrupted: nothing was written" in words(result.stderr)
    assert not (tmp_path / "out").exists()


def test_an_interrupt_names_every_output_still_there(tmp_path, tiny_train_pair, monkeypatch):
    """train's own sentence covers its output folder; the --log-jsonl file it opened is on disk too, so the message
    names it instead of saying "nothing was written" (outputs.kept_sentence adds what the command's sentence does
    not name)."""
    from dspark_cli.runtime.train.trainer import DraftTrainer

    monkeypatch.setattr(DraftTrainer, "run_step", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    log = tmp_path / "log.jsonl"
    result = runner.invoke(app, [*train_args(tiny_train_pair, tmp_path / "out"), "--log-jsonl", str(log)])
    assert result.exit_code == 130 and log.is_file() and not (tmp_path / "out").exists()
    assert f"interrupted: already written and kept: {log}" in words(result.stderr)
    assert "nothing was written" not in result.stderr


def test_what_was_kept_names_each_output_still_there_once(tmp_path):
    """The one sentence about what is on disk: a command's own sentence (its main output) plus every other recorded
    output still there, none named twice, none that is gone (a temporary file renamed into place)."""
    from dspark_cli.runtime.io import outputs

    outputs.forget_written()  # a new command
    run, log, moved = tmp_path / "run.json", tmp_path / "log.jsonl", tmp_path / ".run.json.x.tmp"
    for path in (run, log, moved):
        path.write_text("x")
        outputs.record_written(path)
    moved.unlink()
    try:
        assert outputs.kept_sentence() == f"already written and kept: {run}, {log}"
        assert outputs.kept_sentence(f"{run} keeps 2 prompts") == f"{run} keeps 2 prompts; also written and kept: {log}"
        assert outputs.unnamed_outputs(f"cannot write {log}") == [run]
        outputs.forget_written()
        assert outputs.kept_sentence() == "nothing was written"
    finally:
        outputs.forget_written()
