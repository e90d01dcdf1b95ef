"""Triton kernels, each with a pure-torch reference twin.

Without CUDA, Triton kernels can only run in its interpreter, and the interpreter must be chosen
before any `@triton.jit` decorator runs. This package is imported before its kernel modules, so it
makes that choice here. Triton itself is optional: the torch references work without it.
"""

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
