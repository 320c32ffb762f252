"""Weights that start a run (`checkpoint.init_from`) must read the run's token ids as they were trained to.

A model trained with one tokenizer and fed the ids of another trains without complaint when the vocabulary
sizes agree (the embedding rows are merely the wrong ones), and its loss looks like a slow start rather than a
bug. So the tokenizer the weights were trained with is found beside them (an import's or an export's
`tokenizer.json`, a Hugging Face directory's, or the prepared data of the run a checkpoint belongs to), and
the run's tokenizer must give each of its tokens the same id. Tokens appended after them are allowed: ChatML's
markers for fine-tuning, `liandan tokenizer extend`; their rows are the new ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from liandan.config import ConfigError
from liandan.data import HFTokenizer
from liandan.data.documents.corpus import DataError
from liandan.data.tokens.tokenizer import ByteTokenizer, moved_tokens
from liandan.run import RunDir


def tokenizer_beside(source: Path) -> Path | None:
    """The tokenizer.json the weights at `source` were trained with, where one is kept beside them."""
    folder = source if source.is_dir() else source.parent
    candidates = [folder / "tokenizer.json"]
    if source.is_dir():  # a checkpoint in its run's checkpoint directory: the run's prepared data
        candidates.append(RunDir(source.parent.parent).data / "tokenizer.json")
    return next((path for path in candidates if path.is_file()), None)


def check_init_tokenizer(source: Path, meta: dict[str, Any] | None, data: Any, say: Callable[[str], None]) -> None:
    """Refuse, in one line, `init_from` weights whose tokens the run's tokenizer (`data.tokenizer`) gives other
    ids. `meta`: a liandan checkpoint's, whose tokenizer fingerprint settles it when it matches the run's."""
    ours = getattr(data, "tokenizer", None)
    if ours is None:  # a loader handed in from Python, with no tokenizer to compare
        return
    stores = getattr(data, "stores", None) or []
    trained_with = (meta or {}).get("tokenizer")
    if trained_with is not None and stores and trained_with == stores[0].fingerprint:
        return
    where = f"checkpoint.init_from = {source}"
    path = tokenizer_beside(source)
    try:
        found = HFTokenizer.load(path) if path is not None else None
    except DataError as err:
        raise ConfigError(f"{where}: {err}") from None
    if found is not None and trained_with is not None and found.fingerprint() != trained_with:
        found = None  # not the tokenizer the checkpoint names: nothing to compare with
    if found is None:
        if trained_with is not None and stores:
            say(f"warning: {where} was trained with another tokenizer than this run's data, and its tokenizer is"
                " not beside it to compare: this run's must give the tokens it knows the same ids")  # fmt: skip
        return
    theirs = found.vocabulary()
    if isinstance(ours, ByteTokenizer):
        raise ConfigError(f"{where} was trained with the tokenizer {path}, not this run's byte tokenizer: train with"
                          f" --data.tokenizer={path}")  # fmt: skip
    if not hasattr(ours, "vocabulary"):  # a tokenizer of the caller's own: nothing to compare with
        return
    moved = moved_tokens(theirs, ours.vocabulary())
    if moved:
        i, token, here = moved[0]
        now = "lacks it" if here is None else f"gives it id {here}"
        raise ConfigError(
            f"{where} was trained with the tokenizer {path}, and this run's gives {len(moved)} of its"
            f" {len(theirs)} tokens other ids (token {token!r} is id {i} there; this run's {now}): train with"
            f" --data.tokenizer={path}, or a tokenizer that only appends tokens to it"
        )
