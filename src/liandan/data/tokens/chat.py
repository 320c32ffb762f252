"""Conversations to token ids and a loss mask: which tokens are the assistant's, the ones supervised
fine-tuning learns.

Two templates render a conversation to text:

- `ChatMLTemplate`, built in: every turn is `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`. Its two markers are
  special tokens, added to a tokenizer that lacks them (`with_chat_tokens`).
- `ModelTemplate`: the `chat_template` of a Hugging Face tokenizer directory (its tokenizer_config.json),
  rendered by transformers' `apply_chat_template` as transformers renders it.

Either gives the text and the character spans of the assistant turns. The built-in template knows its spans;
for a model's template they are found as TRL finds a completion: the conversation up to an assistant turn is
rendered with the generation prompt, then with the turn, and the turn is what the second adds to the first
(less trailing whitespace after the turn's end token, which the model never generates). This works for every
template, where `return_assistant_tokens_mask` needs one written with `{% generation %}` blocks, which few
models ship; a template whose rendering of a longer conversation does not start with that of a shorter one
(one that rewrites earlier turns) is refused per conversation, counted like any malformed record.

The whole text is then tokenized once, as the model will see it at inference, and a token is a target to
learn when its first character lies inside an assistant span: the assistant's content and the end token
that closes its turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from liandan.data.documents.corpus import DataError
from liandan.data.tokens.tokenizer import HFTokenizer, Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML_TOKENS = (IM_START, IM_END)
TEMPLATES = ("chatml", "tokenizer")  # what `[data] chat_template` takes

# The built-in ChatML as a Jinja chat template (tokenizer_config.json's `chat_template`), for models exported
# to transformers: it renders as `ChatMLTemplate` does, with `add_generation_prompt` as `ChatMLTemplate.prompt`,
# and marks with {% generation %} what an assistant turn learns (its content and <|im_end|>), so transformers'
# return_assistant_tokens_mask and TRL's assistant_only_loss pick the tokens liandan's loss mask holds. The
# newlines are expressions: transformers renders with trim_blocks, which drops one after a block tag.
CHATML_JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class Rendered:
    text: str
    assistant_spans: list[tuple[int, int]]  # [start, end) characters of each assistant turn's trained part


class ChatTemplate(Protocol):
    name: str  # recorded in the store's manifest

    def render(self, messages: list[dict[str, str]]) -> Rendered: ...

    def generation_prompt(self, messages: list[dict[str, str]]) -> str:
        """The conversation so far, then what opens the assistant's next turn: the text a model continues
        with its reply, a prefix of the conversation rendered with that reply."""
        ...

    def turn_end(self) -> str:
        """What closes an assistant turn after its content (less trailing whitespace): where generation of a
        reply stops ("" when the template writes nothing there)."""
        ...


class TemplateError(ValueError):
    """A conversation the template cannot render (a model's template refusing its roles' order, say)."""


class ChatMLTemplate:
    name = "chatml"

    def render(self, messages: list[dict[str, str]]) -> Rendered:
        text, spans = "", []
        for message in messages:
            text += f"{IM_START}{message['role']}\n"
            start = len(text)
            text += message["content"] + IM_END
            if message["role"] == "assistant":
                spans.append((start, len(text)))
            text += "\n"
        return Rendered(text, spans)

    def generation_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.render(messages).text + f"{IM_START}assistant\n"

    def turn_end(self) -> str:
        return IM_END


class ModelTemplate:
    """The chat template of a Hugging Face tokenizer directory, rendered by transformers."""

    def __init__(self, tokenizer_dir: Path):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                "rendering a model's chat template needs transformers (pip install 'liandan[hf]')"
            ) from None
        self.directory = Path(tokenizer_dir)
        if not (self.directory / "tokenizer.json").is_file():
            raise DataError(f"no tokenizer.json in {tokenizer_dir} to render its chat template with")
        try:  # local files only: a missing file must not become a download attempt
            self._hf = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except (OSError, ValueError) as err:
            raise DataError(f"cannot load the tokenizer of {tokenizer_dir}: {err}") from None
        template = getattr(self._hf, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise DataError(f"{tokenizer_dir} has no chat_template in its tokenizer_config.json; use"
                            " data.chat_template = \"chatml\"")  # fmt: skip
        self.name = "tokenizer:" + xxhash.xxh64_hexdigest(template.encode("utf-8"))
        self.directory = Path(tokenizer_dir)

    def _apply(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # noqa: BLE001 - jinja's raise_exception and template bugs raise anything
            first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise TemplateError(f"chat template error: {first_line}") from None

    def render(self, messages: list[dict[str, str]]) -> Rendered:
        text = self._apply(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._apply(messages[:i], True)
            turn = self._apply(messages[: i + 1], False)
            if not (turn.startswith(prompt) and text.startswith(turn)):
                raise TemplateError("chat template is not prefix-stable")
            spans.append((len(prompt), len(turn.rstrip())))
        return Rendered(text, spans)

    def generation_prompt(self, messages: list[dict[str, str]]) -> str:
        return self._apply(messages, True)

    def turn_end(self) -> str:
        """Found as the spans are: a probe reply's turn less the generation prompt, after the reply."""
        probe = "liandan-probe-reply"
        asked = [{"role": "user", "content": "liandan-probe-question"}]
        prompt = self._apply(asked, True)
        turn = self._apply([*asked, {"role": "assistant", "content": probe}], False).rstrip()
        if not turn.startswith(prompt) or probe not in turn[len(prompt) :]:
            raise TemplateError("chat template is not prefix-stable")
        return turn[turn.rindex(probe) + len(probe) :]

    def tokenizer_config(self) -> dict:
        """The model's tokenizer_config.json with its template in it (transformers also reads one from
        chat_template.jinja) and its special tokens (also read from special_tokens_map.json): what renders
        this template again from a directory with only the tokenizer.json beside it."""
        directory = self.directory
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        special = directory / "special_tokens_map.json"
        if special.is_file():
            for key, value in json.loads(special.read_text(encoding="utf-8")).items():
                config.setdefault(key, value)
        config.setdefault("chat_template", self.template)
        return config

    @property
    def template(self) -> str:
        """The Jinja text of the template."""
        return self._hf.chat_template

    @property
    def eos_token(self) -> str | None:
        """The tokenizer's end-of-sequence token, the one a model's template ends an assistant turn with."""
        return self._hf.eos_token


def chat_template(name: str, tokenizer_file: str) -> ChatTemplate:
    """`[data] chat_template`: "chatml", or "tokenizer" (the template beside `tokenizer_file`)."""
    if name == "chatml":
        return ChatMLTemplate()
    if name == "tokenizer":
        if tokenizer_file in ("byte", "bpe"):
            raise DataError('data.chat_template = "tokenizer" needs data.tokenizer to be a model\'s tokenizer.json')
        return ModelTemplate(Path(tokenizer_file).parent)
    raise DataError(f"data.chat_template must be one of {', '.join(TEMPLATES)}, got {name!r}")


def with_chat_tokens(tokenizer: Tokenizer) -> HFTokenizer:
    """`tokenizer` with ChatML's markers as special tokens (a copy, appended to its vocabulary, when it lacks
    them). liandan's byte tokenizer has no room for them: it is refused."""
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError('chat data needs a tokenizer with special tokens: use data.tokenizer = "bpe" or a'
                        " tokenizer.json, not the byte tokenizer")  # fmt: skip
    missing = [t for t in CHATML_TOKENS if tokenizer.token_id(t) is None]
    return tokenizer.with_special_tokens(missing) if missing else tokenizer


def encode_conversation(tokenizer: HFTokenizer, rendered: Rendered) -> tuple[list[int], np.ndarray]:
    """(token ids of the rendered text, loss mask: 1 for each token whose first character lies in an assistant
    span, else 0)."""
    ids, offsets = tokenizer.encode_with_offsets(rendered.text)
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(ids), dtype=np.uint8)
    for first, end in rendered.assistant_spans:
        mask[(starts >= first) & (starts < end)] = 1
    return ids, mask


def template_tokenizer_config(template: ChatTemplate) -> dict | None:
    """What a store rendered by `template` keeps beside its tokenizer: a model's tokenizer_config.json (None
    for the built-in template, which liandan writes again itself)."""
    return template.tokenizer_config() if isinstance(template, ModelTemplate) else None


def describe_mask(template: ChatTemplate) -> dict:
    """What a store's loss-mask channel means, for its manifest."""
    return {
        "dtype": "uint8",
        "suffix": ".mask.npy",
        "template": template.name,
        "means": "1 where the token is an assistant turn's content or end token (a target to learn), else 0",
    }
