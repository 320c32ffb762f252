"""The tokenizer of a Hugging Face model directory, as the `tokenizer.json` liandan's data pipeline reads.

Llama 3, Qwen2/2.5 and Qwen3 ship a `tokenizer.json`, used as it is. Llama 1/2 and Mistral may ship only a
SentencePiece `tokenizer.model`; it is converted offline by transformers' Llama tokenizer, which rebuilds the
same byte-fallback BPE as a `tokenizers.Tokenizer`. The conversion needs the `sentencepiece` package (and
protobuf), and is checked: a fixed sample must encode to the same ids through SentencePiece itself and through
the converted tokenizer, else the import is refused rather than training on differently split text.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

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
