"""Options every command declares the same way, so that a flag means one thing across `dspark`.

`--json PATH` writes the command's JSON document to PATH, atomically; `--json -` writes it to stdout, which then
carries nothing else (the human report is left out, or goes to stderr). `--seed` takes 0 to 2^64 - 1 (what
torch.Generator.manual_seed accepts). `--device` takes auto, cpu, cuda or cuda:N; `--dtype` auto, float32,
bfloat16 or float16. Each factory takes the sentence that says what the option does in that command.

The pair and decode settings (`--target/-t`, `--draft/-d`, `--pair`, `--block-size`, `--draft-topk`, `--markov`,
`--temperature`, `--top-p`, `--top-k`, `--confidence-threshold`, `--confidence-rule`, `--calibration`) are declared
here too, so that generate and eval offer the same flags; their `what` defaults to the decode commands' sentence.
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
         "draft": "--draft", "dist_timeout": "--dist-timeout", "engine": "--engine", "pair": "--pair",
         "url": "--url", "api": "--api", "timeout": "--timeout", "min_p": "--min-p", "max_tokens": "--max-tokens",
         "concurrency": "--concurrency"}
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


def target(what: str = "Target causal LM: folder or hub id."):
    """`--target/-t`: a required one takes `= ...` as its default."""
    return Annotated[Optional[str], typer.Option("--target", "-t", metavar="TARGET", help=what)]


def draft(what: str = "DSpark draft checkpoint: folder or hub id."):
    return Annotated[Optional[str], typer.Option("--draft", "-d", metavar="DRAFT", help=what)]


def pair(what: str = "A demo pair shipped in the package, by its short name: demo (Qwen3 target; the default "
         "without --target and --draft) or demo-hybrid (Qwen3.5-style Gated DeltaNet / attention target)."):
    return Annotated[Optional[str], typer.Option("--pair", metavar="NAME", help=what)]


def pair_paths(name: Optional[str], target: Optional[str], draft: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """`--pair NAME` -> the shipped pair's (target, draft) folders; without it, --target and --draft as given."""
    if name is None:
        return target, draft
    if target is not None or draft is not None:
        raise DsparkError("pass --pair, or --target and --draft, not both.")
    from dspark_cli.runtime.demo import demo_pair

    pair_target, pair_draft = demo_pair(name)
    return str(pair_target), str(pair_draft)


def block_size(what: str = "Draft tokens per round (default: the trained block size, which is also the maximum).",
               min: Optional[int] = None):
    return Annotated[Optional[int], typer.Option("--block-size", min=min, help=what)]


def draft_topk(what: str = "Markov candidates per position, taken from the base logits (default: the config's "
               "dspark_draft_topk, else the dense Markov stage)."):
    return Annotated[Optional[int], typer.Option("--draft-topk", help=what)]


def markov(what: str = "Markov stage: auto, dense, topk, nvfp4 or fused (same tokens, different cost)."):
    return Annotated[str, typer.Option("--markov", help=what)]


def temperature(what: str = "0 = greedy."):
    return Annotated[float, typer.Option("--temperature", min=0.0, help=what)]


def top_p(what: str = "Nucleus sampling mass (1 = off); applied to target and draft."):
    return Annotated[float, typer.Option("--top-p", help=what)]


def top_k(what: str = "Top-k sampling (0 = off); applied to target and draft."):
    return Annotated[int, typer.Option("--top-k", min=0, help=what)]


def confidence_threshold(what: str = "Verify only a prefix chosen by the confidence head (--confidence-rule; needs "
                         "a confidence head; never changes the output distribution)."):
    return Annotated[Optional[float], typer.Option("--confidence-threshold", help=what)]


def confidence_rule(what: str = "survival: keep positions while prod(c_i) >= X (vLLM); per-slot: cut at the first "
                    "c_j < X (DeepSpec)."):
    return Annotated[str, typer.Option("--confidence-rule", help=what)]


def calibration(what: str = "STS temperatures of `dspark calibrate`: c_i = sigmoid(logit_i / T_i) for the threshold "
                "rule and the calibration scores; the output is unchanged."):
    return Annotated[Optional[Path], typer.Option("--calibration", metavar="STS.json", help=what)]


ENGINE_NAMES = ("vllm", "sglang", "trtllm", "llamacpp")


def engine(what: str = "Serving engine: vllm, sglang, trtllm or llamacpp (docs/engines.md).", choices=ENGINE_NAMES):
    """`--engine NAME` (default vllm): the serving engine a command checks against or hands the pair to; the
    runtime's `engines.engine(name)` refuses another name in one sentence."""
    return Annotated[str, typer.Option("--engine", metavar="|".join(choices), help=what)]


Revision = Annotated[Optional[str], typer.Option(
    "--revision", metavar="REV", help="Hub revision (branch, tag or commit) of CHECKPOINT.")]


def layer_ids(text: Optional[str], flag: str, example: str = "1,9,17") -> Optional[tuple[int, ...]]:
    """A comma-separated list of layer ids given with `flag` (None when the option was not given)."""
    if text is None:
        return None
    try:
        ids = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        ids = ()
    if not ids:
        raise DsparkError(f"{flag} {text!r}: give comma-separated layer ids, e.g. {example}.")
    return ids


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
