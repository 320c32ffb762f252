"""Tokenizers behind one small interface: raw bytes, or byte-level BPE from Hugging Face `tokenizers`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import xxhash

from liandan.common.tokens import EOS, eos_id
from liandan.data.documents.corpus import DataError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, path: Path) -> None: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as end-of-document. Needs no training; fine for smoke tests."""

    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        Path(path).write_text('{"liandan": "byte-tokenizer", "version": 1}\n')

    def fingerprint(self) -> str:
        return "byte-v1"


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (a tokenizer.json), with `<|endoftext|>` as end-of-document."""

    def __init__(self, tok):
        self._tok = tok
        try:
            self.eos_id = eos_id(tok.token_to_id)
        except ValueError as err:
            raise DataError(str(err)) from None
        self.vocab_size = tok.get_vocab_size()

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path}")
        try:
            return cls(_Tok.from_file(str(path)))
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception for malformed files
            raise DataError(f"cannot read tokenizer {path}: {err}") from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets, which nothing here needs
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of `text` and each token's [start, end) characters in it."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def vocabulary(self) -> dict[str, int]:
        """Every token, added ones included, with its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def with_special_tokens(self, tokens: Sequence[str]) -> HFTokenizer:
        """A copy with `tokens` added as special tokens (never split, appended to the vocabulary)."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _Tok

        copy = _Tok.from_str(self._tok.to_str())
        copy.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
        return HFTokenizer(copy)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def save(self, path: Path) -> None:
        self._tok.save(str(path))

    def fingerprint(self) -> str:
        return xxhash.xxh64_hexdigest(self._tok.to_str().encode("utf-8"))


def moved_tokens(base: dict[str, int], extended: dict[str, int]) -> list[tuple[int, str, int | None]]:
    """The tokens of `base` that `extended` gives another id or lacks, as (id in base, token, id in extended or
    None), by id: none when `extended` keeps every token of `base` where it was, whatever it appends after."""
    return sorted((i, token, extended.get(token)) for token, i in base.items() if extended.get(token) != i)


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = (),
              piece_chars: int = 1 << 20) -> HFTokenizer:  # fmt: skip
    """Byte-level BPE (GPT-2 style pre-tokenisation, no unknown tokens), trained on `texts`. Deterministic for
    the same texts in the same order. `<|endoftext|>` is id 0; `special_tokens` follow it, never split. Texts
    longer than `piece_chars` reach the trainer in pieces (see `_in_pieces`), which changes nothing it learns."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, *(t for t in special_tokens if t != EOS)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_in_pieces(texts, piece_chars), trainer=trainer)
    return HFTokenizer(tok)


def _in_pieces(texts: Iterable[str], limit: int) -> Iterator[str]:
    """`texts`, with any text over `limit` characters cut into pieces at places where the byte-level
    pre-tokeniser splits anyway, so BPE learns exactly what it would from the whole text: the trainer holds a
    text's pre-tokens with their offsets all at once (a 50 MB line took 8.8 GB)."""
    for text in texts:
        start = 0
        while len(text) - start > limit:
            cut = _boundary(text, start + limit // 2, start + limit)
            if cut is None:
                break  # no safe place: keep the rest whole
            yield text[start:cut]
            start = cut
        yield text[start:] if start else text


def _boundary(text: str, low: int, high: int) -> int | None:
    """The last index in (low, high] at which a pre-token starts whatever came before: a space after a
    non-space and before a non-space (" word" keeps its space), or punctuation right after a letter (text with
    no spaces, as Chinese is)."""
    for i in range(high, low, -1):
        before, here = text[i - 1], text[i]
        if here == " " and not before.isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            return i
        if before.isalpha() and not (here.isalpha() or here.isnumeric() or here.isspace()):
            return i
    return None


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`byte`, or a path to a tokenizer.json."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer.load(spec)


def make_tokenizer(spec: str, texts: Iterable[str], bpe_vocab_size: int) -> Tokenizer:
    """`byte`, `bpe` (trained on `texts`), or a path to a tokenizer.json."""
    return train_bpe(texts, bpe_vocab_size) if spec == "bpe" else load_tokenizer(spec)
