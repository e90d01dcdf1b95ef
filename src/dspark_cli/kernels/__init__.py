"""Triton kernels, each with a pure-torch reference twin.

Without CUDA, Triton kernels can only run in its interpreter, and the interpreter must be chosen
before triton is first imported (dspark_cli/triton_mode.py makes that choice when `dspark_cli` is
imported; the finder is put back here when triton is not imported yet, for a process that removed it).
Triton itself is optional: the torch references work without it. This module imports no torch, so the
checkpoint schema can read the NVFP4 block size from here without paying for it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from dspark_cli import triton_mode

if TYPE_CHECKING:
    import torch

NVFP4_GROUP_SIZE = 16  # NVFP4 block: one FP8 E4M3 scale per 16 consecutive input features

triton_mode.install()  # torch-free: the choice is made when triton is first looked up


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(tensor: torch.Tensor) -> bool:
    """True when `tensor` lives on CUDA and Triton imports, i.e. a compiled kernel can run on it."""
    return tensor.is_cuda and _triton_imports()
