"""The end-of-document convention of liandan's tokenizers: the data pipeline's tokenizers and the Hugging Face
export find a tokenizer's end-of-document token by the same rule."""

from __future__ import annotations

from collections.abc import Callable

EOS = "<|endoftext|>"
# End-of-document tokens of tokenizers trained elsewhere (GPT-2, Llama 3, Llama 2, Gemma), tried in order.
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "</s>", "<eos>")


def eos_id(token_to_id: Callable[[str], int | None]) -> int:
    """The id of the first of EOS_CANDIDATES that a vocabulary (its `token_to_id`) holds; ValueError if none."""
    for token in EOS_CANDIDATES:
        found = token_to_id(token)
        if found is not None:
            return found
    raise ValueError(f"tokenizer has no end-of-document token (one of {', '.join(EOS_CANDIDATES)})")
