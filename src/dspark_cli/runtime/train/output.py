"""`dspark train`'s output folder: refuse overlaps with inputs and taken folders, then create it exclusively.

Unlike quantize's output, a training folder is not written atomically: its checkpoint-N folders must survive an
interrupted run so that it can be resumed. So the folder is claimed up front (check_output, before anything is
loaded or deleted) and created exclusively once the target and data have loaded (create_output).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.outputs import (
    check_output_file,
    check_writable_parent,
    local_inputs,
    real_path,
    record_written,
    refuse_input_overlap,
)


@dataclass(frozen=True)
class OutputClaim:
    """What check_output found, for create_output once the target and data have loaded."""

    in_place: bool  # resuming a checkpoint inside `out`: continue there, delete nothing
    existed: bool  # `out` existed (empty, or replaced with force) when the run started
    replace: bool  # force: delete the existing `out` before creating it again


def check_output(out: Path, target: str | Path, data: list[Path], resume: Path | None, chat_template: Path | None,
                 force: bool) -> OutputClaim:
    """Refuse, before anything is loaded or deleted, an output folder that overlaps an input or is taken.

    `out` may not be, contain or lie inside the target, a data file or folder, the chat template or the resumed
    checkpoint, except that it may contain the resumed checkpoint to continue a run in place (without force,
    which would delete it). Otherwise an existing non-empty `out` needs force.
    """
    in_place = resume is not None and real_path(out) in real_path(resume).parents
    inputs = (local_inputs("target", [target]) + local_inputs("training data", data)
              + local_inputs("chat template", [chat_template]))
    if not in_place:
        inputs += local_inputs("checkpoint to resume", [resume])
    refuse_input_overlap(out, inputs, "output folder")
    if in_place and force:
        raise DsparkError(f"{out} holds the checkpoint to resume, {resume}, which replacing the folder would delete; "
                          "continue the run in place without force.")
    if os.path.lexists(out) and not out.is_dir():
        raise DsparkError(f"{out} exists and is not a folder; choose another output folder.")
    taken = out.is_dir() and any(out.iterdir())
    if not out.is_dir() or (taken and force):
        check_writable_parent(out, "output folder")  # out is created (again) beside its siblings
    if taken and not in_place and not force:
        raise DsparkError(f"{out} already exists and is not empty; choose another output folder, pass the force "
                          "option to replace it, or resume a checkpoint inside it (the resume option).")
    return OutputClaim(in_place=in_place, existed=out.is_dir(), replace=taken and force)


def create_output(out: Path, claim: OutputClaim) -> None:
    """Create `out` exclusively: if another run created it since check_output, refuse (unless resuming in place)."""
    if claim.in_place:
        return
    if claim.replace:
        shutil.rmtree(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(out, 0o777)  # the umask applies
    except FileExistsError:
        if claim.replace or not claim.existed or any(out.iterdir()):
            raise DsparkError(f"{out} was created by someone else while the target loaded (another run?); it was "
                              "left as it is. Choose another output folder.") from None
    except OSError as error:
        raise DsparkError(f"cannot create {out}: {error.strerror or error}; choose another output folder.") from None



def check_log_file(log: Path | None, out: Path, target: str | Path, data: list[Path], resume: Path | None,
                   chat_template: Path | None) -> None:
    """Refuse, before anything is loaded, a --log-jsonl file that would append to an input or cannot be written.

    The log is appended to (a run continued with --resume adds to its log), so beside check_output_file's checks
    (not an input, not a folder, a writable parent) an existing log must be a file this process may write, and it
    may not be the output folder or hold it.
    """
    if log is None:
        return
    inputs = (local_inputs("target", [target]) + local_inputs("training data", data)
              + local_inputs("chat template", [chat_template]) + local_inputs("checkpoint to resume", [resume]))
    check_output_file(log, inputs, "the log-jsonl option file")
    if real_path(log) == real_path(out) or real_path(log) in real_path(out).parents:
        raise DsparkError(f"the log-jsonl option file {log} is the output folder {out} or holds it; give a file name.")
    if os.path.exists(log) and not os.access(log, os.W_OK):
        raise DsparkError(f"the log-jsonl option file {log} exists and is not writable; choose another file.")


def open_log_file(log: Path):
    """The --log-jsonl file opened for appending (its missing parent folders created), or one sentence."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = log.open("a", encoding="utf-8")
    except OSError as error:
        raise DsparkError(f"cannot open the log-jsonl option file {log}: {error.strerror or error}; choose another "
                          "file.") from None
    record_written(log)  # on disk from now on: a later failure or interrupt names it
    return handle
