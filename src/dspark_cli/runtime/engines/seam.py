"""What every serving engine fills (engines/__init__.py registers them), and the request and plan they share.

An engine module defines one `Engine`: its registry name and label, the source its rules were read from, the codes
of validate's report it alone refuses (`own_codes`: restrictions of that engine, not a broken draft, which dspark
itself runs), and `plan(request) -> ServePlan`, which checks the pair with validate's header-only rules, refuses it
when `engine.refuses(report)` is not empty (`DraftRefused`), and builds the argv that launches the checked pair,
with notes on what the engine drops or changes. Torch-free: engines/ imports only checkpoint/, settings.py,
rounds.py, io/ and errors.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from dspark_cli.errors import EXIT_FINDINGS, DsparkError
from dspark_cli.runtime.checkpoint.rules import Finding, Report


@dataclass(frozen=True)
class ServeRequest:
    target: str  # target model: folder or hub id (the engine loads all of it; dspark reads only its config.json)
    draft: str  # draft checkpoint: folder or hub id
    block_size: int | None = None  # draft tokens per round; None: what the draft was trained for
    draft_topk: int | None = None  # Markov candidates per position; None: the draft config's dspark_draft_topk
    draft_sample_method: str = "probabilistic"
    port: int | None = None
    engine_args: tuple[str, ...] = ()  # passed to the engine's command unchanged, after dspark's own flags
    confidence_threshold: float | None = None  # verify positions whose survival >= X (a `dspark plan` result)


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


@dataclass(frozen=True)
class Engine:
    name: str  # the registry key, e.g. "vllm"
    label: str  # how messages name it, e.g. "vLLM"
    source: str  # where its rules were read (the engine's source files; docs/serve.md lists the commits)
    own_codes: frozenset[str]  # validate's error codes only this engine (among the registered ones) refuses
    plan: Callable[[ServeRequest], ServePlan]  # check the pair, then the command that launches it

    def refuses(self, report: Report) -> list[Finding]:
        """The errors of validate's report that block this engine: all but the restrictions of other engines."""
        from dspark_cli.runtime.engines import ENGINE_ONLY_CODES

        others = ENGINE_ONLY_CODES - self.own_codes
        return [finding for finding in report.errors if finding.code not in others]


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
