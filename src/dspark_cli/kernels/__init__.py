"""Triton kernels, each with a pure-torch reference twin.

Without CUDA, Triton kernels can only run in its interpreter, and the interpreter must be chosen
before triton is first imported (dspark_cli/triton_mode.py makes that choice when `dspark_cli` is
imported; it is made here too when triton is not imported yet, for a process that removed the finder).
Triton itself is optional: the torch references work without it.
"""

import functools
import sys

import torch

from dspark_cli import triton_mode

if "triton" not in sys.modules:
    triton_mode.choose()


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
