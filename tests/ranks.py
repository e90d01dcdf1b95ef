"""Real dspark processes for the many-process tests: under torchrun, or one per rank started by hand (RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT set per process, each in its own working folder, as on separate nodes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def run(args: list[str], processes: int, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` as one process, or under torchrun with `processes` ranks."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    command = [sys.executable, *(launcher if processes > 1 else []), *args]
    return subprocess.run(command, env=env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(folders: list[Path], args: list[str]) -> list[subprocess.Popen]:
    """One `python ARGS` per rank, each in its own working folder, joined over TCP on a free port."""
    port = str(_free_port())
    return [subprocess.Popen([sys.executable, *args], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env(RANK=str(rank), WORLD_SIZE=str(len(folders)), LOCAL_RANK="0",
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
            for rank, folder in enumerate(folders)]


def finish(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """(exit code, stderr) of every rank; all are killed and the test fails if one hangs."""
    results = []
    for process in processes:
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise AssertionError("a rank hung instead of stopping") from None
        results.append((process.returncode, stderr))
    return results
