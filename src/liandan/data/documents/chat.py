"""Reading chat records for supervised fine-tuning from .jsonl files (optionally .gz or .zst).

A record is either a conversation,

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}, ...]}

or a prompt and its response, read as a user turn and an assistant turn:

    {"prompt": "...", "response": "..."}

Roles are system, user and assistant; every content is a string; a conversation holds at least one assistant
turn (there is nothing to learn from one without). A record that breaks any of this is counted in
`ReadStats.skipped` under a stable reason and handed to `on_reject` with its line, as the document readers do;
it never stops the read and never vanishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.data.documents.corpus import DataError, ReadStats
from liandan.data.documents.readers import LONE_SURROGATE, RecordReader, RejectHandler, file_format, record_id
from liandan.data.documents.storage import is_file
from liandan.run.remote import RemotePath, locate

ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    source: str
    conversation_id: str
    messages: list[dict[str, str]]  # {"role", "content"}, in order


def read_conversations(
    path: str | Path | RemotePath,
    source: str | None = None,
    stats: ReadStats | None = None,
    on_reject: RejectHandler | None = None,
) -> Iterator[Conversation]:
    """The conversations of one .jsonl file, streamed; malformed records are counted and handed to
    `on_reject` (see the module's docstring)."""
    path = locate(path)
    if not is_file(path):
        raise DataError(f"chat data file not found: {path}")
    kind, compression = file_format(path)
    if kind != "jsonl":
        raise DataError(f"chat data must be .jsonl (optionally .gz or .zst), not {path.name}")
    reader = RecordReader(path, source if source is not None else str(path), "messages", stats, on_reject)
    return _conversations(reader, compression)


def _conversations(reader: RecordReader, compression: str | None) -> Iterator[Conversation]:
    for number, raw, record in reader.json_objects(compression):
        messages, problem = conversation_messages(record)
        if problem is not None:
            reason, detail = problem
            reader.reject(number, reason, raw, **detail)
            continue
        reader.stats.documents += 1
        reader.stats.characters += sum(len(m["content"]) for m in messages)
        yield Conversation(reader.source, record_id(record.get("id"), reader.stem, number), messages)


def conversation_messages(record: dict[str, Any]) -> tuple[list[dict[str, str]], tuple[str, dict] | None]:
    """(the messages of a chat record, None), or ([], (reason, detail)) for a malformed one. The reason is
    stable, so rejects count by it; the detail says where (the message's index)."""
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            return [], ("'messages' is not a non-empty list", {})
    elif "prompt" in record or "response" in record:
        prompt, response = record.get("prompt"), record.get("response")
        if not isinstance(prompt, str) or not isinstance(response, str):
            return [], ("'prompt' or 'response' is not a string", {})
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    else:
        return [], ("neither 'messages' nor 'prompt'/'response'", {})
    found = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return [], ("message is not an object", {"message": index})
        role, content = message.get("role"), message.get("content")
        if role is None:
            return [], ("message without a role", {"message": index})
        if role not in ROLES:
            return [], ("unknown role", {"message": index, "role": str(role)[:40]})
        if not isinstance(content, str):
            return [], ("content is not a string", {"message": index})
        if LONE_SURROGATE.search(content):
            return [], ("invalid Unicode (lone surrogate)", {"message": index})
        found.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in found):
        return [], ("no assistant turn", {})
    if not any(m["content"].strip() for m in found if m["role"] == "assistant"):
        return [], ("empty assistant turns", {})
    return found, None
