"""Next-line cloze: multiple-choice items built from real text, at use (nothing copied into the repository).

Each item shows `context_lines` consecutive lines of one document and asks which of `choices` lines comes next:
the true next line, or lines drawn from elsewhere in the corpus whose length is close to it (so length alone
does not give the answer away). Lines are split at line breaks, and for Chinese also after 。！？； (with the
closing quotes that follow), and kept when their length is between `min_chars` and `max_chars` and they are
mostly letters without lacuna marks. The same settings and corpus give the same items.

    [generate]
    corpus = "{data_dir}/corpus/en-shakespeare.txt"   # .txt (one document) or .jsonl (`text_field` per line)
    text_field = "text"
    items = 200
    choices = 4
    context_lines = 2
    min_chars = 20
    max_chars = 120
    seed = 17

`python -m liandan.evaluate.cloze TASK.toml OUT.jsonl` writes the items of a task as jsonl (question, choices,
label), for a look or for another harness.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any

from liandan.config import ConfigError
from liandan.evaluate.tasks import Item, missing_data_hint, read_jsonl, resolve_data_path

_DEFAULTS: dict[str, Any] = {
    "text_field": "text", "items": 200, "choices": 4, "context_lines": 2, "min_chars": 20, "max_chars": 120,
    "seed": 17,
}  # fmt: skip
# a sentence runs to its end mark and any closing quotes after it, so no line starts with a stray ” or 」
_SENTENCE = re.compile(r"[^。！？；]*[。！？；]+[”’」』）]*|[^。！？；]+")


def cloze_items(task_file: Path, table: dict[str, Any], data_dir: str) -> tuple[list[Item], Path]:
    for key, value in table.items():
        if key != "corpus" and key not in _DEFAULTS:
            raise ConfigError(f"{task_file}: unknown field 'generate.{key}'; allowed: corpus, {', '.join(_DEFAULTS)}")
        wanted = str if key in ("corpus", "text_field") else int
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise ConfigError(f"{task_file}: field 'generate.{key}' must be a {wanted.__name__}, got {value!r}")
    if "corpus" not in table:
        raise ConfigError(f"{task_file}: missing field 'generate.corpus'")
    s = {**_DEFAULTS, **table}
    if s["choices"] < 2 or s["context_lines"] < 1 or s["items"] < 1:
        raise ConfigError(f"{task_file}: generate needs choices >= 2, context_lines >= 1 and items >= 1")
    corpus = resolve_data_path(task_file, s["corpus"], data_dir)
    if not corpus.is_file():
        raise ConfigError(
            f"{task_file}: field 'generate.corpus': file not found: {corpus}{missing_data_hint(s['corpus'])}"
        )
    documents = _documents(corpus, s["text_field"], task_file)
    lines_of = [[ln for ln in _lines(doc) if s["min_chars"] <= len(ln) <= s["max_chars"] and _textual(ln)]
                for doc in documents]  # fmt: skip
    return next_line_items(lines_of, s["items"], s["choices"], s["context_lines"], s["seed"]), corpus


def next_line_items(docs: list[list[str]], n_items: int, n_choices: int, context: int, seed: int) -> list[Item]:
    """Items whose context is `context` consecutive lines of a document and whose answer is the line after."""
    rng = random.Random(seed)
    positions = [(d, i) for d, lines in enumerate(docs) for i in range(context, len(lines))]
    pool = sorted({line for lines in docs for line in lines}, key=lambda line: (len(line), line))  # no set order
    if len(pool) < n_choices * 2 or not positions:
        raise ConfigError(f"too few usable lines ({len(pool)}) for next-line cloze items of {n_choices} choices")
    lengths = [len(line) for line in pool]
    items = []
    for d, i in rng.sample(positions, min(n_items, len(positions))):
        lines, answer = docs[d], docs[d][i]
        near = _nearest(lengths, len(answer), n_choices * 4)
        distractors = [pool[j] for j in rng.sample(near, len(near)) if pool[j] not in lines[i - context : i + 1]]
        choices = [answer, *distractors[: n_choices - 1]]
        rng.shuffle(choices)
        items.append(Item("\n".join(lines[i - context : i]), answer, choices, choices.index(answer)))
    return items


def _nearest(sorted_lengths: list[int], length: int, count: int) -> list[int]:
    import bisect

    at = bisect.bisect_left(sorted_lengths, length)
    lo, hi = max(0, at - count // 2), min(len(sorted_lengths), at + count // 2)
    return list(range(lo, hi))


def _documents(corpus: Path, text_field: str, task_file: Path) -> list[str]:
    if corpus.suffix == ".txt":
        try:
            return [corpus.read_text(encoding="utf-8")]
        except UnicodeDecodeError as err:
            raise ConfigError(f"{corpus} (task {task_file}): not valid UTF-8 (byte {err.start})") from None
    docs = [r.get(text_field) for _, r in read_jsonl(corpus, task_file)]
    return [d for d in docs if isinstance(d, str)]


def _textual(line: str) -> bool:
    """Mostly letters (CJK characters count), and no lacuna marks (□ stands for a character lost in the source)."""
    return "\u25a1" not in line and sum(c.isalnum() for c in line) >= 0.6 * len(line)


def _lines(text: str) -> list[str]:
    out = []
    for line in text.split("\n"):
        out += [part.strip() for part in _SENTENCE.findall(line) if part.strip()]
    return out


def main(argv: list[str]) -> int:
    from liandan.evaluate.tasks import load_task

    if len(argv) not in (2, 3):
        print("usage: python -m liandan.evaluate.cloze TASK.toml OUT.jsonl [DATA_DIR]", file=sys.stderr)
        return 2
    task = load_task(Path(argv[0]), *(argv[2:] or []))
    with open(argv[1], "w", encoding="utf-8") as out:
        for item in task.items:
            record = {"question": item.question, "choices": item.choices, "label": item.label}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(task.items)} items of {task.name} -> {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
