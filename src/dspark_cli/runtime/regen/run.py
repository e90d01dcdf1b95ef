"""The regeneration: every conversation turn by turn through the server, `concurrency` conversations at a time.

Within a conversation the turns run in order and each regenerated reply replaces the input's assistant message in
what the next turn is sent (DeepSpec's regenerate script does the same). Worker threads (daemons, so an interrupt
never waits for a request in flight) each hold one conversation at a time; the calling thread alone writes, each
record as it arrives, so Ctrl-C keeps every record that finished.

    run = Regeneration(server, read_conversations(path), out, resume=False, concurrency=8)
    run.execute(on_record=...)      # run.tally: skipped (already in OUT), succeeded, failed
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dspark_cli.errors import SettingError
from dspark_cli.runtime.regen.client import Reply, Server, ServerError
from dspark_cli.runtime.regen.prompts import Conversation
from dspark_cli.runtime.regen.records import (append, count_records, error_path, error_record, finished, open_outputs,
                                              success_record)

POLL_S = 0.2  # how often the writing thread wakes while it waits (so that Ctrl-C is seen at once)
ERROR_CHARS = 300  # of an unexpected exception's text quoted in an error record


@dataclass
class Tally:
    total: int  # conversations in the prompt file
    skipped: int = 0  # already in OUT when a resumed run started
    succeeded: int = 0  # written to OUT by this run
    failed: int = 0  # written to the error file by this run
    first_error: str | None = None  # the first error record's sentence

    @property
    def left(self) -> int:
        return self.total - self.skipped - self.succeeded - self.failed

    def on_disk(self, out: Path) -> "Tally":
        """The tally as the files hold it (an interrupt can land between a record's write and its count)."""
        succeeded = count_records(out) - self.skipped
        return Tally(self.total, self.skipped, succeeded, count_records(error_path(out)), self.first_error)


@dataclass
class Regeneration:
    server: Server
    conversations: list[Conversation]
    out: Path
    resume: bool
    concurrency: int
    force: bool = False
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise SettingError("concurrency", f"must be at least 1, got {self.concurrency}.")
        done, note = finished(self.out, self.conversations, self.settings) if self.resume else (set(), None)
        self.notes += [note] if note else []
        self.pending = [c for c in self.conversations if c.index not in done]
        self.tally = Tally(len(self.conversations), skipped=len(self.conversations) - len(self.pending))

    @property
    def settings(self) -> dict:
        """What each record stores and a resumed run must match: the API, the model and the sampling."""
        return {"api": self.server.api, "model": self.server.model, **self.server.sampling.as_dict()}

    def execute(self, on_record: Callable[[dict], None] | None = None) -> Tally:
        """Regenerate the pending conversations, appending each record as it finishes, and count them in the tally
        (after an interrupt, which can land between a write and its count, `tally.on_disk` reads the files)."""
        work: queue.SimpleQueue = queue.SimpleQueue()
        for conversation in self.pending:
            work.put(conversation)
        results: queue.SimpleQueue = queue.SimpleQueue()
        stop = threading.Event()
        settings = self.settings

        def worker() -> None:
            while not stop.is_set():
                try:
                    conversation = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    results.put(regenerate_one(self.server, conversation, settings))
                except Exception as error:  # a bug, not a server failure: re-raised by the writing thread
                    results.put(error)

        success, errors = open_outputs(self.out, self.resume, self.force)
        try:
            for _ in range(min(self.concurrency, len(self.pending))):
                threading.Thread(target=worker, daemon=True).start()
            for _ in self.pending:
                self._write(_next(results), success, errors, on_record)
        finally:
            stop.set()
            try:
                while True:  # records that finished meanwhile (after an interrupt) are kept too
                    self._write(results.get_nowait(), success, errors, on_record=None)
            except queue.Empty:
                pass
            finally:
                success.close()
                errors.close()
        return self.tally

    def _write(self, record, success, errors, on_record) -> None:
        if isinstance(record, Exception):
            raise record
        ok = record["status"] == "success"
        append(success if ok else errors, record)
        if ok:
            self.tally.succeeded += 1
        else:
            self.tally.failed += 1
            self.tally.first_error = self.tally.first_error or record["error"]
        if on_record is not None:
            on_record(record)


def _next(results: queue.SimpleQueue):
    while True:
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            continue


def regenerate_one(server: Server, conversation: Conversation, settings: dict) -> dict:
    """The conversation with every user turn answered by the server in order, each reply fed to the next turn: a
    success record, or an error record naming the turn that failed."""
    messages: list[dict] = []
    turns: list[dict] = []
    for message in conversation.messages:
        if message["role"] == "assistant":
            continue  # the input's reply: the target's own replaces it
        messages.append(dict(message))
        if message["role"] != "user":
            continue
        try:
            reply = server.reply(messages)
        except ServerError as error:
            return error_record(conversation, len(turns) + 1, str(error), settings)
        except Exception as error:  # whatever else failed this request: this conversation's error, not the run's
            return error_record(conversation, len(turns) + 1, f"the request failed ({type(error).__name__}: "
                                f"{str(error)[:ERROR_CHARS] or 'no detail'}).", settings)
        turns.append(_turn(reply))
        messages.append({"role": "assistant", "content": reply.text})
    return success_record(conversation, messages, turns, settings)


def _turn(reply: Reply) -> dict:
    turn = {"prompt_token_ids": reply.prompt_token_ids, "token_ids": reply.token_ids, "text": reply.text,
            "finish_reason": reply.finish_reason}
    return turn | ({"reasoning": reply.reasoning} if reply.reasoning else {})
