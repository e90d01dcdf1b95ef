"""How many CPU threads torch uses for generation: one for small models, whose matmuls do not scale.

Measured on a 2-core CPU shared with other jobs (load average 7-9; benchmarks/bench_generate.py and
bench_threads.py, 1 and 2 threads interleaved call by call), best of 15-30 runs in ms:
  - the earlier demo pair (1.5 M-parameter target, 1.6 M draft): decode step 1.76 vs 2.09, verify of 8 tokens
    2.43 vs 3.57, draft block 2.22 vs 2.94 (1 vs 2 threads); its matmuls ([8, 192] x [192, 576]) are far too
    small to split, and a forward is mostly Python and framework overhead, so a second thread only adds
    synchronization;
  - random Qwen3 targets of 22 M to 168 M parameters: a verify of 8 tokens was 1.4-1.7x slower with 2 threads
    and a decode step no faster, because a thread waiting for a core the other jobs hold stalls every matmul.
Hence 1 thread below SMALL_MODEL_PARAMETERS, and above it the cores that the load average says are idle (all of
them on an idle machine, where larger matmuls do split well).
"""

from __future__ import annotations

import os

import torch

SMALL_MODEL_PARAMETERS = 100_000_000  # target + draft below this: 1 thread


def default_threads(num_params: int, cores: int | None, load: float = 0.0) -> int:
    """1 thread for models below SMALL_MODEL_PARAMETERS (target and draft together); else the cores other processes
    leave idle (`cores` minus the `load` average, rounded, at least 1): a thread that must wait for a busy core
    stalls every matmul it shares."""
    if num_params < SMALL_MODEL_PARAMETERS or not cores:
        return 1
    return max(1, min(cores, round(cores - load)))


def check_threads(requested: int | None) -> None:
    """ValueError for a thread count below 1 or above the cores this process may use: more threads than cores only
    wait for each other, and an unbounded count exhausts the host's process ids (torch then crashes)."""
    if requested is None:
        return
    cores = _usable_cores() or 1
    if not 1 <= requested <= cores:
        raise ValueError(f"the thread count must be between 1 and the {cores} CPU cores this process may use, got "
                         f"{requested}")


def set_threads(requested: int | None, *models: torch.nn.Module) -> int:
    """Set torch's intra-op threads to `requested` (check_threads), or to `default_threads` for the models'
    parameter count (shared tensors counted once), the cores this process may use and the 1-minute load average;
    returns the count set."""
    check_threads(requested)
    threads = requested or default_threads(parameter_count(*models), _usable_cores(), _load())
    torch.set_num_threads(threads)
    return threads


def parameter_count(*models: torch.nn.Module) -> int:
    """Parameters of all `models`, a tensor shared between them (a draft's tied embedding) counted once."""
    unique = {id(p): p for model in models for p in model.parameters()}
    return sum(p.numel() for p in unique.values())


def _usable_cores() -> int | None:
    """Cores this process may run on (its CPU affinity where the OS has one, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _load() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
