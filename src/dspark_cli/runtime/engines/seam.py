"""What every serving engine fills (engines/__init__.py registers them), and the request and plan they share.

An engine module defines one `Engine`:
- `name`, `label`: the registry key ("sglang") and how messages name it ("SGLang");
- `source`: the engine's files (and commits) its rules were read from; each engine's page (docs/engine-*.md,
  docs/serve.md for vLLM) says which are verified;
- `own_codes`: codes of validate's report that this engine refuses although the draft is sound (restrictions of
  some engines, e.g. vLLM's DSP012); a code no registered engine lists blocks every engine (a broken draft);
- `rules(config, report) -> (findings, notes)`: what only this engine checks: error findings with the engine codes
  of `rules.codes.ENGINE_CODES` (DSP7xx, made with `engine_finding`), and notes on what it loads but drops or
  changes for this draft;
- `layout`: the draft layout it needs, in one sentence; `reads`: the files it takes besides the two models;
- `plan(request) -> ServePlan`: checks the pair (`checked_pair`: validate's header-only rules, then `verdict`;
  `DraftRefused` when it refuses) and builds the argv that launches it, with the files to write beside it.

`Engine.verdict(report, config)` is what `dspark validate --engine` prints: serves / serves with losses / refuses.
`markov_heads` (the Markov head types its loader builds) is read by its verdict and by train's engine choice.
Torch-free: engines/ imports only checkpoint/, settings.py, rounds.py, io/, errors and (SGLang's STS file check)
measure/calibration.py's reader.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dspark_cli.errors import EXIT_FINDINGS, DsparkError
from dspark_cli.runtime.checkpoint.config import DraftConfig
from dspark_cli.runtime.checkpoint.read import Checkpoint
from dspark_cli.runtime.checkpoint.rules import ERROR, Finding, Report
from dspark_cli.runtime.checkpoint.rules.codes import ENGINE_CODES


@dataclass(frozen=True)
class ServeRequest:
    target: str  # target model: folder or hub id (the engine loads all of it; dspark reads only its config.json)
    draft: str  # draft checkpoint: folder or hub id
    block_size: int | None = None  # draft tokens per round; None: what the draft was trained for
    draft_topk: int | None = None  # Markov candidates per position; None: the draft config's dspark_draft_topk
    draft_sample_method: str | None = None  # None: the engine's own (vLLM: probabilistic; llama.cpp: greedy)
    port: int | None = None
    engine_args: tuple[str, ...] = ()  # passed to the engine's command unchanged, after dspark's own flags
    confidence_threshold: float | None = None  # verify positions whose survival >= X (a `dspark plan` result)
    calibration: str | None = None  # STS temperatures file of `dspark calibrate` (engines that read one)
    files_dir: str = "."  # where the caller writes the plan's `files`; the argv names them there

    def __post_init__(self) -> None:
        """The one check every engine shares: a port the OS can listen on."""
        if self.port is not None and not 1 <= self.port <= 65535:
            raise DsparkError(f"the port must be between 1 and 65535, got {self.port}.")


@dataclass
class ServePlan:
    target: str  # as the engine gets it: an absolute path for a local folder, else the hub id
    draft: str
    speculative_config: dict[str, Any]
    argv: list[str]
    report: Report  # validate's report (nothing the engine refuses; warnings and info are the caller's to show)
    trained_block_size: int | None
    draft_quantization: str  # how the draft's weights are stored
    notes: list[str] = field(default_factory=list)  # what the engine drops, changes or takes from the draft itself
    engine: str = "vllm"
    files: dict[str, str] = field(default_factory=dict)  # file name -> text, written by the caller in files_dir

    @property
    def draft_tokens(self) -> int:
        """Draft tokens per round, under the engine's own name for it."""
        spec = self.speculative_config
        if "speculative_num_draft_tokens" in spec:  # SGLang's DFLASH block: the anchor and the drafted tokens
            return spec["speculative_num_draft_tokens"] - 1
        return next(spec[k] for k in ("num_speculative_tokens", "speculative_dspark_block_size", "max_draft_len",
                                      "spec_draft_n_max") if k in spec)

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
            **({"engine": self.engine} if self.engine != "vllm" else {}),
            **({"files": self.files} if self.files else {}),
            "findings": [f.to_dict() for f in self.report.findings],
        }


Rules = Callable[[DraftConfig, Report], tuple[list[Finding], list[str]]]


def refuse_vllm_only_settings(request: ServeRequest, label: str) -> None:
    """What dspark hands to vLLM alone: a draft top-k, a survival threshold, the draft sample method."""
    if request.draft_topk is not None or request.confidence_threshold is not None:
        raise DsparkError(f"{label} takes no draft top-k or survival threshold from dspark; drop them, or serve "
                          "with vLLM.")
    if request.draft_sample_method is not None:
        raise DsparkError(f"the draft sample method is a vLLM setting; drop it for {label}.")


def head_type_finding(engine: Engine, config: DraftConfig, code: str, where: str) -> list[Finding]:
    """The engine's refusal (`code`) of a Markov head type its loader does not build (`where`: the file that
    says so), for an engine that does not list validate's DSP012 among its own codes."""
    if not config.has_markov or not engine.refuses_head(config.markov_head_type):
        return []
    return [engine_finding(code, f"markov_head_type is {config.markov_head_type!r}; {engine.label} builds "
                                 f"{', '.join(sorted(engine.markov_heads))} heads only ({where}).")]


def refuse_own_flags(request: ServeRequest, label: str, own: tuple[str, ...]) -> None:
    """Extra engine arguments that set what dspark sets itself (`own`, in either -/_ spelling), or --port when
    dspark's own port is given."""
    for arg in request.engine_args:
        flag = arg.split("=", 1)[0]
        if flag.replace("_", "-") in own or (flag == "--port" and request.port is not None):
            raise DsparkError(f"the extra {label} arguments contain {flag}, which dspark sets itself; drop it.")


def no_rules(config: DraftConfig, report: Report) -> tuple[list[Finding], list[str]]:
    return [], []


def engine_finding(code: str, message: str) -> Finding:
    """An error of one engine's own rules (ENGINE_CODES): the message says what the draft has, the hint is the
    registry's."""
    label, _, hint = ENGINE_CODES[code]
    return Finding(code, ERROR, f"{label}: {message}", hint)


@dataclass(frozen=True)
class Verdict:
    engine: str
    label: str
    refused: list[Finding]  # validate's errors this engine refuses, then its own rules' errors
    notes: list[str]  # what it loads but drops or changes
    layout: str
    reads: str

    @property
    def status(self) -> str:
        return "refuses" if self.refused else "serves with losses" if self.notes else "serves"

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.label, "verdict": self.status, "codes": [f.code for f in self.refused],
                "refused": [f.to_dict() for f in self.refused], "notes": self.notes, "layout": self.layout,
                "reads": self.reads}


@dataclass(frozen=True)
class Engine:
    name: str  # the registry key, e.g. "vllm"
    label: str  # how messages name it, e.g. "vLLM"
    source: str  # where its rules were read (the engine's source files; its docs page lists the commits)
    own_codes: frozenset[str]  # validate's error codes only some engines refuse, this one among them
    plan: Callable[[ServeRequest], ServePlan]  # check the pair, then the command that launches it
    rules: Rules = no_rules  # this engine's own checks (ENGINE_CODES) and notes on what it drops
    layout: str = ""  # the draft layout it needs
    reads: str = ""  # the files it reads besides the two models
    installed: Callable[[], bool] = lambda: False  # whether its command can start here (nothing imported)
    install_hint: str = ""  # how to install it, one sentence
    plain: Callable[[ServeRequest], list[str]] | None = None  # the target alone: when a plan says do not speculate
    draft_length_setting: str = ""  # the flag or config field that sets the draft tokens per round
    threshold_setting: str | None = None  # the one that cuts a drafted block at a confidence threshold, if any
    markov_heads: frozenset[str] = frozenset({"vanilla"})  # the Markov head types its loader builds

    def refuses(self, report: Report) -> list[Finding]:
        """The errors of validate's report that block this engine: all but the restrictions of other engines."""
        from dspark_cli.runtime.engines import ENGINE_ONLY_CODES

        others = ENGINE_ONLY_CODES - self.own_codes
        return [finding for finding in report.errors if finding.code not in others]

    def refuses_head(self, head_type: str) -> bool:
        """Whether this engine's loader builds no Markov head of this type (`markov_heads`): its verdict refuses
        such a draft (validate's DSP012 for vLLM and llama.cpp, the engine's own code for the others)."""
        return head_type not in self.markov_heads

    def verdict(self, report: Report, config: DraftConfig | None) -> Verdict:
        """Serves / serves with losses / refuses: validate's errors it refuses plus its own rules (run only on a
        DSpark or DFlash draft, `config`)."""
        findings, notes = self.rules(config, report) if config is not None else ([], [])
        return Verdict(self.name, self.label, self.refuses(report) + findings, notes, self.layout, self.reads)


def draft_config(ckpt: Checkpoint, report: Report) -> DraftConfig | None:
    """The draft's typed config for the engines' rules; None when validate found no DSpark or DFlash draft."""
    if report.format == "unknown":
        return None
    return DraftConfig.from_dict(ckpt.config)


@dataclass
class CheckedPair:
    target: str  # absolute path of a local folder, else the hub id
    draft: str
    report: Report
    config: DraftConfig
    target_config: dict
    verdict: Verdict


def checked_pair(request: ServeRequest, engine: Engine) -> CheckedPair:
    """validate's header-only rules on the pair and the engine's verdict; DraftRefused when it refuses."""
    from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
    from dspark_cli.runtime.checkpoint.target_files import check_target_files

    target = model_path(request.target, "target", engine.label)
    ckpt = open_checkpoint(request.draft)
    target_config = read_target_config(request.target)
    check_target_files(request.target, config=False)  # broken weight files: the engine would fail on them too
    report = validate_checkpoint(ckpt, target_config)
    config = draft_config(ckpt, report)
    verdict = engine.verdict(report, config)
    if verdict.refused:
        raise DraftRefused(report, verdict.refused, request.target, engine.label)
    return CheckedPair(target, model_path(request.draft, "draft", engine.label), report, config, target_config,
                       verdict)


def model_path(source: str, role: str, label: str) -> str:
    """An existing local folder becomes an absolute path (the command works from any directory); a hub id stays."""
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise DsparkError(f"the {role} {source} is a file; {label} serves a model folder or a hub id, so pass the "
                          "folder that holds config.json and the weights.")
    return source


def head_quantization(report: Report) -> str | None:
    """The Markov head's storage when it is quantized (validate's resolved head_format), else None."""
    head = report.resolved.get("head_format")
    return head if head and head.startswith("nvfp4") else None


QKV = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.qkv_proj")  # vLLM prefixes' ends


@dataclass(frozen=True)
class LinearQuantization:
    """The draft's Linear weights stored quantized, markov_w2 aside (`dspark quantize --scope draft`): how many in
    each format (validate's resolved quantized_linear_layers, read from the tensors) and which layers config.json's
    quantization_config names in its quantized_layers (vLLM prefixes: model.layers.0.self_attn.q_proj, model.fc,
    lm_head), or None where it names none (a single-algorithm config, or hf_quant_config.json alone, claims every
    layer it does not exclude: each layer then counts as possibly quantized)."""

    counts: dict[str, int]  # {"nvfp4": 8} / {"fp8": 8}
    names: frozenset[str] | None

    def covers(self, *ends: str) -> bool:
        """Whether a quantized layer's prefix ends with one of `ends` (every layer may, when no names are given)."""
        return self.names is None or any(name.endswith(ends) for name in self.names)

    @property
    def stored(self) -> str:
        """'8 Linear weights are stored as FP8', for messages."""
        total = sum(self.counts.values())
        kinds = " and ".join(kind.upper() for kind in sorted(self.counts))
        return f"{total} Linear weight{'s are' if total != 1 else ' is'} stored as {kinds}"


def linear_quantization(config: DraftConfig, report: Report) -> LinearQuantization | None:
    """The draft's quantized Linear layers (LinearQuantization), or None when every one is unquantized."""
    counts = report.resolved.get("quantized_linear_layers") or {}
    if not counts:
        return None
    quant = config.raw.get("quantization_config")
    layers = quant.get("quantized_layers") if isinstance(quant, dict) else None
    names = frozenset(layers) if isinstance(layers, dict) and layers else None
    return LinearQuantization(dict(counts), names)


class DraftRefused(DsparkError):
    """validate found errors the engine refuses: it would fail to load (or would mis-serve) this draft."""

    def __init__(self, report: Report, findings: list[Finding], target: str, label: str):
        count = len(findings)
        super().__init__(
            f"{report.source} is refused: validate found {count} error{'s' if count != 1 else ''} against "
            f"{target}, so {label} would fail to load or would mis-serve it; fix them (dspark validate "
            f"{report.source} the target option {target} lists every finding).",
            EXIT_FINDINGS,
        )
        self.report = report
        self.findings = findings
