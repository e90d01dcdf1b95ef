"""The one bounded reader of dspark's input files: a regular file of at most a size cap, its UTF-8 text, its JSON.

Every file a user gives goes through here (a checkpoint's config.json, index and safetensors headers, eval's run
files and prompt sets, the STS, cost and plan files, train's JSONL lines): a FIFO or device is refused without
blocking, a file over its cap is refused unread, and JSON is parsed with Python's integer-length guard and a
nesting limit (its parser raises RecursionError on deep nesting). Errors are ReadError, one sentence naming the
file; a caller with its own error class (CheckpointError, RunFileError) re-raises the message. Torch-free, and
imports no other runtime folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from dspark_cli.errors import DsparkError

MAX_JSON_DEPTH = 100  # nesting of objects/arrays; real files nest fewer than 10 levels


class ReadError(DsparkError):
    """A file could not be read, or its text is not the JSON it must hold; the message names the file."""


@contextlib.contextmanager
def open_regular(path: Path, what: str, limit: int | None = None) -> Iterator[BinaryIO]:
    """Open `path` (the `what`, as messages name it) for reading only if it is a regular file of at most `limit`
    bytes; a FIFO is never blocked on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise ReadError(f"cannot read the {what} {path}: {error.strerror or error}.") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "it is not a regular file (a folder, FIFO or device); give a file"
    elif limit is not None and info.st_size > limit:
        problem = f"it has {info.st_size} bytes, more than the {limit}-byte limit for a {what}"
    if problem:
        os.close(fd)
        raise ReadError(f"cannot read the {what} {path}: {problem}.")
    with os.fdopen(fd, "rb") as handle:
        yield handle


def read_bounded(path: Path, what: str, limit: int) -> bytes:
    """The bytes of the regular file `path` of at most `limit` bytes (open_regular); ReadError otherwise."""
    with open_regular(path, what, limit) as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as error:
            raise ReadError(f"cannot read the {what} {path}: {error.strerror or error}.") from None
    if len(data) > limit:
        raise ReadError(f"cannot read the {what} {path}: it grew beyond the {limit}-byte limit while being read.")
    return data


def read_bounded_text(path: Path, what: str, limit: int) -> str:
    """The UTF-8 text of the regular file `path` of at most `limit` bytes; ReadError otherwise."""
    data = read_bounded(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ReadError(f"cannot read the {what} {path}: it is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}).") from None


def read_json_file(path: Path, what: str, limit: int, fix: str, *, invalid: str = "is not valid JSON") -> Any:
    """The JSON document of the regular file `path` of at most `limit` bytes (parse_json_text with `fix` as its
    advice); ReadError otherwise."""
    return parse_json_text(read_bounded(path, what, limit), str(path), fix, invalid=invalid)


def parse_json_text(
    text: str | bytes, where: str, fix: str = "re-download or fix the file", *, invalid: str = "is not valid JSON",
) -> Any:
    """json.loads with one-sentence ReadErrors for invalid, undecodable or absurdly nested JSON.

    The sentence is "{where} {invalid} ({detail}); {fix}."; JSON nested more than MAX_JSON_DEPTH deep is refused."""
    try:
        document = json.loads(text)
    except RecursionError:
        document = None  # reported below, like any nesting deeper than MAX_JSON_DEPTH
    except json.JSONDecodeError as error:
        raise ReadError(f"{where} {invalid} (line {error.lineno}: {error.msg}); {fix}.") from None
    except (UnicodeDecodeError, ValueError) as error:  # bad UTF-8; an integer of more than 4300 digits
        raise ReadError(f"{where} {invalid} ({error}); {fix}.") from None
    else:
        if _json_depth_within(document, MAX_JSON_DEPTH):
            return document
    raise ReadError(f"{where} nests JSON objects or arrays more than {MAX_JSON_DEPTH} levels deep, which no real "
                    f"file does; {fix}.")


def jsonl_records(data: bytes, path: Path, fix: str, *, invalid: str = "is not valid JSON"
                  ) -> Iterator[tuple[str, Any]]:
    """(where, record) for every non-blank line of JSONL bytes, where = "path:line"; a line that is not UTF-8 or not
    JSON is one ReadError naming it (parse_json_text's sentence, with `fix`)."""
    for number, raw in enumerate(data.splitlines(), start=1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ReadError(f"{where}: not UTF-8 text; a JSONL file must be UTF-8.") from None
        if line.strip():
            yield where, parse_json_text(line, where, fix, invalid=invalid)


def server_error_message(body: str) -> str:
    """The message of a server's error body: OpenAI's and llama.cpp's {"error": {"message": ...}}, an
    {"error": "..."} string or a bare {"message": ...}; the body itself when it is not such JSON."""
    try:
        document = json.loads(body)
    except ValueError:
        return body
    if not isinstance(document, dict):
        return body
    inner = document.get("error", document)
    if isinstance(inner, dict):
        return str(inner.get("message", body))
    return str(inner) if inner else body


def _json_depth_within(document: Any, limit: int) -> bool:
    """Whether at most `limit` objects/arrays nest in `document` ("[]" is 1 deep); iterative, so deep input is safe."""
    level, depth = [document], 0
    while True:
        containers = [node for node in level if isinstance(node, (dict, list))]
        if not containers:
            return True
        depth += 1
        if depth > limit:
            return False
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
