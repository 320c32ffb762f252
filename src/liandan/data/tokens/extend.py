"""Extending a BPE tokenizer with tokens learned on new text (Chinese on an English base, say) without changing
the id of any token it has.

A BPE of the same kind (the tokenizer's own normalizer and pre-tokenizer, its byte alphabet) is trained on the
new text alone; its merges are taken in the order it learned them (most frequent first), those whose result
the tokenizer lacks and whose two parts it has (or has just been given) are appended to its merges, and the
result gets the next free id, after every token and added token. Appended merges rank below every existing
one, so text the old merges already cover (English, for an English base) is cut as before, which the tests
check; text they left in bytes is now merged.

Each new token comes with the ids the old tokenizer cut its text into: a model's embedding and output rows for
the new token start as the mean of those rows (`liandan.model.vocab.grow_vocabulary`), so that a warm-started
model begins from what it knew of those bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from liandan.data.documents.corpus import DataError


@dataclass
class Extension:
    tokenizer_json: str  # the extended tokenizer, as tokenizer.json text
    sources: dict[int, list[int]]  # each new id -> the old ids of its text
    old_size: int  # ids below this are the old tokenizer's (tokens and added tokens)


def extend_tokenizer(tokenizer_json: str, texts: Iterable[str], add: int) -> Extension:
    """Up to `add` new tokens learned from `texts` appended to the BPE tokenizer `tokenizer_json`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if add < 1:
        raise DataError(f"the number of tokens to add must be at least 1, not {add}")
    spec = json.loads(tokenizer_json)
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise DataError(f"only a BPE tokenizer can be extended; this one is {model.get('type', 'of no known kind')}")
    old = Tokenizer.from_str(tokenizer_json)
    learner = Tokenizer.from_str(tokenizer_json)
    learner.model = models.BPE()
    byte_level = _is_byte_level(spec)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 2 * add, initial_alphabet=alphabet, show_progress=False)
    learner.train_from_iterator(texts, trainer)
    learned = json.loads(learner.to_str())["model"]["merges"]
    if not learned:
        raise DataError("no merge could be learned from the new text (is it empty?)")
    vocab, merges = model["vocab"], model["merges"]
    taken = set(vocab.values()) | {t["id"] for t in spec.get("added_tokens", [])}
    next_id = max(taken) + 1
    old_size = next_id
    as_text = bool(merges) and isinstance(merges[0], str)
    sources: dict[int, list[int]] = {}
    for pair in learned:
        a, b = pair.split(" ", 1) if isinstance(pair, str) else pair
        merged = a + b
        if merged in vocab or a not in vocab or b not in vocab:
            continue
        vocab[merged] = next_id
        merges.append(f"{a} {b}" if as_text else [a, b])
        # the old model's cut of the same piece (byte-level characters, before any decoding: a new token may
        # hold part of a character's bytes)
        sources[next_id] = [t.id for t in old.model.tokenize(merged)] or [vocab[a]]
        next_id += 1
        if len(sources) == add:
            break
    return Extension(json.dumps(spec, ensure_ascii=False), sources, old_size)


def _is_byte_level(spec: dict) -> bool:
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(p.get("type") == "ByteLevel" for p in parts)
