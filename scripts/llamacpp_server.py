"""Start the real llama.cpp `llama-server` (release b11434, scripts/build_llamacpp.sh) on a demo pair, for tests
and scripts (scripts/llamacpp_check.py, tests/fixtures/llama_server.py).

    from llamacpp_server import LARGE_DIR, available, demo_gguf, large_gguf, llama_server
    target, draft = demo_gguf(work_dir)                       # converted once; reused when already there
    target, draft = large_gguf(LARGE_DIR)                     # the demo-large pair (docs/demo-large.md), built once
    with llama_server(target, draft, slots=2) as url:         # http://127.0.0.1:PORT, /health answered
        ...                                                   # POST url + "/completion", "/v1/completions"
    with llama_server(target) as url:                         # the target alone: the baseline

The draft runs under dspark's own flags for llama.cpp (`--spec-type draft-dspark --spec-draft-n-max N`, the argv
of runtime/engines/llamacpp.py for the demo pair). Each server gets `-t 1` (one thread) unless told otherwise,
`-np SLOTS` parallel slots and `-c` = SLOTS x the context of one slot; it is stopped (SIGTERM, then SIGKILL) when the
block ends. The build is looked for under DSPARK_LLAMACPP_CACHE (default ~/.cache/dspark/llama.cpp-b11434).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
CACHE = Path(os.environ.get("DSPARK_LLAMACPP_CACHE", Path.home() / ".cache/dspark/llama.cpp-b11434"))
SERVER = CACHE / "build" / "bin" / "llama-server"
LARGE_DIR = Path.home() / ".cache" / "dspark" / "demo-large"  # scripts/build_demo.py --pair demo-large's default


def available() -> bool:
    """Whether the llama.cpp build (its llama-server) is there."""
    return SERVER.is_file()


def demo_gguf(work_dir: Path) -> tuple[Path, Path]:
    """The demo pair as GGUF files in work_dir: (target.gguf, draft.gguf), both written by `dspark convert --to
    gguf`'s library half (runtime/convert/target_gguf.py and gguf.py). Files already there are reused; new ones
    are written beside and renamed into place."""
    from dspark_cli.runtime.demo import DEMO_DIR

    return pair_gguf(DEMO_DIR / "target", DEMO_DIR / "draft", Path(work_dir))


def large_gguf(pair_dir: Path, recipe=None) -> tuple[Path, Path]:
    """The demo-large pair (runtime/train/demo_large.py: the demo target grown by `recipe`, default its
    DEFAULT_RECIPE; the demo draft) as GGUF files: (PAIR_DIR/gguf/target.gguf, PAIR_DIR/gguf/draft.gguf). The pair is
    built in pair_dir when absent; one already there must have the recipe's depth and MLP width. GGUFs are reused as
    in demo_gguf."""
    import json

    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.train.demo_large import DEFAULT_RECIPE, build_large_pair

    pair_dir, recipe = Path(pair_dir), recipe or DEFAULT_RECIPE
    config = pair_dir / "target" / "config.json"
    if not config.is_file():
        build_large_pair(pair_dir, recipe)
    grown = json.loads(config.read_text())
    base = json.loads((DEMO_DIR / "target" / "config.json").read_text())
    shape = (base["num_hidden_layers"] + recipe.extra_layers, recipe.mlp_width or base["intermediate_size"])
    if (grown["num_hidden_layers"], grown["intermediate_size"]) != shape:
        raise RuntimeError(f"{pair_dir} holds a demo-large target of {grown['num_hidden_layers']} layers and MLP width "
                           f"{grown['intermediate_size']}, not {shape[0]} and {shape[1]}; remove it or build it again "
                           "(python scripts/build_demo.py --pair demo-large)")
    return pair_gguf(pair_dir / "target", pair_dir / "draft", pair_dir / "gguf")


def pair_gguf(target_folder: Path, draft_folder: Path, work_dir: Path) -> tuple[Path, Path]:
    """A target folder and its draft as work_dir/target.gguf and work_dir/draft.gguf (reused when there)."""
    from dspark_cli.runtime.convert.gguf import convert_to_gguf
    from dspark_cli.runtime.convert.target_gguf import convert_target_to_gguf

    work_dir.mkdir(parents=True, exist_ok=True)
    target, draft = work_dir / "target.gguf", work_dir / "draft.gguf"
    if not target.is_file():
        partial = work_dir / f"target.{os.getpid()}.partial.gguf"
        convert_target_to_gguf(str(target_folder), partial, force=True)
        partial.replace(target)
    if not draft.is_file():
        partial = work_dir / f"draft.{os.getpid()}.partial.gguf"
        convert_to_gguf(str(draft_folder), partial, target=str(target_folder), force=True)
        partial.replace(draft)
    return target, draft


def dspark_spec_args(draft_folder: str | None = None, target_folder: str | None = None) -> list[str]:
    """dspark's llama.cpp flags for a draft folder (the demo's by default): the plan's argv after -m / -md."""
    from dspark_cli.runtime.demo import DEMO_DIR
    from dspark_cli.runtime.engines import engine
    from dspark_cli.runtime.engines.seam import ServeRequest

    request = ServeRequest(target=target_folder or str(DEMO_DIR / "target"),
                           draft=draft_folder or str(DEMO_DIR / "draft"))
    argv = engine("llamacpp").plan(request).argv
    return argv[argv.index("-md") + 2:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def llama_server(target_gguf: Path, draft_gguf: Path | None = None, slots: int = 1, extra: Sequence[str] = (), *,
                 threads: int = 1, slot_context: int = 2048, log: Path | None = None,
                 startup_timeout: float = 120, server: Path | None = None,
                 spec: Sequence[str] | None = None) -> Iterator[str]:
    """Start llama-server on a free port of 127.0.0.1 with `slots` parallel slots (the draft under `spec`, its
    speculative flags, when given: dspark's for the demo draft by default), wait until /health answers 200, yield its
    URL, stop it. `log` keeps the server's output (a temporary file otherwise); `server` is another llama-server
    binary; a server that exits or never gets healthy raises RuntimeError with its log's tail."""
    from dspark_cli.runtime.bench.quant_guard import stop_server

    argv = [str(server or SERVER), "-m", str(target_gguf)]
    if draft_gguf is not None:
        argv += ["-md", str(draft_gguf)] + list(dspark_spec_args() if spec is None else spec)
    argv += ["--host", "127.0.0.1", "-t", str(threads), "-np", str(slots), "-c", str(slots * slot_context),
             *extra]
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(log) if log is not None else Path(tmp) / "llama-server.log"
        for _ in range(3):  # a port taken between free_port and the bind: try another
            port = free_port()
            with open(log_path, "w") as handle:
                process = subprocess.Popen(argv + ["--port", str(port)], stdout=handle, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            try:
                if _wait_healthy(url, process, log_path, startup_timeout):
                    yield url
                    return
            finally:
                stop_server(process)
        raise RuntimeError(f"llama-server could not bind a port:\n{log_path.read_text()[-3000:]}")


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> bool:
    """True once /health answers 200; False when the server exited because its port was taken."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            text = log.read_text()
            if "couldn't bind" in text or "Address already in use" in text:
                return False
            raise RuntimeError(f"llama-server exited {process.returncode}:\n{text[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.25)
    raise RuntimeError(f"llama-server did not become healthy in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
