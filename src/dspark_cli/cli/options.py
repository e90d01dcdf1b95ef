"""Options every command declares the same way, so that a flag means one thing across `dspark`.

`--json PATH` writes the command's JSON document to PATH, atomically; `--json -` writes it to stdout, which then
carries nothing else (the human report is left out, or goes to stderr). `--seed` takes 0 to 2^64 - 1 (what
torch.Generator.manual_seed accepts). `--device` takes auto, cpu, cuda or cuda:N; `--dtype` auto, float32,
bfloat16 or float16. Each factory takes the sentence that says what the option does in that command.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from dspark_cli.errors import DsparkError, SettingError

if TYPE_CHECKING:
    import torch

# The flag of each setting the runtime names (errors.SettingError): the CLI words its errors with the flag.
FLAGS = {"block_size": "--block-size", "draft_topk": "--draft-topk", "markov": "--markov",
         "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
         "confidence_threshold": "--confidence-threshold", "confidence_rule": "--confidence-rule",
         "calibration": "--calibration", "device": "--device", "dtype": "--dtype", "target": "--target",
         "draft": "--draft"}
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
STDOUT = "-"


def json_path(document: str):
    """`--json PATH`: `document` names what is written, e.g. 'the report'."""
    return Annotated[Optional[Path], typer.Option(
        "--json", metavar="PATH", help=f"Write {document} as JSON to PATH ('-': stdout, and nothing else there).")]


def seed(what: str):
    return Annotated[int, typer.Option("--seed", min=0, max=SEED_MAX, help=f"{what} (0 to 2^64 - 1).")]


def device(what: str = "auto (cuda if available, else cpu), cpu, cuda or cuda:N."):
    return Annotated[str, typer.Option("--device", metavar="DEVICE", help=what)]


def dtype(what: str = "auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."):
    return Annotated[str, typer.Option("--dtype", metavar="DTYPE", help=what)]


def force(what: str):
    return Annotated[bool, typer.Option("--force", help=what)]


Revision = Annotated[Optional[str], typer.Option(
    "--revision", metavar="REV", help="Hub revision (branch, tag or commit) of CHECKPOINT.")]


def to_stdout(path: Path | str | None) -> bool:
    """True when `--json -` claims stdout for the JSON document."""
    return path is not None and str(path) == STDOUT


def torch_device(name: str) -> "torch.device":
    """`--device NAME` -> torch.device, or one sentence naming the flag."""
    from dspark_cli.runtime.devices import resolve_device

    try:
        return resolve_device(name)
    except ValueError as error:
        raise DsparkError(f"--device {error}.") from None


def torch_dtype(name: str, device: "torch.device") -> "torch.dtype":
    """`--dtype NAME` on `device` -> torch.dtype, or one sentence naming the flag."""
    from dspark_cli.runtime.devices import resolve_dtype

    try:
        return resolve_dtype(name, device)
    except ValueError as error:
        raise DsparkError(f"--dtype {error}.") from None


def worded(error: DsparkError) -> str:
    """The sentence the user reads: a SettingError names the flag where the runtime named the setting."""
    if isinstance(error, SettingError) and error.setting in FLAGS:
        return f"{FLAGS[error.setting]} {error.problem}"
    return error.message
