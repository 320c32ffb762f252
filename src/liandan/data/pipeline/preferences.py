"""From `[data] paths` of preference records to the token store a DPO run trains on.

Every pair becomes two documents in a row, the prompt with its chosen reply and then the prompt with its
rejected one, rendered by `[data] chat_template` and tokenized as chat data is (`pipeline/chat.py`); the loss
mask holds the reply alone (the last assistant turn's content and end token), the tokens whose
log-probabilities DPO sums. The manifest's loss-mask entry says so (`"pairs": true`), which the pair loader
checks. Malformed records and pairs the template refuses are written to `rejects.jsonl` with their file, line
and reason, and counted by reason in the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from liandan.config import DataSection
from liandan.data.documents.corpus import DataError, Document, ReadStats
from liandan.data.documents.preferences import PreferencePair, read_preferences
from liandan.data.pipeline.chat import REJECTS, chat_files, chat_tokenizer
from liandan.data.tokens.chat import (
    ChatTemplate,
    Rendered,
    TemplateError,
    chat_template,
    describe_mask,
    encode_conversation,
    template_tokenizer_config,
)
from liandan.data.tokens.store import MANIFEST, shard_path, write_manifest, write_masked_shard
from liandan.run import atomic_file


def prepare_preference_store(cfg: DataSection, out_dir: Path, say: Callable[[str], None] = print) -> ReadStats:
    """Write the store of `[data] paths`'s preference pairs at `out_dir`; what was read (`documents` counts
    pairs), with the rejects by reason."""
    out_dir = Path(out_dir)
    files = chat_files(cfg, "dpo", "preference records (prompt, chosen, rejected)")
    template = chat_template(cfg.chat_template, cfg.tokenizer)

    def texts() -> Iterator[str]:
        for _, chosen, rejected in _rendered(files, template, ReadStats(), lambda r: None):
            yield chosen.text
            yield rejected.text

    tokenizer = chat_tokenizer(cfg, template, texts)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # the store is complete again only once it is all rewritten
    stats = ReadStats()
    with atomic_file(out_dir / REJECTS, "w", durable=False) as rejects:

        def reject(record: dict[str, Any]) -> None:
            rejects.write(json.dumps(record, ensure_ascii=False) + "\n")

        def encoded() -> Iterator[tuple[Document, list[int], Any]]:
            for pair, chosen, rejected in _rendered(files, template, stats, reject):
                for side, rendered in (("chosen", chosen), ("rejected", rejected)):
                    yield (Document(pair.source, f"{pair.pair_id}:{side}", ""),
                           *encode_conversation(tokenizer, rendered))  # fmt: skip

        shard = write_masked_shard(encoded(), tokenizer, shard_path(out_dir, 0))
    if not shard.documents:
        raise DataError(f"no preference pair of {len(files)} file(s) could be read ({stats.summary()});"
                        f" see {out_dir / REJECTS}")  # fmt: skip
    mask = {
        **describe_mask(template),
        "means": "1 where the token is the reply's content or end token (its log-probability is summed), else 0",
        "pairs": True,  # documents 2i and 2i + 1 are pair i's chosen and rejected conversations
        "read": {"pairs": stats.documents, "skipped": dict(stats.skipped)},
    }
    write_manifest(out_dir, [shard], tokenizer, loss_mask=mask, tokenizer_config=template_tokenizer_config(template))
    say(f"read {len(files)} preference file(s): {stats.summary().replace('documents', 'pairs')}")
    say(f"rendered with the {template.name} template, tokenized (vocabulary {tokenizer.vocab_size}):"
        f" {shard.tokens:,} tokens")  # fmt: skip
    return stats


def _rendered(
    files: list[Path | str], template: ChatTemplate, stats: ReadStats, on_reject: Callable[[dict[str, Any]], None]
) -> Iterator[tuple[PreferencePair, Rendered, Rendered]]:
    """Each pair that reads and renders, with its two renderings, the reply alone masked in; the others
    counted and rejected."""
    for path in files:
        for pair in read_preferences(path, source=str(path), stats=stats, on_reject=on_reject):
            try:
                chosen, rejected = (_reply_only(template.render(c)) for c in (pair.chosen, pair.rejected))
            except TemplateError as err:
                stats.documents -= 1
                stats.characters -= sum(len(m["content"]) for m in pair.chosen) + len(pair.rejected[-1]["content"])
                stats.skipped[str(err)] += 1
                on_reject({"file": str(path), "record": pair.pair_id, "reason": str(err),
                           "raw": json.dumps(pair.chosen, ensure_ascii=False)[:500]})  # fmt: skip
                continue
            yield pair, chosen, rejected


def _reply_only(rendered: Rendered) -> Rendered:
    """The rendering with its last assistant turn alone as the trained span: earlier assistant turns of a
    conversational prompt are context, not part of the reply being compared."""
    return Rendered(rendered.text, rendered.assistant_spans[-1:])
