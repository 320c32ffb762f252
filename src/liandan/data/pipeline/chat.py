"""From `[data] paths` of chat records to the token store a supervised fine-tuning run trains on.

The conversations of every file, in order, are rendered by `[data] chat_template`, tokenized by `[data]
tokenizer` (ChatML's markers added as special tokens when the template is the built-in one; a BPE trains on
the rendered conversations) and written as one store with a loss-mask channel (`write_masked_shard`). Every
malformed record, and every conversation the template refuses, is written to `rejects.jsonl` beside the store
with its file, line and reason, and counted by reason in the manifest's "read" entry, as the data pipeline
does for documents. The manifest is written last: a store without one is made again from the start.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from liandan.config import DataSection
from liandan.data.documents.chat import Conversation, read_conversations
from liandan.data.documents.corpus import DataError, Document, ReadStats
from liandan.data.pipeline.pipeline_config import InputSpec, expand_paths
from liandan.data.tokens.chat import (
    CHATML_TOKENS,
    ChatTemplate,
    TemplateError,
    chat_template,
    describe_mask,
    encode_conversation,
    template_tokenizer_config,
    with_chat_tokens,
)
from liandan.data.tokens.store import MANIFEST, shard_path, write_manifest, write_masked_shard
from liandan.data.tokens.tokenizer import HFTokenizer, load_tokenizer, train_bpe
from liandan.run import atomic_file

REJECTS = "rejects.jsonl"


def chat_files(cfg: DataSection, objective: str = "sft", records: str = "chat records") -> list[Path | str]:
    if not cfg.paths:
        raise DataError(f'train.objective = "{objective}" needs {records}: set data.paths to .jsonl files of them')
    return expand_paths(InputSpec(name="chat", paths=list(cfg.paths), provenance="file"))


def prepare_chat_store(cfg: DataSection, out_dir: Path, say: Callable[[str], None] = print) -> ReadStats:
    """Write the store of `[data] paths`'s conversations at `out_dir`; what was read, with the rejects by
    reason."""
    out_dir = Path(out_dir)
    files = chat_files(cfg)
    template = chat_template(cfg.chat_template, cfg.tokenizer)
    tokenizer = chat_tokenizer(
        cfg, template, lambda: (r.text for _, r in _rendered(files, template, ReadStats(), lambda r: None))
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # the store is complete again only once it is all rewritten
    stats = ReadStats()
    with atomic_file(out_dir / REJECTS, "w", durable=False) as rejects:

        def reject(record: dict[str, Any]) -> None:
            rejects.write(json.dumps(record, ensure_ascii=False) + "\n")

        encoded = (
            (Document(c.source, c.conversation_id, ""), *encode_conversation(tokenizer, rendered))
            for c, rendered in _rendered(files, template, stats, reject)
        )
        shard = write_masked_shard(encoded, tokenizer, shard_path(out_dir, 0))
    if not shard.documents:
        raise DataError(f"no conversation of {len(files)} file(s) could be read ({stats.summary()});"
                        f" see {out_dir / REJECTS}")  # fmt: skip
    mask = {**describe_mask(template), "read": {"conversations": stats.documents, "skipped": dict(stats.skipped)}}
    write_manifest(out_dir, [shard], tokenizer, loss_mask=mask, tokenizer_config=template_tokenizer_config(template))
    say(f"read {len(files)} chat file(s): {stats.summary().replace('documents', 'conversations')}")
    say(f"rendered with the {template.name} template, tokenized (vocabulary {tokenizer.vocab_size}):"
        f" {shard.tokens:,} tokens")  # fmt: skip
    return stats


def _rendered(
    files: list[Path | str], template: ChatTemplate, stats: ReadStats, on_reject: Callable[[dict[str, Any]], None]
) -> Iterator[tuple[Conversation, Any]]:
    """Each conversation that reads and renders, with its rendering; the others counted and rejected."""
    for path in files:
        for conversation in read_conversations(path, source=str(path), stats=stats, on_reject=on_reject):
            try:
                yield conversation, template.render(conversation.messages)
            except TemplateError as err:
                stats.documents -= 1
                stats.characters -= sum(len(m["content"]) for m in conversation.messages)
                stats.skipped[str(err)] += 1
                on_reject({"file": str(path), "record": conversation.conversation_id, "reason": str(err),
                           "raw": json.dumps(conversation.messages, ensure_ascii=False)[:500]})  # fmt: skip


def chat_tokenizer(cfg: DataSection, template: ChatTemplate, texts: Callable[[], Iterable[str]]) -> HFTokenizer:
    """`[data] tokenizer`, holding ChatML's markers when the template is the built-in one; a BPE is trained
    on `texts()`, the rendered conversations (malformed ones left out, and not counted: the read that writes
    counts)."""
    if cfg.tokenizer == "bpe":
        specials = CHATML_TOKENS if template.name == "chatml" else ()
        return train_bpe(texts(), cfg.bpe_vocab_size, special_tokens=specials)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if template.name == "chatml":
        return with_chat_tokens(tokenizer)
    if not isinstance(tokenizer, HFTokenizer):
        raise DataError("a model's chat template needs its tokenizer.json as data.tokenizer")
    return tokenizer
