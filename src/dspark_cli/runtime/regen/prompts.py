"""The prompt set of `dspark regen`: one conversation per record, the turns the target regenerates.

Accepted records (one JSON value per line of a .jsonl file):
  {"turns": ["user turn", ...]}                          DeepSpec's eval_datasets: every string is a user turn
  {"conversations": [{"role": ..., "content": ...}, ...]} DeepSpec's training data (its regenerate script's input)
  {"messages": [{"role": ..., "content": ...}, ...]}      dspark train's chat records
  {"prompt": "..."} or "..."                              dspark eval's prompt records: one user turn
A .txt file holds one prompt per line, or per paragraph when blank lines separate them (as `dspark eval` reads it).
Roles are system, user and assistant; an assistant message of the input is dropped, since the target's own reply
replaces it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dspark_cli.errors import DsparkError
from dspark_cli.runtime.io.reading import jsonl_records, open_regular
from dspark_cli.runtime.measure.evaluation import read_prompt_set

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Conversation:
    """One record of the prompt set: the messages as given (assistant ones included), where it came from."""

    index: int  # 0-based position among the records of the file
    source: str  # "file:line", for messages
    messages: tuple[dict, ...]

    @property
    def digest(self) -> str:
        """sha256 of the messages as canonical JSON: a resumed run checks that a record still means this input."""
        return hashlib.sha256(json.dumps(self.messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    @property
    def user_turns(self) -> int:
        return sum(message["role"] == "user" for message in self.messages)


def read_conversations(path: Path) -> list[Conversation]:
    """Every record of the prompt file `path` as a Conversation, or one sentence naming the file and line."""
    path = Path(path)
    if path.suffix == ".txt":
        prompts = read_prompt_set(path).prompts
        return [Conversation(i, f"{path}:{i + 1}", ({"role": "user", "content": p},)) for i, p in enumerate(prompts)]
    if path.suffix not in (".jsonl", ".json"):
        raise DsparkError(f"{path}: give a .jsonl prompt file (DeepSpec's turns or conversations, or messages "
                          "records) or a .txt file with one prompt per line.")
    with open_regular(path, "prompt file") as handle:
        data = handle.read()
    conversations = []
    for where, record in jsonl_records(data, path, "give one JSON record per line", invalid="is not JSON"):
        conversations.append(Conversation(len(conversations), where, _messages(record, where)))
    if not conversations:
        raise DsparkError(f"{path} holds no prompts; give at least one record.")
    return conversations


def _messages(record: object, where: str) -> tuple[dict, ...]:
    if isinstance(record, str):
        record = {"prompt": record}
    if not isinstance(record, dict):
        raise DsparkError(f"{where}: a record must be a JSON object or string, not {type(record).__name__}.")
    if "turns" in record:
        turns = record["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
            raise DsparkError(f"{where}: 'turns' must be a non-empty list of non-empty strings (the user turns).")
        return tuple({"role": "user", "content": turn} for turn in turns)
    for key in ("conversations", "messages"):
        if key in record:
            return _checked_messages(record[key], where, key)
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        return ({"role": "user", "content": record["prompt"]},)
    raise DsparkError(f"{where}: a record needs 'turns' (a list of user turns), 'conversations' or 'messages' (lists "
                      "of role/content messages), or a 'prompt' string.")


def _checked_messages(messages: object, where: str, key: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise DsparkError(f"{where}: '{key}' must be a non-empty list of messages.")
    for number, message in enumerate(messages, start=1):
        if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
            raise DsparkError(f"{where}: message {number} of '{key}' needs a role ({', '.join(ROLES)}) and a string "
                              "content.")
    if not any(message["role"] == "user" for message in messages):
        raise DsparkError(f"{where}: '{key}' has no user message, so there is nothing to answer.")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)
