"""Hand a checked target + draft pair to vLLM: the speculative config and the `vllm serve` argv.

    plan = plan_serve(ServeRequest(target="Qwen/Qwen3-8B", draft="./my-draft"))
    plan.speculative_config   # {"method": "dspark", "model": "/abs/my-draft", "num_speculative_tokens": 7, ...}
    plan.argv                 # ["vllm", "serve", "Qwen/Qwen3-8B", "--speculative-config", "{...}"]
    exec_vllm(plan.argv)      # replaces this process (signals and the exit code belong to vLLM)

Nothing here loads weights: the pair goes through validate's header-only rules first, and a draft with errors is
refused (DraftRefused, exit code 1 like validate). Every key written is a field of vLLM's SpeculativeConfig; where
each one comes from in vLLM's source is listed in docs/serve.md.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from dspark_cli.errors import EXIT_FINDINGS, DsparkError
from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.rules import Report, validate_checkpoint
from dspark_cli.runtime.checkpoint.target_files import check_target_files

VLLM = "vllm"
DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")  # SpeculativeConfig.draft_sample_method
INSTALL_HINT = ("vLLM is not installed here (no `vllm` on PATH): on a CUDA machine run `pip install vllm` "
                "(a release with the 'dspark' speculative method), then run the command above.")
OMNI_ARCHITECTURE = "Qwen3OmniDSparkModel"  # vLLM requires num_speculative_tokens == block_size for it
RESERVED_VLLM_FLAGS = ("--speculative-config", "--speculative_config")


class DraftRefused(DsparkError):
    """validate found errors: vLLM would fail to load (or would mis-serve) this draft with this target."""

    def __init__(self, report: Report, target: str):
        count = len(report.errors)
        super().__init__(
            f"{report.source} is refused: validate found {count} error{'s' if count != 1 else ''} against "
            f"{target}, so vLLM would fail to load or would mis-serve it; fix them (dspark validate "
            f"{report.source} --target {target} lists every finding).",
            EXIT_FINDINGS,
        )
        self.report = report


@dataclass(frozen=True)
class ServeRequest:
    target: str  # target model: folder or hub id (vLLM loads all of it; dspark reads only its config.json)
    draft: str  # draft checkpoint: folder or hub id
    block_size: int | None = None  # draft tokens per round; None: what the draft was trained for
    draft_topk: int | None = None  # Markov candidates per position; None: the draft config's dspark_draft_topk
    draft_sample_method: str = "probabilistic"
    port: int | None = None
    vllm_args: tuple[str, ...] = ()  # passed to `vllm serve` unchanged, after dspark's own flags
    confidence_threshold: float | None = None  # verify positions whose survival >= X (a `dspark plan` result)


@dataclass
class ServePlan:
    target: str  # as vLLM gets it: an absolute path for a local folder, else the hub id
    draft: str
    speculative_config: dict[str, Any]
    argv: list[str]
    report: Report  # validate's report (no errors; warnings and info are the caller's to show)
    trained_block_size: int | None
    draft_quantization: str  # how the draft's weights are stored; vLLM reads it from the draft, not from here
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The argv as one copy-pasteable POSIX shell line."""
        return shlex.join(self.argv)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "draft": self.draft,
            "speculative_config": self.speculative_config,
            "argv": self.argv,
            "command": self.command,
            "trained_block_size": self.trained_block_size,
            "draft_quantization": self.draft_quantization,
            "notes": self.notes,
            "findings": [f.to_dict() for f in self.report.findings],
        }


def plan_serve(request: ServeRequest) -> ServePlan:
    """validate's header-only rules on the pair, then the speculative config and the `vllm serve` argv."""
    check_request(request)
    target = _model_path(request.target, "target")
    ckpt = open_checkpoint(request.draft)
    target_config = read_target_config(request.target)
    check_target_files(request.target, config=False)  # broken weight files: vLLM would fail on them too
    report = validate_checkpoint(ckpt, target_config)
    if report.errors:
        raise DraftRefused(report, request.target)
    config = DraftConfig.from_dict(ckpt.config)
    draft = _model_path(request.draft, "draft")
    spec, notes = speculative_config(config, draft, request)
    notes += stateful_target_notes(target_config)
    return ServePlan(
        target=target,
        draft=draft,
        speculative_config=spec,
        argv=vllm_argv(target, spec, request.port, request.vllm_args),
        report=report,
        trained_block_size=draft_tokens_per_round(config),
        draft_quantization=_quantization(report),
        notes=notes,
    )


# Stateful families vLLM's model registry lists (vllm/model_executor/models/registry.py, _TEXT_GENERATION_MODELS;
# Qwen3.5 in vllm/model_executor/models/qwen3_5.py), by the name dspark gives the family (docs/stateful.md).
VLLM_STATEFUL_ARCHITECTURES = {
    "Qwen3.5": "Qwen3_5ForConditionalGeneration", "Qwen3.5-MoE": "Qwen3_5MoeForConditionalGeneration",
    "Qwen3-Next": "Qwen3NextForCausalLM", "LFM2-MoE": "Lfm2MoeForCausalLM",
    "Falcon-H1": "FalconH1ForCausalLM", "Jamba": "JambaForCausalLM", "Bamba": "BambaForCausalLM",
    "Granite-4 hybrid": "GraniteMoeHybridForCausalLM", "LFM2": "Lfm2ForCausalLM", "Mamba2": "Mamba2ForCausalLM",
    "MiniMax": "MiniMaxForCausalLM",
}


def stateful_target_notes(target_config: dict) -> list[str]:
    """What serving a stateful target means: vLLM keeps its recurrent states itself (one per drafted position for
    Gated DeltaNet layers: vllm/v1/attention/backends/gdn_attn.py, GDNAttentionMetadata.spec_state_indices_tensor
    and num_accepted_tokens), so dspark's own rollback is not involved."""
    from dspark_cli.runtime.checkpoint.stateful import family_of_config_dict

    family = family_of_config_dict(target_config)
    if family is None:
        return []
    return [f"{family.name} target: vLLM lists {VLLM_STATEFUL_ARCHITECTURES[family.name]} and keeps its recurrent "
            "states itself during speculative decoding; check that your vLLM release runs the 'dspark' method "
            "with hybrid targets (docs/stateful.md)."]


def check_request(request: ServeRequest) -> None:
    if request.draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise DsparkError(f"the draft sample method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, "
                          f"got {request.draft_sample_method!r}.")
    if request.port is not None and not 1 <= request.port <= 65535:
        raise DsparkError(f"the port must be between 1 and 65535, got {request.port}.")
    for arg in request.vllm_args:
        flag = arg.split("=", 1)[0]
        if sets_speculative_config(arg):
            raise DsparkError(f"the extra vLLM arguments contain {flag}, which sets vLLM's speculative config that "
                              "dspark builds itself; drop it and use dspark's own options (block size, draft top-k, "
                              "draft sample method).")
        if flag == "--port" and request.port is not None:
            raise DsparkError("the port is given twice (dspark's option and an extra vLLM argument); keep one.")


def sets_speculative_config(arg: str) -> bool:
    """Whether one extra vLLM argument sets (part of) the speculative config, in any spelling vLLM's parser takes:
    --speculative-config / --speculative_config, its short form -sc (also with the value attached), a dotted key
    (--speculative-config.num_speculative_tokens 5 sets one field of the JSON), or an unambiguous abbreviation
    of the long flag (argparse accepts prefixes). vLLM: vllm/engine/arg_utils.py EngineArgs.add_cli_args, and
    FlexibleArgumentParser (vllm/utils) for dotted keys."""
    flag = arg.split("=", 1)[0]
    if flag.startswith("-sc"):
        return True
    if not flag.startswith("--"):
        return False
    long_flag = flag.split(".", 1)[0].replace("_", "-")
    return long_flag in RESERVED_VLLM_FLAGS or (len(long_flag) >= len("--spec")
                                                 and RESERVED_VLLM_FLAGS[0].startswith(long_flag))


def draft_tokens_per_round(config: DraftConfig) -> int | None:
    """The most draft tokens per round the draft was trained for (= runtime.speculative.max_block_size): its
    block_size query slots predict block_size tokens when the anchor's slot predicts (sample_from_anchor, vLLM's
    dspark layout), one fewer in the DFlash layout where the anchor's slot predicts nothing."""
    trained = config.block_size.value
    if trained is None:
        return None
    return trained if config.sample_from_anchor else trained - 1


def speculative_config(config: DraftConfig, model: str, request: ServeRequest) -> tuple[dict[str, Any], list[str]]:
    """The JSON object for `vllm serve --speculative-config`, and notes on what vLLM takes from the draft itself."""
    method = "dflash" if config.kind == "dflash" else "dspark"
    tokens = _num_speculative_tokens(config, request.block_size, method)
    spec: dict[str, Any] = {
        "method": method,
        "model": model,
        "num_speculative_tokens": tokens,
        "draft_sample_method": request.draft_sample_method,
    }
    topk = _draft_topk(config, request.draft_topk, method)
    if topk is not None:
        spec["dspark_draft_topk"] = topk
    if request.confidence_threshold is not None:
        if method != "dspark" or not config.enable_confidence_head:
            raise DsparkError("a confidence threshold needs a DSpark draft with a confidence head, and this draft "
                              "has none; plan without thresholds.")
        spec["dspark_confidence_threshold"] = request.confidence_threshold
    notes = []
    if config.reduced_vocab:
        notes.append(f"reduced draft vocabulary ({config.draft_vocab_size} of {config.vocab_size} ids): vLLM maps "
                     "draft ids to target ids with the checkpoint's d2t tensor; nothing to set here.")
    return spec, notes


def vllm_argv(target: str, spec: dict[str, Any], port: int | None, extra: tuple[str, ...] | list[str]) -> list[str]:
    """`vllm serve TARGET --speculative-config JSON [--port P] [EXTRA...]` as an argument list (no shell)."""
    argv = [VLLM, "serve", target, "--speculative-config", json.dumps(spec)]
    if port is not None:
        argv += ["--port", str(port)]
    return argv + list(extra)


def find_vllm() -> str | None:
    """Path of the `vllm` executable on PATH, or None."""
    return shutil.which(VLLM)


def exec_vllm(argv: list[str]) -> NoReturn:
    """Replace this process by vLLM: same PID, so signals reach vLLM and its exit code is the caller's.

    A `vllm` on PATH that the kernel cannot start (not an executable format, a missing interpreter on its #! line,
    no permission) is one sentence."""
    try:
        os.execvp(argv[0], argv)
    except OSError as error:
        where = shutil.which(argv[0]) or argv[0]
        why = error.strerror or str(error)
        if isinstance(error, FileNotFoundError) and os.path.exists(where):
            why = "the interpreter named on its #! line does not exist"
        raise DsparkError(f"cannot start {where}: {why}; the vllm on PATH is not a working executable, reinstall "
                          "vLLM (pip install vllm) or fix PATH.") from None


def _num_speculative_tokens(config: DraftConfig, requested: int | None, method: str) -> int:
    trained = draft_tokens_per_round(config)
    if requested is None:
        if trained is None:
            raise DsparkError("the draft's config.json has no block_size, so the number of draft tokens per round "
                              "is unknown; pass the block size the draft was trained with.")
        return trained
    if requested < 1:
        raise DsparkError(f"the block size must be at least 1, got {requested}.")
    if trained is not None and requested > trained:
        raise DsparkError(f"a block size of {requested} is more than the {trained} draft tokens per round the "
                          f"draft was trained for ({method}); use {trained} or less.")
    if config.architecture == OMNI_ARCHITECTURE and trained is not None and requested != trained:
        raise DsparkError(f"vLLM serves {OMNI_ARCHITECTURE} drafts only with num_speculative_tokens equal to their "
                          f"block size {trained}; drop the block size or use {trained}.")
    return requested


def _draft_topk(config: DraftConfig, requested: int | None, method: str) -> int | None:
    topk = config.dspark_draft_topk if requested is None else requested
    if topk is None:
        return None
    if method != "dspark" or not config.has_markov:
        raise DsparkError("a draft top-k applies to the Markov head of a DSpark draft, and this draft has none; "
                          "drop the top-k.")
    vd = config.draft_vocab_size
    if vd is not None and not 1 <= topk <= vd:
        raise DsparkError(f"the draft top-k must be between 1 and the draft vocabulary size {vd}, got {topk}.")
    return topk


def _quantization(report: Report) -> str:
    head = report.resolved.get("head_format")
    if head and head.startswith("nvfp4"):
        return (f"markov_w2 {head}: vLLM reads the quantization from the draft's quantization_config "
                "(or hf_quant_config.json); the speculative config leaves 'quantization' unset")
    return "unquantized"


def _model_path(source: str, role: str) -> str:
    """An existing local folder becomes an absolute path (the command works from any directory); a hub id stays."""
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise DsparkError(f"the {role} {source} is a file; vLLM serves a model folder or a hub id, so pass the "
                          "folder that holds config.json and the weights.")
    return source
