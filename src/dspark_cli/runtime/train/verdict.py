"""What a finished training run wrote, judged before the user finds out: dspark's own checks and each engine's
verdict on the draft (headers and configs only, the same rules as `dspark validate --engine all`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
