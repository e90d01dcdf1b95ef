"""Choose Triton's interpreter before Triton is imported, whoever imports it first.

Without CUDA, Triton kernels can only run in its interpreter, and `TRITON_INTERPRET` is read when a
`@triton.jit` decorator runs, including the ones inside `triton.language` that run when triton is
first imported. dspark's own kernels are not the first importer: torch imports triton from
`torch._dynamo`, which some plain torch calls load on first use (building a module on the meta device
does). So the choice cannot wait for `dspark_cli.kernels`: `install()` (run when `dspark_cli` is
imported, torch-free) puts a finder in front of the import system that makes the choice the moment
`triton` is first looked up, then steps aside. An explicit `TRITON_INTERPRET` always wins.
"""

from __future__ import annotations

import os
import sys


def choose() -> None:
    """Set TRITON_INTERPRET=1 when torch sees no CUDA device (unless the variable is already set)."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


class _ChooseBeforeTriton:
    """A meta-path finder that finds nothing: on the first lookup of `triton` it makes the choice."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "triton":
            uninstall()
            try:
                choose()
            except Exception:  # a finder must never break an import (e.g. torch half-imported): no choice made
                pass
        return None


def install() -> None:
    if "triton" in sys.modules:  # too late to choose; dspark_cli.kernels reports nothing either way
        return
    if not any(isinstance(finder, _ChooseBeforeTriton) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ChooseBeforeTriton())


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _ChooseBeforeTriton)]
