"""Device and dtype names -> torch objects, one meaning for every command ("auto" picks CUDA when present), and the
memory a device has free."""

from __future__ import annotations

import os

import torch

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.units import format_bytes

DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
               "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N that exists here; ValueError for anything else."""
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = text.partition(":")
    if not (text == "cpu" or (kind == "cuda" and (not index or index.isdigit()))):
        raise ValueError(f"{name!r} is not a device; use auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: CUDA is not available here; use cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"{name}: this machine has {torch.cuda.device_count()} CUDA device(s); use cuda:0 .. "
                         f"cuda:{torch.cuda.device_count() - 1}")
    return torch.device(text)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto (bfloat16 on CUDA, float32 elsewhere) or one of DTYPE_NAMES; ValueError for anything else."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPE_NAMES:
        raise ValueError(f"must be auto, float32, bfloat16 or float16, got {name!r}")
    return DTYPE_NAMES[name]


def available_memory(device: torch.device | str) -> int | None:
    """Bytes free for new tensors on `device`: CUDA's free memory on a CUDA device, else the host's MemAvailable
    (None: unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits(parts: dict[str, int], free: int | None, device, what: str, advice: str) -> None:
    """Refuse, before anything is allocated, work whose tensors cannot fit in `free` bytes (available_memory of
    `device`; None: unknown, not refused): one sentence naming the estimate, each part, the free memory and `advice`
    (what to make smaller). parts: what -> bytes, e.g. {"KV cache for 8 x 520 positions": 4_259_840}."""
    total = sum(parts.values())
    if free is None or total <= free:
        return
    detail = ", ".join(f"{format_bytes(size)} of {name}" for name, size in parts.items())
    raise DsparkError(f"{what} needs about {format_bytes(total)} of memory ({detail}) but {device} has "
                      f"{format_bytes(free)} free; {advice}.")
