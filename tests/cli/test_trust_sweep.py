"""A hostile sweep of the commands, one class of bad input or hostile environment at a time (issue 22's classes).

Every case runs the real CLI in-process (Typer's CliRunner) on copies of the shipped demo pair, tampered as a new
user might: flags that write pointed at inputs, a target whose config, tokenizer or weights are broken, full disks
and a SIGTERM mid-run, unbounded counts, serve's hand-off to a broken vllm, a draft vLLM cannot build; and issue
37's: side files written outside the output check, servers whose replies break off, are not HTTP, do not stream or
stream another schema, and words and exits that were not true (a ragged run file, a resumed run given the values it
resolved to, serve's help). Each case asserts its exit code, one sentence on stderr naming the file or flag (no
traceback), that no input's bytes changed, and that what the message says was kept is what is on disk.

    python tests/cli/test_trust_sweep.py          # the same cases without pytest: one line each, then "N/N OK"
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from dspark_cli.cli import app
from dspark_cli.runtime.demo import DEMO_DIR

runner = CliRunner()


# --- the workspace: copies of the demo pair, tampered on demand -----------------------------------------------------


class Workspace:
    """A folder holding a pristine copy of the demo pair and, per case, tampered copies of its target or draft."""

    def __init__(self, root: Path):
        self.root = root
        self.target = self.copy(DEMO_DIR / "target", "target")
        self.draft = self.copy(DEMO_DIR / "draft", "draft")
        self.data = root / "data.txt"
        self.data.write_text("def add(a, b):\n    return a + b\n" * 40)
        self.pristine = fingerprint(self.target, self.draft, self.data)
        self.servers: dict = {}

    def server(self, kind: str):
        """A stand-in engine, started on first use and kept for the module: "regen" (regen's llama.cpp API),
        "json" / "tgi" (bench serve's /v1/completions answered without streaming / streamed in another schema)."""
        if kind not in self.servers:
            if kind == "regen":
                from regen_server import FakeServer

                self.servers[kind] = FakeServer()
            else:
                from fake_engine import FakeEngine

                self.servers[kind] = FakeEngine(flavour="openai", tokens=3, answer=kind).__enter__()
        return self.servers[kind]

    def close(self) -> None:
        for server in self.servers.values():
            server.close() if hasattr(server, "close") else server.__exit__(None, None, None)

    def run_file(self) -> Path:
        """A run file of one prompt of the demo pair (block size 7 by default, device auto: cpu here)."""
        path = self.root / "run-one.json"
        if not path.exists():
            done = runner.invoke(app, ["eval", "--data", str(DEMO_DIR / "eval_code.jsonl"), "--limit", "1",
                                       "--max-new-tokens", "16", "--json", str(path)])
            assert done.exit_code == 0, done.output
        return path

    def restore(self) -> None:
        """Put the pristine pair back if a case changed it (so one bug does not hide behind another)."""
        if fingerprint(self.target, self.draft, self.data) != self.pristine:
            for folder, source in ((self.target, DEMO_DIR / "target"), (self.draft, DEMO_DIR / "draft")):
                shutil.rmtree(folder)
                shutil.copytree(source, folder)
            self.data.write_text("def add(a, b):\n    return a + b\n" * 40)

    def copy(self, source: Path, name: str) -> Path:
        destination = self.root / name
        if not destination.exists():
            shutil.copytree(source, destination)
        return destination

    def path(self, name: str) -> Path:
        return self.root / name

    def target_with(self, name: str, change: Callable[[Path], None]) -> Path:
        """A copy of the demo target changed by `change(folder)`."""
        folder = self.root / f"target-{name}"
        if not folder.exists():
            shutil.copytree(self.target, folder)
            change(folder)
        return folder

    def draft_with(self, name: str, **config) -> Path:
        folder = self.root / f"draft-{name}"
        if not folder.exists():
            shutil.copytree(self.draft, folder)
            edit_json(folder / "config.json", lambda c: {**c, **config})
        return folder


def edit_json(path: Path, change: Callable) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def config_edit(**values) -> Callable[[Path], None]:
    return lambda folder: edit_json(folder / "config.json", lambda c: {**c, **values})


def write_file(name: str, text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(text)


def truncate_weights(folder: Path) -> None:
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)


def header_lies_about_a_shape(folder: Path) -> None:
    """embed_tokens [V, H] stored as [V/2, 2H]: the same bytes, a shape the config does not imply."""
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + length])
    rows, cols = header["model.embed_tokens.weight"]["shape"]
    header["model.embed_tokens.weight"]["shape"] = [rows // 2, cols * 2]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length, b" ")
    assert len(text) == length
    path.write_bytes(raw[:8] + text + raw[8 + length :])


def fingerprint(*paths: Path) -> dict[str, str]:
    """sha256 of every file under `paths` (the inputs whose bytes must not change)."""
    out = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# --- cases --------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    klass: str  # the class: writes, target, disk, bounds, serve, vllm
    name: str
    argv: Callable[[Workspace], list[str]]
    exit_code: int
    needles: tuple[str, ...]  # must appear in the message (whitespace-normalised)
    inputs: Callable[[Workspace], list[Path]] = lambda ws: [ws.target, ws.draft, ws.data]
    absent: Callable[[Workspace], list[Path]] = lambda ws: []  # outputs a refused run must not leave behind
    patch: Callable[[Workspace, pytest.MonkeyPatch], None] | None = None
    after: Callable[[Workspace, str], None] | None = None  # more checks on disk, given the message
    forbidden: tuple[str, ...] = ("Traceback", "nothing was written")  # must not appear (unless absent is true)
    env: dict[str, str] = field(default_factory=dict)


def train(ws: Workspace, out: str, *args: str) -> list[str]:
    return ["train", "--target", str(ws.target), "--data", str(ws.data), "-o", str(ws.path(out)), "--steps", "2",
            "--batch-size", "2", "--seq-len", "32", "--device", "cpu", *args]


def generate(target: Path, ws: Workspace, *args: str) -> list[str]:
    return ["generate", "--target", str(target), "--draft", str(ws.draft), "--max-new-tokens", "4", *args, "hello"]


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]) if args else None)


def full_disk_for(name_prefix: str):
    """A patch of tempfile.mkstemp: temporary files for `name_prefix` get a descriptor on /dev/full, so writing them
    fails with ENOSPC as on a full disk (the temporary file itself exists and must be removed)."""
    real = tempfile.mkstemp

    def patched(*args, **kwargs):
        fd, path = real(*args, **kwargs)
        if Path(path).name.startswith(name_prefix):
            os.close(fd)
            fd = os.open("/dev/full", os.O_WRONLY)
        return fd, path

    def apply(ws: Workspace, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(tempfile, "mkstemp", patched)

    return apply


def no_temporary_files(folder_name: str):
    def check(ws: Workspace, message: str) -> None:
        leftovers = [p.name for p in ws.root.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
        assert not leftovers, leftovers

    return check


def terminate_after(prompts: int):
    """Pair.generate raises Terminated (what the CLI's SIGTERM handler raises) once `prompts` prompts finished."""
    from dspark_cli.errors import Terminated
    from dspark_cli.runtime.pair import Pair

    real = Pair.generate
    calls = {"n": 0}

    def patched(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > prompts + 1:  # the first call is eval's warm-up
            raise Terminated()
        return real(self, *args, **kwargs)

    def apply(ws: Workspace, mp: pytest.MonkeyPatch) -> None:
        calls["n"] = 0
        mp.setattr(Pair, "generate", patched)

    return apply


def run_file_holds(count: int, name: str):
    def check(ws: Workspace, message: str) -> None:
        document = json.loads(ws.path(name).read_text())
        assert len(document["results"]) == count, len(document["results"])
        assert f"the {count} finished prompts are saved in" in message

    return check


def fake_vllm(content: bytes):
    def apply(ws: Workspace, mp: pytest.MonkeyPatch) -> None:
        folder = ws.root / f"bin-{hashlib.sha256(content).hexdigest()[:8]}"
        folder.mkdir(exist_ok=True)
        (folder / "vllm").write_bytes(content)
        (folder / "vllm").chmod(0o755)
        mp.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")

    return apply


def quantize_json_full(ws: Workspace, message: str) -> None:
    assert (ws.path("q-json") / "model.safetensors").is_file()  # OUT was written, and the message says so
    assert not ws.path("q.json").exists()
    no_temporary_files("")(ws, message)


SERVE = lambda ws, *extra: ["serve", "--target", str(ws.target), "--draft", str(ws.draft), "--dry-run", "--",
                            *extra]
TRTLLM = lambda ws, *extra: ["serve", "--target", str(ws.target), "--draft", str(ws.draft), "--engine", "trtllm",
                             *extra]
YAML = "dspark-trtllm.yaml"


def in_folder(ws: Workspace, name: str, files: dict[str, str] | None = None) -> Path:
    """A fresh folder of the workspace holding `files` (name -> text)."""
    folder = ws.path(name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for file, text in (files or {}).items():
        (folder / file).write_text(text)
    return folder


PLAN = json.dumps({"format": "dspark-plan/1", "speculative_config": {"num_speculative_tokens": 5}})


def regen_prompts(ws: Workspace, fault: str) -> list[str]:
    """regen of four conversations, the second hitting `fault` at the stand-in server (CUT, NOTHTTP)."""
    prompts = ws.path(f"regen-{fault}.jsonl")
    prompts.write_text("".join(json.dumps({"turns": [text]}) + "\n" for text in ("one", fault, "three", "four")))
    out = ws.path(f"regen-{fault}-out.jsonl")
    for path in (out, out.with_name(out.stem + "_error.jsonl")):
        path.unlink(missing_ok=True)
    return ["regen", str(prompts), "-o", str(out), "--url", ws.server("regen").url, "--concurrency", "2"]


def regen_kept(fault: str, error: str):
    def check(ws: Workspace, message: str) -> None:
        out = ws.path(f"regen-{fault}-out.jsonl")
        assert sorted(json.loads(line)["index"] for line in out.read_text().splitlines()) == [0, 2, 3]
        [record] = [json.loads(line) for line in out.with_name(out.stem + "_error.jsonl").read_text().splitlines()]
        assert record["index"] == 1 and error in record["error"], record

    return check


def bench_serve(ws: Workspace, kind: str, *extra: str) -> list[str]:
    out = ws.path(f"serve-{kind}.json")
    out.unlink(missing_ok=True)
    return ["bench", "serve", ws.server(kind).url, "--concurrency", "1", "--requests", "2", "--json", str(out), *extra]


def only_existing_files_named(kind: str):
    def check(ws: Workspace, message: str) -> None:
        assert f"Already written and kept: {ws.path(f'serve-{kind}.json')}." in message and ".tmp" not in message

    return check


def replaced(path: Path) -> None:
    assert path.read_text().startswith("speculative_config:"), path.read_text()


def ragged_run(ws: Workspace) -> Path:
    """The workspace's run file with its last round cut to 3 positions (consistent within the round)."""
    document = json.loads(ws.run_file().read_text())
    last = document["results"][0]["rounds"][-1]
    last.update(drafted=3, proposed=min(last["proposed"], 3), accepted=min(last["accepted"], 3),
                confidences=last["confidences"][:3], confidence_logits=last["confidence_logits"][:3])
    last["emitted"] = last["accepted"] + 1
    path = ws.path("run-ragged.json")
    path.write_text(json.dumps(document))
    return path


def resume_with(ws: Workspace, *flags: str) -> list[str]:
    path = ws.path("run-resume.json")
    shutil.copy(ws.run_file(), path)
    return ["eval", "--resume", str(path), *flags]

CASES = [
    # 1. every flag that writes goes through the overlap and output checks before any work
    Case("writes", "log-jsonl-is-the-target-config", lambda ws: train(ws, "o1", "--log-jsonl",
         str(ws.target / "config.json")), 2, ("--log-jsonl file", "inside the target"),
         absent=lambda ws: [ws.path("o1")], forbidden=("Traceback",)),
    Case("writes", "log-jsonl-is-the-data", lambda ws: train(ws, "o1", "--log-jsonl", str(ws.data)), 2,
         ("is the training data",), absent=lambda ws: [ws.path("o1")], forbidden=("Traceback",)),
    Case("writes", "log-jsonl-links-into-the-target", lambda ws: train(ws, "o1", "--log-jsonl", str(
         _link(ws.path("log-link.jsonl"), ws.target / "tokenizer.json"))), 2, ("inside the target",),
         absent=lambda ws: [ws.path("o1")], forbidden=("Traceback",)),
    Case("writes", "log-jsonl-is-a-folder", lambda ws: train(ws, "o1", "--log-jsonl", str(_folder(ws.path("logs")))),
         2, ("is a folder",), absent=lambda ws: [ws.path("o1")], forbidden=("Traceback",)),
    Case("writes", "log-jsonl-is-the-output-folder", lambda ws: train(ws, "o1", "--log-jsonl", str(ws.path("o1"))), 2,
         ("is the output folder",), absent=lambda ws: [ws.path("o1")], forbidden=("Traceback",)),
    Case("writes", "log-jsonl-in-a-read-only-file", lambda ws: train(ws, "o1", "--log-jsonl", str(
         _read_only(ws.path("ro.jsonl")))), 2, ("not writable",), absent=lambda ws: [ws.path("o1")],
         forbidden=("Traceback",)),
    Case("writes", "generate-json-is-the-target-config", lambda ws: generate(ws.target, ws, "--json", str(
         ws.target / "config.json")), 2, ("--json file", "inside the target"), forbidden=("Traceback",)),
    # 2. the target's side: one sentence naming the file, before any weight is read
    Case("target", "rms_norm_eps-a-string", lambda ws: generate(ws.target_with("eps", config_edit(rms_norm_eps="x")),
         ws), 2, ("target-eps/config.json", "rms_norm_eps")),
    Case("target", "max_position_embeddings-a-string", lambda ws: generate(ws.target_with("mpe", config_edit(
         max_position_embeddings="2048")), ws), 2, ("target-mpe/config.json", "max_position_embeddings")),
    Case("target", "rope_parameters-a-list", lambda ws: generate(ws.target_with("rope", config_edit(
         rope_parameters=[1, 2])), ws), 2, ("target-rope/config.json", "rope_parameters")),
    Case("target", "layer_types-shorter-than-the-layers", lambda ws: generate(ws.target_with("layers", config_edit(
         layer_types=["full_attention"] * 3)), ws), 2, ("target-layers/config.json", "layer_types")),
    Case("target", "tokenizer.json-empty-object", lambda ws: generate(ws.target_with("tok", write_file(
         "tokenizer.json", "{}")), ws), 2, ("tokenizer", "tokenizer.json")),
    Case("target", "tokenizer_config.json-a-list", lambda ws: generate(ws.target_with("tokconf", write_file(
         "tokenizer_config.json", "[1, 2]")), ws), 2, ("tokenizer",)),
    Case("target", "weights-truncated", lambda ws: generate(ws.target_with("trunc", truncate_weights), ws), 2,
         ("model.safetensors", "truncated")),
    Case("target", "weights-not-safetensors", lambda ws: generate(ws.target_with("garbage", write_file(
         "model.safetensors", "not a safetensors file at all")), ws), 2, ("model.safetensors",)),
    Case("target", "header-lies-about-a-shape", lambda ws: generate(ws.target_with("shape",
         header_lies_about_a_shape), ws), 2, ("model.embed_tokens.weight", "shape")),
    Case("target", "eval-with-a-broken-config", lambda ws: ["eval", "--target", str(ws.target_with(
         "eps", config_edit(rms_norm_eps="x"))), "--draft", str(ws.draft), "--data", str(DEMO_DIR / "eval_code.jsonl"), "--limit", "1"], 2,
         ("target-eps/config.json", "rms_norm_eps")),
    Case("target", "train-with-a-broken-tokenizer", lambda ws: ["train", "--target", str(ws.target_with("tok",
         write_file("tokenizer.json", "{}"))), "--data", str(ws.data), "-o", str(ws.path("o2")), "--steps", "1"],
         2, ("tokenizer",), absent=lambda ws: [ws.path("o2")]),
    Case("target", "serve-with-a-broken-config", lambda ws: ["serve", "--target", str(ws.target_with(
         "eps", config_edit(rms_norm_eps="x"))), "--draft", str(ws.draft), "--dry-run"], 2,
         ("target-eps/config.json", "rms_norm_eps")),
    Case("target", "serve-with-truncated-weights", lambda ws: ["serve", "--target", str(ws.target_with(
         "trunc", truncate_weights)), "--draft", str(ws.draft), "--dry-run"], 2, ("model.safetensors",)),
    # 4. full disks and dying writes: one sentence, exit 2, temporary files removed, true messages
    Case("disk", "quantize-on-a-full-disk", lambda ws: ["quantize", str(ws.draft), "-o", str(ws.path("q-full"))], 2,
         ("No space left on device", "was not created"), absent=lambda ws: [ws.path("q-full")],
         patch=lambda ws, mp: mp.setattr("dspark_cli.runtime.quantize.write._write_json", enospc),
         after=no_temporary_files("q-full")),
    Case("disk", "train-on-a-full-disk", lambda ws: train(ws, "o3"), 2, ("No space left on device",
         "nothing was written"), absent=lambda ws: [ws.path("o3")], forbidden=("Traceback",),
         patch=lambda ws, mp: mp.setattr("dspark_cli.runtime.train.trainer.write_draft_files", enospc)),
    Case("disk", "quantize-json-on-a-full-disk", lambda ws: ["quantize", str(ws.draft), "-o", str(ws.path("q-json")),
         "--json", str(ws.path("q.json"))], 2, ("No space left on device", "Already written and kept",
         "q-json"), patch=full_disk_for(".q.json."), after=quantize_json_full),
    Case("disk", "eval-json-on-a-full-disk", lambda ws: ["eval", "--json", str(ws.path("run-full.json")), "--limit",
         "1", "--max-new-tokens", "4"], 2, ("No space left on device", "run-full.json", "was not created"),
         absent=lambda ws: [ws.path("run-full.json")], patch=full_disk_for(".run-full.json.")),
    Case("disk", "sigterm-during-eval-json", lambda ws: ["eval", "--json", str(ws.path("run-term.json")), "--limit",
         "3", "--max-new-tokens", "4"], 143, ("terminated", "finished prompts are saved in", "--resume"),
         patch=terminate_after(2), after=run_file_holds(2, "run-term.json")),
    # 5. resource bounds
    Case("bounds", "threads-100000", lambda ws: generate(ws.target, ws, "--threads", "100000"), 2,
         ("--threads", "CPU cores")),
    # 6. serve's hand-off
    Case("serve", "vllm-not-an-executable-format", lambda ws: ["serve", "--target", str(ws.target), "--draft",
         str(ws.draft)], 2, ("cannot start", "vllm"), patch=fake_vllm(b"\x00\x01garbage")),
    Case("serve", "vllm-with-a-missing-interpreter", lambda ws: ["serve", "--target", str(ws.target), "--draft",
         str(ws.draft)], 2, ("cannot start", "interpreter"), patch=fake_vllm(b"#!/nonexistent/python3\n")),
    Case("serve", "short-flag-sc", lambda ws: SERVE(ws, "-sc", "{}"), 2, ("-sc", "speculative config")),
    Case("serve", "dotted-speculative-config", lambda ws: SERVE(ws, "--speculative-config.method", "eagle"), 2,
         ("--speculative-config.method",)),
    Case("serve", "underscore-speculative-config", lambda ws: SERVE(ws, "--speculative_config={}"), 2,
         ("--speculative_config",)),
    # 7. a draft vLLM cannot build does not pass validate
    Case("vllm", "hidden_act-bogus", lambda ws: ["validate", str(ws.draft_with("act", hidden_act="bogus"))], 1,
         ("DSP035", "hidden_act")),
    Case("vllm", "rope-type-unknown", lambda ws: ["validate", str(ws.draft_with("rope", rope_parameters={
         "rope_type": "warp", "rope_theta": 1e6}))], 1, ("DSP035", "rope_type")),
    # 8. (issue 37, 1) every file a command writes, side files included, goes through the one output check
    Case("writes", "trtllm-yaml-is-the-from-plan-file", lambda ws: TRTLLM(ws, "--from-plan", str(in_folder(
         ws, "s1", {YAML: PLAN}) / YAML), "--json", str(ws.path("s1") / "p.json")), 2,
         ("trtllm's config file", "is the --from-plan file"), inputs=lambda ws: [ws.path("s1")],
         absent=lambda ws: [ws.path("s1") / "p.json"], forbidden=("Traceback",)),
    Case("writes", "trtllm-yaml-is-the-json-file", lambda ws: TRTLLM(ws, "--json", str(in_folder(ws, "s2") / YAML)),
         2, ("is the --json file",), absent=lambda ws: [ws.path("s2") / YAML], forbidden=("Traceback",)),
    Case("writes", "trtllm-yaml-exists", lambda ws: TRTLLM(ws, "--json", str(in_folder(ws, "s3", {YAML: "mine"})
         / "p.json")), 2, ("already exists", "--force"), inputs=lambda ws: [ws.path("s3") / YAML],
         absent=lambda ws: [ws.path("s3") / "p.json"], forbidden=("Traceback",)),
    Case("writes", "trtllm-yaml-replaced-with-force", lambda ws: TRTLLM(ws, "--force", "--json", str(in_folder(
         ws, "s4", {YAML: "mine"}) / "p.json")), 0, ("wrote",),
         after=lambda ws, message: replaced(ws.path("s4") / YAML)),
    Case("writes", "convert-json-is-the-target-config", lambda ws: ["convert", str(ws.draft), "--to", "gguf",
         "--target", str(ws.target), "-o", str(ws.path("d.gguf")), "--json", str(ws.target / "config.json")], 2,
         ("--json file", "inside the target"), absent=lambda ws: [ws.path("d.gguf")], forbidden=("Traceback",)),
    Case("writes", "bench-serve-kept-names-no-temporary-file", lambda ws: bench_serve(ws, "json", "--no-warmup"), 1,
         ("request(s) failed",), after=only_existing_files_named("json")),
    # 9. (issue 37, 2) a transport fault is one request's failure: recorded, the rest kept, the reason said
    Case("network", "regen-reply-cut-mid-body", lambda ws: regen_prompts(ws, "CUT"), 1,
         ("1 of 4 conversations failed", "broke off or is not HTTP (IncompleteRead"),
         after=regen_kept("CUT", "IncompleteRead")),
    Case("network", "regen-first-line-not-http", lambda ws: regen_prompts(ws, "NOTHTTP"), 1,
         ("1 of 4 conversations failed", "broke off or is not HTTP (BadStatusLine"),
         after=regen_kept("NOTHTTP", "BadStatusLine")),
    Case("network", "bench-serve-without-streaming", lambda ws: bench_serve(ws, "json"), 2,
         ("failed the warm-up completion", "answered without streaming")),
    Case("network", "bench-serve-another-event-schema", lambda ws: bench_serve(ws, "tgi", "--no-warmup"), 1,
         ("2 request(s) failed", "another event schema")),
    # 10. (issue 37, 6) words and exits that are true
    Case("words", "serve-help-names-the-four-engines", lambda ws: ["serve", "--help"], 0,
         ("vLLM (the default), SGLang, TensorRT-LLM or llama.cpp",), forbidden=("Traceback", "target in vLLM.")),
    Case("words", "ragged-run-file-round", lambda ws: ["plan", str(ragged_run(ws))], 2,
         ("run-ragged.json: results[0].rounds[", "drafted is 3, not the run's block size 7"),
         forbidden=("Traceback", "expected sequence")),
    Case("words", "resume-given-the-values-it-resolved-to", lambda ws: resume_with(ws, "--block-size", "7",
         "--device", "cpu"), 0, ()),
    Case("words", "resume-default-worded-as-the-default", lambda ws: resume_with(ws, "--block-size", "5"), 2,
         ("was run with the default --block-size (resolved to 7), not --block-size 5",),
         forbidden=("Traceback", "None")),
]


def _link(link: Path, to: Path) -> Path:
    if not link.is_symlink():
        link.symlink_to(to)
    return link


def _folder(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


def _read_only(path: Path) -> Path:
    path.write_text("")
    path.chmod(stat.S_IRUSR)
    return path


def skip_reason(case: Case) -> str | None:
    if case.name == "log-jsonl-in-a-read-only-file" and os.geteuid() == 0:
        return "root may write any file"
    if case.patch is not None and "full" in case.name and "json" in case.name and not os.path.exists("/dev/full"):
        return "needs /dev/full"
    return None


def run_case(case: Case, ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        _run_case(case, ws, monkeypatch)
    finally:
        monkeypatch.undo()
        ws.restore()


def _run_case(case: Case, ws: Workspace, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = case.argv(ws)
    before = fingerprint(*case.inputs(ws))
    if case.patch is not None:
        case.patch(ws, monkeypatch)
    result = runner.invoke(app, argv)
    monkeypatch.undo()
    message = " ".join((result.output + " " + (result.stderr if result.stderr_bytes is not None else "")).split())
    assert result.exit_code == case.exit_code, f"exit {result.exit_code}: {message[-600:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    for needle in case.needles:
        assert needle in message, f"{needle!r} not in: {message[-600:]}"
    for word in case.forbidden:
        assert word not in message, f"{word!r} in: {message[-600:]}"
    assert fingerprint(*case.inputs(ws)) == before, "an input's bytes changed"
    for path in case.absent(ws):
        assert not path.exists(), f"{path} was left behind"
    if case.after is not None:
        case.after(ws, message)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    ws = Workspace(tmp_path_factory.mktemp("sweep"))
    yield ws
    ws.close()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.klass}:{c.name}" for c in CASES])
def test_sweep(case, workspace, monkeypatch):
    reason = skip_reason(case)
    if reason:
        pytest.skip(reason)
    run_case(case, workspace, monkeypatch)


@pytest.mark.parametrize("name, change, needle", [
    ("eps", config_edit(rms_norm_eps="x"), "rms_norm_eps"),
    ("tok", write_file("tokenizer.json", "{}"), "tokenizer"),
    ("trunc", truncate_weights, "truncated"),
    ("shape", header_lies_about_a_shape, "model.embed_tokens.weight"),
])
def test_python_api_words_a_broken_target_in_one_sentence(workspace, name, change, needle):
    """Pair.load (check, tokenizer, weights) raises DsparkError naming the problem, not transformers' exceptions."""
    from dspark_cli.errors import DsparkError
    from dspark_cli.runtime.pair import Pair

    target = workspace.target_with(name, change)
    with pytest.raises(DsparkError, match=needle):
        checked = Pair.check(target, workspace.draft, device="cpu")
        checked.encode("hello")
        checked.load(progress=False)


# --- every --json report is exclusive: an existing file refused before any work unless --force -----------------------


def fresh(ws: Workspace, name: str) -> str:
    """A path of the workspace that does not exist (an output folder or file a run may create)."""
    path = ws.path(name)
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return str(path)


def bench_server(ws: Workspace) -> str:
    return ws.server("stream").url


def run_of_three(ws: Workspace) -> Path:
    """A run file of three prompts of the demo pair (calibrate holds some out)."""
    path = ws.path("run-three.json")
    if not path.exists():
        done = runner.invoke(app, ["eval", "--data", str(DEMO_DIR / "eval_code.jsonl"), "--limit", "3",
                                   "--max-new-tokens", "8", "--json", str(path)])
        assert done.exit_code == 0, done.output
    return path


# (command, argv given the --json path, exit code with --force; None: the run needs servers this sweep does not
# start, so only the refusal is checked and, with --force, that the refusal is gone)
JSON_COMMANDS = [
    ("validate", lambda ws, p: ["validate", str(ws.draft), "--json", p], 0),
    ("generate", lambda ws, p: generate(ws.target, ws, "--json", p), 0),
    ("eval", lambda ws, p: ["eval", "--limit", "1", "--max-new-tokens", "4", "--json", p], 0),
    ("quantize", lambda ws, p: ["quantize", str(ws.draft), "-o", fresh(ws, "xq"), "--json", p], 0),
    ("convert", lambda ws, p: ["convert", str(ws.draft), "--to", "gguf", "--target", str(ws.target), "-o",
                               fresh(ws, "x.gguf"), "--json", p], 0),
    ("plan", lambda ws, p: ["plan", str(ws.run_file()), "--json", p], 0),
    ("calibrate", lambda ws, p: ["calibrate", str(run_of_three(ws)), "-o", fresh(ws, "x.sts.json"), "--json", p],
     0),
    ("serve", lambda ws, p: ["serve", "--target", str(ws.target), "--draft", str(ws.draft), "--json", p], 0),
    ("bench markov", lambda ws, p: ["bench", "markov", "--vocab", "64", "--rank", "4", "--batch", "1", "--topk", "8",
                                    "--format", "bf16", "--temperature", "0", "--device", "cpu", "--reps", "1",
                                    "--warmup", "0", "--json", p], 0),
    ("bench verify", lambda ws, p: ["bench", "verify", "--tokens", "2", "--context", "4", "--device", "cpu",
                                    "--reps", "1", "--warmup", "0", "--json", p], 0),
    ("bench serve", lambda ws, p: ["bench", "serve", bench_server(ws), "--concurrency", "1", "--requests", "1",
                                   "--no-warmup", "--json", p], 0),
    ("bench audit", lambda ws, p: ["bench", "audit", "http://127.0.0.1:9", "--plain", "http://127.0.0.1:9",
                                   "--requests", "1", "--samples", "0", "--json", p], None),
    ("bench engine", lambda ws, p: ["bench", "engine", "http://127.0.0.1:9", "--spec", "2=http://127.0.0.1:9",
                                    "--draft-file", str(ws.data), "--json", p], None),
]


def test_json_commands_cover_every_json_option():
    """Every command with --json is in JSON_COMMANDS (a new one must be added there)."""
    from typer.main import get_command

    def walk(command, prefix=()):
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, (*prefix, name))
        if any("--json" in getattr(param, "opts", ()) for param in getattr(command, "params", ())):
            yield " ".join(prefix)

    assert sorted(walk(get_command(app))) == sorted(name for name, _, _ in JSON_COMMANDS)


@pytest.mark.parametrize("name, argv, forced", JSON_COMMANDS, ids=[name for name, _, _ in JSON_COMMANDS])
def test_an_existing_json_file_is_refused_unless_force(name, argv, forced, workspace):
    """An existing --json file: exit 2 before any work, one sentence naming it and --force, its bytes unchanged
    and nothing else written; with --force the run replaces it with the report."""
    path = workspace.path(f"mine-{name.replace(' ', '-')}.json")
    mine = b"my notes, not a report\n"
    path.write_bytes(mine)
    args = argv(workspace, str(path))  # first: the inputs it makes (a run file) are not the run's outputs
    before = sorted(p.name for p in workspace.root.iterdir())
    refused = runner.invoke(app, args)
    message = " ".join((refused.output + " " + (refused.stderr if refused.stderr_bytes is not None else "")).split())
    assert refused.exit_code == 2, f"exit {refused.exit_code}: {message[-600:]}"
    assert f"--json file {path} already exists; choose another file or pass --force to replace it." in message, \
        message[-600:]
    assert "Traceback" not in message
    assert path.read_bytes() == mine
    assert sorted(p.name for p in workspace.root.iterdir()) == before, "a refused run wrote something"
    done = runner.invoke(app, [*argv(workspace, str(path)), "--force"])
    message = " ".join((done.output + " " + (done.stderr if done.stderr_bytes is not None else "")).split())
    assert "already exists" not in message, message[-600:]
    if forced is None:
        assert path.read_bytes() == mine  # the servers were not there: refused later, the file untouched
        return
    assert done.exit_code == forced, f"exit {done.exit_code}: {message[-600:]}"
    assert isinstance(json.loads(path.read_text()), dict)
    assert not [p.name for p in workspace.root.iterdir() if p.name.endswith(".tmp")]


def test_json_to_stdout_needs_no_force(workspace):
    """`--json -` writes stdout: nothing on disk to refuse."""
    done = runner.invoke(app, ["validate", str(workspace.draft), "--json", "-"])
    assert done.exit_code == 0 and json.loads(done.stdout)["exit_code"] == 0


def test_sweep_covers_every_class():
    assert {c.klass for c in CASES} == {"writes", "target", "disk", "bounds", "serve", "vllm", "network", "words"}


def test_sigterm_before_a_command_starts_exits_143(monkeypatch, capsys):
    """SIGTERM while Typer still parses the options (before a command's handle_errors runs: `quantize` about a
    second after start) was a `Terminated` traceback and exit 1."""
    import signal

    import dspark_cli.cli as cli
    from dspark_cli.cli import render
    from dspark_cli.errors import Terminated

    def terminated(*args, **kwargs):
        raise Terminated()

    monkeypatch.setattr(render.Command, "parse_args", terminated)
    monkeypatch.setattr(sys, "argv", ["dspark", "quantize", "x", "-o", "y"])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as done:
            cli.main()
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert done.value.code == 143
    assert " ".join(capsys.readouterr().err.split()) == "terminated: nothing was written"


def main() -> int:
    passed = total = 0
    with tempfile.TemporaryDirectory(prefix="dspark-sweep-") as tmp:
        ws = Workspace(Path(tmp))
        for case in CASES:
            reason = skip_reason(case)
            if reason:
                print(f"SKIP {case.klass}:{case.name} ({reason})")
                continue
            total += 1
            with pytest.MonkeyPatch.context() as monkeypatch:
                try:
                    run_case(case, ws, monkeypatch)
                except Exception as error:  # an old build may fail a case in any way; report it and go on
                    first = (str(error).splitlines() or [""])[0]
                    print(f"FAIL {case.klass}:{case.name}: {type(error).__name__}: {first[:300]}")
                    continue
            passed += 1
            print(f"ok   {case.klass}:{case.name}")
        ws.close()
    print(f"{passed}/{total} OK")
    return 0 if passed == total else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
