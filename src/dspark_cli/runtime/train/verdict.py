"""What a finished training run wrote, judged before the user finds out: dspark's own checks and each engine's
verdict on the draft (headers and configs only, the same rules as `dspark validate --engine all`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def engine_for_head(name: str, head_type: str):
    """The engine a training run writes for: `name`, or with "auto" the first registered engine that serves the
    head type (vLLM for a vanilla head, SGLang for gated and RNN heads). SettingError, before any training, when the
    named engine refuses that head type."""
    from dspark_cli.errors import SettingError
    from dspark_cli.runtime.engines import ENGINES, engine

    serving = [e for e in ENGINES.values() if not e.refuses_head(head_type)]
    if name == "auto":
        return serving[0] if serving else None
    chosen = engine(name)
    if chosen.refuses_head(head_type):
        others = ", ".join(e.name for e in serving) or "none"
        raise SettingError("engine", f"{name}: {chosen.label} serves no {head_type} Markov head (validate's DSP012); "
                                     f"train a vanilla head for it, or pick an engine that serves {head_type} heads "
                                     f"({others}).")
    return chosen


@dataclass
class WrittenDraft:
    refusals: list[str]  # dspark's own refusals of the draft with its target, one sentence each (none: it runs)
    verdicts: list  # engines.seam.Verdict per registered engine


def judge_written_draft(draft: str | Path, target: str | Path) -> WrittenDraft:
    """Validate's rules on the written draft against its target: what dspark itself refuses (not what only some
    engine refuses), and every engine's verdict."""
    from dspark_cli.runtime.checkpoint.read import open_checkpoint, read_target_config
    from dspark_cli.runtime.checkpoint.rules import validate_checkpoint
    from dspark_cli.runtime.engines import ENGINE_ONLY_CODES, ENGINES
    from dspark_cli.runtime.engines.seam import draft_config

    ckpt = open_checkpoint(draft)
    report = validate_checkpoint(ckpt, read_target_config(target))
    refusals = [f"{f.code} {f.message}" for f in report.errors if f.code not in ENGINE_ONLY_CODES]
    config = draft_config(ckpt, report)
    return WrittenDraft(refusals, [engine.verdict(report, config) for engine in ENGINES.values()])
