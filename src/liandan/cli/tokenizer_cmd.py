"""`liandan tokenizer report TOKENIZER PATHS...`: bytes, characters and words per token of any tokenizer
(`byte`, a tokenizer.json, liandan's or an imported one, a SentencePiece .model, or a directory holding one),
per source and per language (`liandan.data.inspect.fertility`)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from liandan.config import ConfigError

Encoder = Callable[[list[str]], list[list[int]]]


def add_commands(sub) -> None:
    tokenizer = sub.add_parser("tokenizer")
    actions = tokenizer.add_subparsers(title="actions", metavar="ACTION")
    tokenizer.set_defaults(command=lambda args, overrides: (tokenizer.print_help(), 0)[1])
    p = actions.add_parser("report", help="bytes, characters and words per token, per source and per language")
    p.add_argument("tokenizer", help="byte, a tokenizer.json, a SentencePiece .model, or a directory holding one")
    p.add_argument("paths", nargs="+", help=".txt/.jsonl/.parquet files or directories of them; each file a source")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet records")
    p.add_argument("--txt-mode", choices=["file", "paragraph", "line"], default="paragraph", help="documents of a .txt")
    p.add_argument("--max-docs", type=int, default=2000, help="documents read per source (0: all)")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.set_defaults(command=cmd_report)


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.inspect.fertility import by_language, fertility

    if overrides:
        raise ConfigError(f"unrecognised argument '{overrides[0]}'")
    if args.max_docs < 0:
        raise ConfigError(f"--max-docs = {args.max_docs} must be 0 (all) or more")
    name, encode = load_encoder(args.tokenizer)
    rows = fertility(_documents(args), encode)
    if not rows:
        raise ConfigError(f"no text to tokenize in {', '.join(args.paths)}")
    languages = by_language(rows)
    print(f"tokenizer {name}: per token, over {sum(r.documents for r in rows):,} document(s)")
    _print_table(rows + languages if len({r.source for r in rows}) > 1 else rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"tokenizer": name, "rows": [r.as_dict() for r in rows],
                                               "languages": [r.as_dict() for r in languages]}, indent=1))  # fmt: skip
        print(f"wrote {args.json}")
    return 0


def load_encoder(spec: str) -> tuple[str, Encoder]:
    """(a name, a batch encoder) for `byte`, a tokenizer.json, a SentencePiece .model, or a directory with one
    of the two (a Hugging Face model's directory)."""
    if spec == "byte":
        return "byte", lambda texts: [list(t.encode("utf-8", "surrogatepass")) for t in texts]
    path = Path(spec)
    if path.is_dir():
        found = [p for p in (path / "tokenizer.json", path / "tokenizer.model") if p.is_file()]
        if not found:
            raise ConfigError(f"{spec}: holds neither tokenizer.json nor tokenizer.model")
        path = found[0]
    if not path.is_file():
        raise ConfigError(f"{spec}: no such tokenizer file (byte, a tokenizer.json or a SentencePiece .model)")
    if path.suffix == ".model":
        return str(path), _sentencepiece(path)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception for malformed files
        raise ConfigError(f"{spec}: not a tokenizer.json ({str(err).splitlines()[0]})") from None
    return str(path), lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def _sentencepiece(path: Path) -> Encoder:
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError(f"{path}: a SentencePiece model needs the sentencepiece package") from None
    try:
        model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"{path}: not a SentencePiece model ({str(err).splitlines()[0]})") from None
    return lambda texts: model.encode(texts)


def _documents(args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    from liandan.data.documents.readers import files_in_directory, read_file

    for name in args.paths:
        path = Path(name)
        if not path.exists():
            raise ConfigError(f"{name}: no such file or directory")
        for file in files_in_directory(path, name) if path.is_dir() else [path]:
            source = Path(file).name.split(".")[0]
            docs = read_file(Path(file), source=source, text_field=args.text_field, txt_mode=args.txt_mode)
            for count, doc in enumerate(docs, 1):
                yield source, doc.text
                if count == args.max_docs:
                    break


def _print_table(rows) -> None:
    header = ("source", "language", "documents", "tokens", "bytes", "characters", "words")
    lines = [header]
    for r in rows:
        lines.append((r.source, r.language, f"{r.documents:,}", f"{r.tokens:,}", _ratio(r, "bytes"),
                      _ratio(r, "characters"), _ratio(r, "words")))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))


def _ratio(row, what: str) -> str:
    value = row.per_token(what)
    return f"{value:.3f}" if math.isfinite(value) else "-"
