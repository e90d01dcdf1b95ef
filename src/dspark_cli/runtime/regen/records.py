"""The two files `dspark regen` writes: OUT (one success record per conversation) and OUT's error file (one error
record per conversation that failed), both JSONL, appended record by record.

Each record is one line written whole, flushed and fsync'd before the next, so a crash or Ctrl-C leaves only
finished records (at worst a partial last line from a hard kill, which a resumed run cuts off). A resumed run reads
OUT back: the conversations it holds are skipped, everything else (the errors included) is tried again, and the
error file starts afresh. A success record:

    {"index": 3, "source": "prompts.jsonl:4", "input_sha256": "...", "status": "success",
     "conversations": [...the input's system and user messages, each user turn followed by the regenerated reply...],
     "turns": [{"prompt_token_ids": [...], "token_ids": [...], "text": "...", "finish_reason": "stop"}, ...],
     "token_ids": [...the last turn's prompt_token_ids + token_ids: the whole conversation as the server's ids...],
     "settings": {"api": "llamacpp", "model": "...", "temperature": 0.7, ...}}

`dspark train` reads `token_ids` as one document, as-is (runtime/train/data.py); `conversations` and `status` are
DeepSpec's keys (its regenerate script, generate_train_data.py), so its tooling reads the text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.outputs import check_output_files, default_file_mode, record_written
from dspark_cli.runtime.io.reading import open_regular, parse_json_text
from dspark_cli.runtime.regen.prompts import Conversation

def error_path(out: Path) -> Path:
    """OUT's error file: DeepSpec's name, `<stem>_error.jsonl` beside OUT."""
    return Path(out).with_name(f"{Path(out).stem}_error.jsonl")


def check_outputs(out: Path, prompts: Path, resume: bool, force: bool) -> None:
    """Refuse, before any request, outputs that would overwrite the prompt file, each other or earlier results."""
    out = Path(out)
    if out.suffix != ".jsonl":
        raise DsparkError(f"the output {out} must end in .jsonl (its errors go to {error_path(out).name}).")
    if resume and force:
        raise DsparkError(f"the resume option continues {out} and the force option replaces it; pass one of them.")
    check_output_files([("output", out), ("error file", error_path(out))], [("prompt file", prompts)])
    if not (resume or force):
        for path in (out, error_path(out)):
            if os.path.lexists(path):
                raise DsparkError(f"{path} already exists; continue it with the resume option, replace it with the "
                                  "force option, or choose another output.")


def open_outputs(out: Path, resume: bool, force: bool) -> tuple[IO[str], IO[str]]:
    """OUT for appending (resume), replacing (force) or created exclusively, and an error file started afresh."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    success = _open(out, "a" if resume else "w" if force else "x")
    try:
        return success, _open(error_path(out), "w" if resume or force else "x")
    except BaseException:
        success.close()
        raise


def _open(path: Path, mode: str) -> IO[str]:
    try:
        return open(path, mode, encoding="utf-8", opener=lambda name, flags: os.open(name, flags, default_file_mode()))
    except FileExistsError:
        raise DsparkError(f"{path} appeared while this run started (another run?); it was left as it is.") from None


def append(handle: IO[str], record: dict) -> None:
    """One record as one whole line, on disk before this returns."""
    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    handle.flush()
    os.fsync(handle.fileno())
    record_written(Path(handle.name))


def count_records(path: Path) -> int:
    """Whole records (lines) in one of the files: what is on disk, whenever a run stopped."""
    if not Path(path).is_file():
        return 0
    with open(path, "rb") as handle:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 24), b""))


def finished(out: Path, conversations: list[Conversation], settings: dict) -> tuple[set[int], str | None]:
    """The indices OUT already holds, checked against this run: the same input at each index and the same settings.
    A partial last line (a hard kill mid-write) is cut off; the second value says so."""
    out = Path(out)
    if not out.exists():
        return set(), None
    with open_regular(out, "output") as handle:
        data = handle.read()
    note = None
    if data and not data.endswith(b"\n"):
        kept = data.rfind(b"\n") + 1
        os.truncate(out, kept)
        data = data[:kept]
        note = f"{out}: cut off a partial last record (an interrupted write); its conversation is run again"
    done: set[int] = set()
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{out}:{number}"
        record = parse_json_text(line, where, "it is not a record dspark regen wrote; choose another output")
        _check_record(record, where, conversations, settings)
        done.add(record["index"])
    return done, note


def _check_record(record: object, where: str, conversations: list[Conversation], settings: dict) -> None:
    index = record.get("index") if isinstance(record, dict) else None
    if not isinstance(index, int) or record.get("status") != "success":
        raise DsparkError(f"{where} is not a success record of dspark regen; choose another output.")
    if not 0 <= index < len(conversations) or record.get("input_sha256") != conversations[index].digest:
        raise DsparkError(f"{where} was regenerated from another prompt than record {index + 1} of this prompt file; "
                          "resume with the prompt file that run used, or choose another output.")
    written = record.get("settings")
    if written != settings:
        changed = sorted(k for k in set(settings) | set(written or {}) if (written or {}).get(k) != settings.get(k))
        raise DsparkError(f"{where} was regenerated with other settings ({', '.join(changed)}: "
                          f"{', '.join(f'{(written or {}).get(k)!r}' for k in changed)}); resume with the same ones, "
                          "or choose another output.")


def success_record(conversation: Conversation, messages: list[dict], turns: list[dict], settings: dict) -> dict:
    last = turns[-1]
    return {"index": conversation.index, "source": conversation.source, "input_sha256": conversation.digest,
            "status": "success", "conversations": messages, "turns": turns,
            "token_ids": last["prompt_token_ids"] + last["token_ids"], "settings": settings}


def error_record(conversation: Conversation, turn: int, error: str, settings: dict) -> dict:
    return {"index": conversation.index, "source": conversation.source, "input_sha256": conversation.digest,
            "status": "error", "error": error, "turn": turn, "conversations": list(conversation.messages),
            "settings": settings}
