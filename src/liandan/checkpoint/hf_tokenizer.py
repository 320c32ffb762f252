"""The tokenizer of a Hugging Face model directory, as the `tokenizer.json` liandan's data pipeline reads.

Llama 3, Qwen2/2.5 and Qwen3 ship a `tokenizer.json`, used as it is. Llama 1/2 and Mistral may ship only a
SentencePiece `tokenizer.model`; it is converted offline by transformers' Llama tokenizer, which rebuilds the
same byte-fallback BPE as a `tokenizers.Tokenizer`. The conversion needs the `sentencepiece` package (and
protobuf), and is checked: a fixed sample must encode to the same ids through SentencePiece itself and through
the converted tokenizer, else the import is refused rather than training on differently split text.

On export, the tokenizer.json a model was trained with is written beside it with the files transformers reads
(`write_tokenizer`), and for a model fine-tuned on chats its chat template and the tokens that end a turn
(`HFChat`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.common import tokens
from liandan.run import atomic_write

# Leading and repeated whitespace, digits, punctuation, accents, CJK and emoji (byte fallback): where
# SentencePiece conversions tend to differ.
_CHECK_SAMPLE = (
    "  The quick brown fox jumps over the lazy dog.\n  Indented line\twith a tab, 1234567 and 3.14159!\n"
    "Ünïcödé façade, naïve café; 你好世界 and emoji 🙂 at the end  "
)


def source_tokenizer(model_dir: Path) -> Any | None:
    """The `tokenizers.Tokenizer` of `model_dir`: its tokenizer.json, else its converted tokenizer.model, else
    None. A ValueError (one line) when a tokenizer.model cannot be converted or converts unfaithfully."""
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception for malformed files
            raise ValueError(f"cannot read {model_dir / 'tokenizer.json'}: {err}") from None
    if (model_dir / "tokenizer.model").is_file():
        return _convert_sentencepiece(model_dir / "tokenizer.model")
    return None


def _convert_sentencepiece(path: Path) -> Any:
    try:
        import google.protobuf  # noqa: F401 - transformers' converter reads the model's protobuf with it
        import sentencepiece
        import transformers
    except ImportError as err:
        package = "protobuf" if (err.name or "").startswith("google") else err.name
        raise ValueError(
            f"{path} is a SentencePiece model; converting it needs the {package} package "
            "(pip install 'liandan[hf]'), or put a tokenizer.json beside it"
        ) from None
    try:
        reference = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as err:  # noqa: BLE001 - sentencepiece raises plain RuntimeError/OSError for bad files
        raise ValueError(f"cannot read SentencePiece model {path}: {err}") from None
    # transformers 5's LlamaTokenizer is itself the converted, tokenizers-backed one; 4's fast class converts.
    # Loaded from a directory holding the model alone, so no other file there changes the conversion.
    llama_tokenizer = getattr(transformers, "LlamaTokenizerFast", None) or transformers.LlamaTokenizer
    with tempfile.TemporaryDirectory() as alone:
        shutil.copyfile(path, Path(alone) / "tokenizer.model")
        try:
            converted = llama_tokenizer.from_pretrained(alone).backend_tokenizer
        except Exception as err:  # noqa: BLE001 - the converters raise assorted errors for models they do not fit
            raise ValueError(f"cannot convert SentencePiece model {path} to a tokenizer.json: {err}") from None
    _split_as_sentencepiece(converted, reference)
    expected = reference.encode(_CHECK_SAMPLE)
    got = converted.encode(_CHECK_SAMPLE, add_special_tokens=False).ids
    if got != expected:
        raise ValueError(
            f"{path}: the converted tokenizer splits text differently from SentencePiece itself (not a "
            "Llama-style byte-fallback model?); provide a tokenizer.json"
        )
    return converted


def _split_as_sentencepiece(converted: Any, reference: Any) -> None:
    """SentencePiece marks spaces with U+2581 and prefixes every text with one (a "dummy prefix", when the model
    was trained with it), even a text that starts with a space. transformers 5's conversion pre-tokenises with a
    Metaspace that skips the prefix before a leading space; replacing it with the plain substitution (and the
    decoder that undoes it) gives SentencePiece's ids for every text."""
    from tokenizers import decoders, normalizers

    marker = "\u2581"
    prefixed = reference.id_to_piece(reference.encode("x")[0]).startswith(marker)
    prefix = [normalizers.Prepend(marker)] if prefixed else []
    converted.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", marker)])
    converted.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] if prefixed else []
    converted.decoder = decoders.Sequence(
        [decoders.Replace(marker, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )


# ----------------------------------------------------------------------------------------------------------
# export


@dataclass(frozen=True)
class HFChat:
    """How a fine-tuned model's conversations are written, for its export: the Jinja `chat_template` that
    renders them as its training data was rendered, the tokens that end a turn (generation stops at each, as
    at the end-of-document token), the special tokens to register beside the tokenizer (ChatML's markers),
    and, for a model's own template, that model's tokenizer_config.json (its special tokens, which the
    template may write), kept as it is."""

    template: str
    turn_end: tuple[str, ...]
    special_tokens: tuple[str, ...] = ()
    tokenizer_config: dict | None = None


def turn_end_ids(tokenizer_json: Path, chat: HFChat, eos_id: int) -> list[int]:
    """The ids generation stops at: each turn end's, then the end-of-document token's. A turn end or marker
    the tokenizer does not hold as one token is refused: the template would write text the model never saw
    as one token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    ids = []
    for token in (*chat.turn_end, *chat.special_tokens):
        if tok.token_to_id(token) is None:
            raise ValueError(f"the chat template's token {token!r} is not a token of {tokenizer_json}")
    for token in chat.turn_end:
        if tok.token_to_id(token) not in ids:
            ids.append(tok.token_to_id(token))
    return ids + [eos_id] if eos_id not in ids else ids


def tokenizer_eos(path: Path) -> tuple[str, int, int]:
    """(end-of-document token, its id, vocabulary size) of a tokenizer.json, found by the same rule the
    trainer uses (`liandan.common.tokens.eos_id`)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception for malformed files
        raise ValueError(f"cannot read tokenizer {path}: {err}") from None
    try:
        eos = tokens.eos_id(tok.token_to_id)
    except ValueError as err:
        raise ValueError(f"tokenizer {path}: {err}") from None
    return tok.id_to_token(eos), eos, tok.get_vocab_size()


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "additional_special_tokens")


def write_tokenizer(tokenizer_json: Path, out_dir: Path, eos_token: str, max_len: int, chat: HFChat | None) -> None:
    """tokenizer.json copied into `out_dir`, with the tokenizer_config.json and special_tokens_map.json that
    make transformers load it as it was trained: its end-of-document token as bos and eos, no special
    tokens added on encoding; with `chat`, its template and turn ends as `export_hf` describes."""
    target = out_dir / "tokenizer.json"
    if tokenizer_json.resolve() != target.resolve():
        shutil.copyfile(tokenizer_json, target)
    if chat is not None and chat.tokenizer_config is not None:  # a model's own: as transformers rendered it
        config = {**chat.tokenizer_config, "model_max_length": max_len}
        config.setdefault("chat_template", chat.template)  # kept as written there (a list of named ones, say)
    else:
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": eos_token,
            "eos_token": eos_token,
            "model_max_length": max_len,
            # The tokenizer.json adds no special tokens and decodes byte-exactly; keep both that way.
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if chat is not None:  # as Qwen2's chat models: a turn ends generation, documents stay separated
            config.update(eos_token=chat.turn_end[0], pad_token=eos_token, chat_template=chat.template)
            config["additional_special_tokens"] = list(chat.special_tokens)
    atomic_write(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    special = {k: config[k] for k in _SPECIAL_KEYS if config.get(k)}
    atomic_write(out_dir / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
