"""`dspark quantize`'s self-check: re-open the folder it wrote, before the rename, and refuse to publish a bad one.

The written checkpoint must hold every input file and every input tensor with its dtype and shape, except
markov_w2, which becomes the three NVFP4 tensors (uint8 [Vd, r/2] codes, float8_e4m3fn [Vd, r/16] block scales,
float32 [] global scale); every shard its index names must exist (open_checkpoint checks that); and validate's rules
must report no error (other than those only a serving engine refuses, engines.ENGINE_ONLY_CODES, e.g. DSP012 for a
gated or RNN head that vLLM cannot load and dspark runs). A failure raises DsparkError; the caller's
atomic_output_dir then removes the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.checkpoint.read import Checkpoint, TensorInfo, open_checkpoint
from dspark_cli.runtime.checkpoint.layout import MARKOV_W2, NVFP4_GROUP


def verify_quantized_output(ckpt: Checkpoint, folder: Path) -> None:
    """Check the quantized checkpoint in `folder` against its input `ckpt`; raise DsparkError on the first problem."""
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
    from dspark_cli.runtime.engines import ENGINE_ONLY_CODES

    try:
        written = open_checkpoint(folder)
    except DsparkError as error:
        _fail(f"it cannot be read back ({error.message.rstrip('.')})")
    problem = _tensor_problem(ckpt.tensors, written.tensors)
    if problem:
        _fail(problem)
    missing_files = [name for name in ckpt.files if name not in written.files]
    if missing_files:
        _fail(f"{len(missing_files)} input file(s) are missing from it, first {missing_files[0]!r}")
    errors = [error for error in validate_checkpoint(written).errors if error.code not in ENGINE_ONLY_CODES]
    if errors:
        first = errors[0]
        if first.code in {finding.code for finding in validate_checkpoint(ckpt).errors}:
            raise DsparkError(
                f"{ckpt.source} itself fails dspark validate ({first.code}: {first.message.rstrip('.')}), so the "
                "quantized copy would too; fix the input first, nothing was written."
            )
        _fail(f"dspark validate reports {first.code}: {first.message.rstrip('.')}")


def _tensor_problem(before: dict[str, TensorInfo], after: dict[str, TensorInfo]) -> str | None:
    """The first input tensor that is missing or changed in `after`, or a wrong NVFP4 markov_w2; None if all agree."""
    for name, info in before.items():
        if name == MARKOV_W2:
            continue
        got = after.get(name)
        if got is None:
            return f"tensor {name!r} is missing from it"
        if (got.dtype, got.shape) != (info.dtype, info.shape):
            return (f"tensor {name!r} changed from {info.dtype}{list(info.shape)} to "
                    f"{got.dtype}{list(got.shape)}")
    vd, rank = before[MARKOV_W2].shape
    module = MARKOV_W2.rsplit(".", 1)[0]
    expected = {
        MARKOV_W2: ("U8", (vd, rank // 2)),
        f"{module}.weight_scale": ("F8_E4M3", (vd, rank // NVFP4_GROUP)),
        f"{module}.weight_scale_2": ("F32", ()),
    }
    for name, (dtype, shape) in expected.items():
        got = after.get(name)
        if got is None or (got.dtype, got.shape) != (dtype, shape):
            found = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            return f"NVFP4 tensor {name!r} is {found}, expected {dtype}{list(shape)}"
    return None


def _fail(problem: str) -> NoReturn:
    raise DsparkError(
        f"the quantized checkpoint failed dspark's self-check before it was published: {problem}; nothing was "
        "written (this is a dspark bug, please report it)."
    )
