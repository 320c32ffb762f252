"""Reading preference pairs for direct preference optimisation from .jsonl files (optionally .gz or .zst).

A record is a prompt with two replies to it, the preferred and the other:

    {"prompt": "...", "chosen": "...", "rejected": "..."}
    {"prompt": [{"role": "system", ...}, {"role": "user", ...}], "chosen": [{"role": "assistant", ...}], ...}

The prompt is a string (one user turn) or a conversation (its messages as a chat record's); each reply is a
string or a list holding one assistant message, as TRL's conversational preference datasets write it. The
chat reader's checks apply to the prompt with each reply appended as the assistant's last turn, and a record
that breaks any of them, or whose two replies are the same, is counted in `ReadStats.skipped` under its
reason and handed to `on_reject` with its line; it never stops the read and never vanishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.data.documents.chat import conversation_messages
from liandan.data.documents.corpus import DataError, ReadStats
from liandan.data.documents.readers import RecordReader, RejectHandler, file_format, record_id
from liandan.data.documents.storage import is_file
from liandan.run.remote import RemotePath, locate


@dataclass
class PreferencePair:
    source: str
    pair_id: str
    chosen: list[dict[str, str]]  # the prompt's messages, then the chosen reply as the assistant's last turn
    rejected: list[dict[str, str]]  # the same prompt, then the rejected reply


def read_preferences(
    path: str | Path | RemotePath,
    source: str | None = None,
    stats: ReadStats | None = None,
    on_reject: RejectHandler | None = None,
) -> Iterator[PreferencePair]:
    """The preference pairs of one .jsonl file, streamed; malformed records are counted and handed to
    `on_reject` (see the module's docstring). `stats.documents` counts pairs."""
    path = locate(path)
    if not is_file(path):
        raise DataError(f"preference data file not found: {path}")
    kind, compression = file_format(path)
    if kind != "jsonl":
        raise DataError(f"preference data must be .jsonl (optionally .gz or .zst), not {path.name}")
    reader = RecordReader(path, source if source is not None else str(path), "prompt", stats, on_reject)
    return _pairs(reader, compression)


def _pairs(reader: RecordReader, compression: str | None) -> Iterator[PreferencePair]:
    for number, raw, record in reader.json_objects(compression):
        pair, problem = preference_pair(record)
        if problem is not None:
            reason, detail = problem
            reader.reject(number, reason, raw, **detail)
            continue
        chosen, rejected = pair
        reader.stats.documents += 1
        reader.stats.characters += sum(len(m["content"]) for m in chosen) + len(rejected[-1]["content"])
        yield PreferencePair(reader.source, record_id(record.get("id"), reader.stem, number), chosen, rejected)


def preference_pair(record: dict[str, Any]) -> tuple[tuple[list, list], tuple[str, dict] | None]:
    """((chosen conversation, rejected conversation), None), or ((), (reason, detail)) for a malformed record.
    Reasons are stable, so rejects count by them."""
    if not all(key in record for key in ("prompt", "chosen", "rejected")):
        return (), ("not all of 'prompt', 'chosen', 'rejected'", {})
    prompt = record["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list) or not prompt:
        return (), ("'prompt' is neither a string nor a non-empty list of messages", {})
    replies = []
    for key in ("chosen", "rejected"):
        reply = _reply(record[key])
        if reply is None:
            return (), (f"'{key}' is neither a string nor one assistant message", {})
        if isinstance(reply, str) and not reply.strip():
            return (), ("empty reply", {})
        messages, problem = conversation_messages({"messages": [*prompt, {"role": "assistant", "content": reply}]})
        if problem is not None:
            return (), problem
        replies.append(messages)
    if replies[0][-1]["content"] == replies[1][-1]["content"]:
        return (), ("'chosen' equals 'rejected'", {})
    return (replies[0], replies[1]), None


def _reply(value: Any) -> Any:
    """A reply's text: the string itself, or the content of a list holding one assistant message (None
    otherwise; the content's own type is checked with the conversation's)."""
    if isinstance(value, str):
        return value
    one = isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)
    if one and value[0].get("role") == "assistant":
        return value[0].get("content")
    return None
