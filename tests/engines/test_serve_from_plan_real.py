"""`dspark serve --engine llamacpp --from-plan PLAN` against the real llama-server b11434: a verdict plan's n becomes
the running server's draft length (its start-up log and the drafts of a completion), and a plan of n = 0 starts the
target alone. Skipped without the build (scripts/build_llamacpp.sh)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from llama_server import SERVER, demo_ggufs, needs_llamacpp  # noqa: F401 (demo_ggufs is a fixture)

pytestmark = needs_llamacpp
ROOT = Path(__file__).resolve().parents[2]


def verdict_plan(path: Path, n: int, reason: str) -> Path:
    """A plan file as `dspark plan --costs PROFILE -o` writes it, for one concurrency and context."""
    fields = {"num_speculative_tokens": n}
    path.write_text(json.dumps({"format": "dspark-plan-verdict/1", "engine": "llamacpp", "speculative_config": fields,
                                "verdicts": [{"concurrency": 1, "context": 32, "n": n, "reason": reason}]}))
    return path


def pair_beside_ggufs(tmp_path: Path, target_gguf: Path, draft_gguf: Path) -> tuple[Path, Path]:
    """The demo folders with their GGUFs beside them (FOLDER.gguf, what the llamacpp engine hands over)."""
    from dspark_cli.runtime.demo import DEMO_DIR

    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(DEMO_DIR / "target", target)
    shutil.copytree(DEMO_DIR / "draft", draft)
    shutil.copy(target_gguf, tmp_path / "target.gguf")
    shutil.copy(draft_gguf, tmp_path / "draft.gguf")
    return target, draft


def serve_plan(tmp_path: Path, demo_ggufs, n: int, reason: str) -> tuple[str, dict]:
    """`dspark serve --engine llamacpp --from-plan` of a plan of n on the demo pair: its log and a completion's
    timings."""
    target, draft = pair_beside_ggufs(tmp_path, *demo_ggufs)
    plan = verdict_plan(tmp_path / "plan.json", n, reason)
    port, log = free_port(), tmp_path / "serve.log"
    process = serve_until_healthy(["--engine", "llamacpp", "--from-plan", str(plan), "-t", str(target), "-d",
                                   str(draft), "--port", str(port), "--", "-t", "1"], port, log)
    try:
        timings = complete(port)
    finally:
        stop(process)
    return log.read_text(), timings


def serve_until_healthy(args: list[str], port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{SERVER.parent}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}
    with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, "-m", "dspark_cli", "serve", *args], stdout=handle,
                                   stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.25)
    process.kill()
    raise AssertionError(log.read_text()[-3000:])


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def complete(port: int) -> dict:
    body = json.dumps({"prompt": "def main():\n    ", "n_predict": 24, "temperature": 0, "ignore_eos": True})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body.encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["timings"]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_from_verdict_plan_starts_llama_server_with_its_draft_length(tmp_path, demo_ggufs):
    text, timings = serve_plan(tmp_path, demo_ggufs, 3, "the demo pair's verdict, written for this test")
    assert "--spec-draft-n-max 3" in text  # the command dspark printed
    assert re.search(r"n_max=3\b", text), text[-3000:]  # what llama.cpp's dflash drafter started with
    assert timings["draft_n"] > 0  # it drafts: at most 3 tokens a round, so more rounds than 24 / 8
    steps = timings["predicted_n"] - 1 - timings["draft_n_accepted"]
    assert timings["draft_n"] <= 3 * steps


def test_serve_from_a_plan_of_n_0_starts_the_target_alone(tmp_path, demo_ggufs):
    text, timings = serve_plan(tmp_path, demo_ggufs, 0, "every draft length is predicted slower than plain decoding")
    assert "every draft length is predicted slower than plain decoding" in text
    assert "-md" not in text.split("llama-server", 1)[1].splitlines()[0]  # the printed command has no draft
    assert "draft_n" not in timings and timings["predicted_n"] == 24
