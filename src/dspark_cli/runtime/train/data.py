"""Training data: collect documents from text / JSONL files and folders, tokenize them, sample packed windows.

Documents are tokenized with the target's tokenizer, joined into one stream with the end-of-text token
between documents, and training windows are drawn at random offsets of that stream (seeded, so a run is
reproducible). Chat records (`messages`) are rendered with a chat template; token-id records (`token_ids`, what
`dspark regen` writes) are used as-is, never tokenized again.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.decode.chat import bounded_render
from dspark_cli.runtime.io.reading import jsonl_records

if TYPE_CHECKING:
    import torch

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".text"}
JSONL_SUFFIXES = {".jsonl", ".json"}


@dataclass(frozen=True)
class Document:
    """One training document: plain text, a chat conversation to render with a template, or token ids."""

    source: str
    text: str | None = None
    messages: list[dict] | None = None
    token_ids: list[int] | None = None


def collect_files(paths: Iterable[Path]) -> list[Path]:
    """Expand folders (recursively, sorted) into text and JSONL files; files given explicitly are kept as-is."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | JSONL_SUFFIXES)
            if not found:
                raise DsparkError(f"{path}: the folder holds no text or JSONL files "
                                  f"({', '.join(sorted(TEXT_SUFFIXES | JSONL_SUFFIXES))}).")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            what = "not a regular file or folder" if path.exists() else "no such file or folder"
            raise DsparkError(f"{path}: {what}; pass text files, JSONL files or folders with the data option.")
    return files


def read_documents(files: Iterable[Path]) -> list[Document]:
    """Read every file: JSONL records with `text` or `messages`, any other file as one text document."""
    documents: list[Document] = []
    for path in files:
        if path.suffix in JSONL_SUFFIXES:
            documents.extend(_read_jsonl(path))
        else:
            documents.append(Document(str(path), text=_read_text(path)))
    if not documents:
        raise DsparkError("the training data holds no documents; check the paths of the data option.")
    return documents


def _read_text(path: Path) -> str:
    """A text file (undecodable bytes replaced); a file with NUL bytes is binary and refused."""
    data = path.read_bytes()
    if b"\0" in data:
        raise DsparkError(f"{path} is a binary file (it contains NUL bytes); the data option takes text, JSONL or folders.")
    return data.decode("utf-8", errors="replace")


def _read_jsonl(path: Path) -> list[Document]:
    documents = []
    for where, record in jsonl_records(path.read_bytes(), path, "each line must be one JSON object"):
        if isinstance(record, dict) and isinstance(record.get("token_ids"), list):
            documents.append(Document(where, token_ids=_token_ids(record["token_ids"], where)))
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            documents.append(Document(where, text=record["text"]))
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            documents.append(Document(where, messages=record["messages"]))
        elif isinstance(record, dict) and record.get("status") == "error":
            raise DsparkError(f"{where}: an error record of dspark regen holds no training data; leave the error file "
                              "out of the data option.")
        else:
            raise DsparkError(f"{where}: a JSONL record needs a string 'text', a list 'messages' or a list 'token_ids'.")
    return documents


def _token_ids(ids: list, where: str) -> list[int]:
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise DsparkError(f"{where}: 'token_ids' must be a non-empty list of non-negative integers.")
    return ids


def render_documents(documents: list[Document], tokenizer, chat_template: str | None = None) -> list[str | list[int]]:
    """Text of every document (conversations through `chat_template` or else the tokenizer's own template), or its
    token ids when it has them: ids outside the tokenizer's vocabulary are refused."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    texts: list[str | list[int]] = []
    for doc in documents:
        if doc.token_ids is not None:
            if max(doc.token_ids) >= len(tokenizer):
                raise DsparkError(f"{doc.source}: token id {max(doc.token_ids)} is outside the target tokenizer's "
                                  f"{len(tokenizer)} ids; the record was generated by another model.")
            texts.append(doc.token_ids)
            continue
        if doc.text is not None:
            texts.append(doc.text)
            continue
        if not template:
            raise DsparkError(f"{doc.source}: a chat record needs a chat template, but the tokenizer has none; "
                              "pass a Jinja template file with the chat-template option.")
        texts.append(bounded_render(
            lambda: tokenizer.apply_chat_template(doc.messages, chat_template=template, tokenize=False),
            f"{doc.source}: the chat template",
            "fix the record or the template (the chat-template option)"))
    return texts


def tokenize_stream(texts: list[str | list[int]], tokenizer, separator_id: int | None) -> "torch.Tensor":
    """Token ids of all texts joined into one stream, `separator_id` after each text; a text given as token ids
    is taken as-is. -> [N] int64."""
    import torch

    strings = [text for text in texts if isinstance(text, str)]
    encoded = iter(tokenizer(strings, add_special_tokens=False)["input_ids"] if strings else [])
    stream: list[int] = []
    for ids in (text if isinstance(text, list) else next(encoded) for text in texts):
        stream.extend(ids)
        if separator_id is not None:
            stream.append(separator_id)
    return torch.tensor(stream, dtype=torch.long)


@dataclass
class TokenStream:
    """A packed token stream from which fixed-length training windows are drawn."""

    tokens: "torch.Tensor"  # [N] int64

    def __post_init__(self) -> None:
        if self.tokens.numel() < 2:
            raise DsparkError("the training data tokenizes to fewer than 2 tokens; give more text.")

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def max_window(self) -> int:
        return len(self)

    def sample(self, batch_size: int, seq_len: int, generator: "torch.Generator") -> "torch.Tensor":
        """Random windows of the stream. -> [batch_size, seq_len] (shorter when the stream is short)."""
        import torch

        seq_len = min(seq_len, len(self))
        starts = torch.randint(0, len(self) - seq_len + 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len)
        return self.tokens[starts[:, None] + offsets[None, :]]

    def windows(self, seq_len: int, limit: int | None = None) -> "torch.Tensor":
        """Consecutive non-overlapping windows (for evaluation). -> [n, seq_len]."""
        n = len(self) // seq_len if limit is None else min(limit, len(self) // seq_len)
        return self.tokens[: n * seq_len].view(n, seq_len)


@dataclass
class SequenceBank:
    """Fixed training sequences (e.g. prompts with the target's own continuations); draws whole rows."""

    rows: "torch.Tensor"  # [N, T] int64

    @property
    def max_window(self) -> int:
        return self.rows.shape[1]

    def sample(self, batch_size: int, seq_len: int, generator: "torch.Generator") -> "torch.Tensor":
        """Random rows, cut to seq_len. -> [batch_size, min(seq_len, T)]"""
        import torch

        picked = torch.randint(0, self.rows.shape[0], (batch_size,), generator=generator)
        return self.rows[picked, :seq_len]


MAX_TEMPLATE_BYTES = 1 << 20  # chat templates are a few kB


def read_chat_template(path: Path) -> str:
    """A Jinja chat template file: a regular UTF-8 text file of at most 1 MiB, or one sentence."""
    path = Path(path)
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise DsparkError(f"the chat-template option {path} {what}; pass a Jinja template file.")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise DsparkError(f"the chat-template option {path} is {path.stat().st_size:,} bytes, more than a chat template's "
                          f"{MAX_TEMPLATE_BYTES:,}; pass a Jinja template file.")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise DsparkError(f"the chat-template option {path} is not UTF-8 text (a binary file?); pass a Jinja template "
                          "file.") from None


def load_token_stream(paths: Iterable[Path], tokenizer, chat_template_file: Path | None = None) -> TokenStream:
    """Files or folders -> one packed token stream in the tokenizer's ids."""
    template = None
    if chat_template_file is not None:
        template = read_chat_template(chat_template_file)
    documents = read_documents(collect_files(paths))
    texts = render_documents(documents, tokenizer, template)
    return TokenStream(tokenize_stream(texts, tokenizer, tokenizer.eos_token_id))


# --- the offline demo corpus -----------------------------------------------------------------------------

STDLIB_EXCLUDED_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "idle_test"}


def stdlib_sources() -> list[Path]:
    """The running interpreter's standard-library .py files (no tests, IDLE or site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if STDLIB_EXCLUDED_DIRS.intersection(relative.parts[:-1]) or relative.name.startswith("test_"):
            continue
        files.append(path)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if len(files) < 50:
        raise DsparkError(f"{root}: found only {len(files)} standard-library sources; the demo corpus needs the "
                          "interpreter's Lib folder.")
    return files


def split_held_out(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    """Deterministic split: every `every`-th file (in sorted order) is held out for evaluation."""
    train = [f for i, f in enumerate(files) if i % every != every // 2]
    held_out = [f for i, f in enumerate(files) if i % every == every // 2]
    return train, held_out
