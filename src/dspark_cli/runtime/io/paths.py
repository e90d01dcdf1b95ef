"""Paths the native libraries can open.

The safetensors and tokenizers libraries (Rust) take a path as UTF-8 text and refuse one whose name
is not valid UTF-8 (Python holds such bytes as lone surrogates), with an error that reads as if the
file were broken. `require_utf8_path` says what is really wrong, before anything is opened.
"""

from __future__ import annotations

import os

from dspark_cli.errors import DsparkError


def require_utf8_path(path: str | os.PathLike, what: str) -> None:
    """DsparkError when `path` (absolute, if it exists) is not valid UTF-8; `what` names it in the sentence."""
    problem = non_utf8_problem(path)
    if problem is not None:
        raise DsparkError(f"{what} {problem}")


def non_utf8_problem(path: str | os.PathLike) -> str | None:
    """"PATH has a name that is not valid UTF-8, ..." (the rest of a sentence that names the path's role), or None
    when `path` (absolute, if it exists) is valid UTF-8."""
    text = os.fspath(path)
    expanded = os.path.expanduser(text)
    if os.path.exists(expanded):
        text = os.path.abspath(expanded)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        return (f"{shown} has a name that is not valid UTF-8, and the safetensors and tokenizers libraries cannot "
                "open such paths (the files themselves may be fine); rename the folder or move it to a UTF-8 path.")
    return None
