"""How many CPU threads torch uses for generation: one for small models, whose matmuls do not scale.

Measured on the shipped demo pair (1.5 M-parameter target, 1.6 M-parameter draft) on a 2-core CPU, one decode step,
a verify of 8 tokens and a draft block each cost more with 2 threads than with 1: at this size a forward is
~60 % Python and framework overhead and its matmuls ([8, 192] x [192, 576]) are far too small to split, so a second
thread only adds synchronization (docs/generate.md has the figures). Threads pay off once a layer's matmuls take
milliseconds, i.e. from hidden sizes of about 1024 (Qwen3-0.6B and up).
"""

from __future__ import annotations

import os

import torch

SMALL_MODEL_PARAMETERS = 100_000_000  # target + draft below this: 1 thread


def default_threads(num_params: int, cores: int | None) -> int:
    """1 thread for models below SMALL_MODEL_PARAMETERS (target and draft together), else every core."""
    if num_params < SMALL_MODEL_PARAMETERS or not cores:
        return 1
    return cores


def set_threads(requested: int | None, *models: torch.nn.Module) -> int:
    """Set torch's intra-op threads to `requested`, or to `default_threads` for the models' parameter count (shared
    tensors counted once) and the cores this process may use; returns the count set."""
    threads = requested or default_threads(parameter_count(*models), _usable_cores())
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
