"""`liandan tokenizer report TOKENIZER PATHS...`: bytes, characters and words per token of any tokenizer
(`byte`, a tokenizer.json, liandan's or an imported one, a SentencePiece .model, or a directory holding one),
per source and per language (`liandan.data.inspect.fertility`). `liandan tokenizer extend TOKENIZER PATHS...
--add N --out NEW.json [--checkpoint CKPT --weights-out GROWN.safetensors]`: tokens learned on new text added
to a BPE tokenizer with every earlier id kept (`liandan.data.tokens.extend`), and a checkpoint's model grown
to match (`liandan.model.vocab`)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from liandan.cli.data_cmd import say_skipped
from liandan.config import ConfigError
from liandan.run.files import atomic_write, check_output

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

    p = actions.add_parser("extend", help="add tokens learned on new text to a BPE tokenizer, keeping every id")
    p.add_argument("tokenizer", help="a BPE tokenizer.json (liandan's or an imported model's)")
    p.add_argument("paths", nargs="+", help="the new text: .txt/.jsonl/.parquet files or directories of them")
    p.add_argument("--add", type=int, required=True, help="how many tokens to add (at most)")
    p.add_argument("--out", required=True, help="the extended tokenizer.json to write")
    p.add_argument("--checkpoint", help="a checkpoint whose model gets rows for the new tokens (with --weights-out)")
    p.add_argument("--weights-out", help="the grown model, one .safetensors file for checkpoint.init_from")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet records")
    p.add_argument("--txt-mode", choices=["file", "paragraph", "line"], default="paragraph", help="documents of a .txt")
    p.add_argument("--max-docs", type=int, default=0, help="documents read per source (0: all)")
    p.set_defaults(command=cmd_extend)


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.inspect.fertility import by_language, fertility

    if overrides:
        raise ConfigError(f"unrecognised argument '{overrides[0]}'")
    if args.max_docs < 0:
        raise ConfigError(f"--max-docs = {args.max_docs} must be 0 (all) or more")
    if args.json:
        check_output(args.json)
    name, encode = load_encoder(args.tokenizer)
    read_stats: dict = {}
    rows = fertility(_documents(args, read_stats), encode)
    say_skipped(read_stats)
    if not rows:
        raise ConfigError(f"no text to tokenize in {', '.join(args.paths)}")
    languages = by_language(rows)
    print(f"tokenizer {name}: per token, over {sum(r.documents for r in rows):,} document(s)")
    _print_table(rows + languages if len({r.source for r in rows}) > 1 else rows)
    if args.json:
        atomic_write(Path(args.json), json.dumps({"tokenizer": name, "rows": [r.as_dict() for r in rows],
                                               "languages": [r.as_dict() for r in languages]}, indent=1))  # fmt: skip
        print(f"wrote {args.json}")
    return 0


def cmd_extend(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.documents.corpus import DataError
    from liandan.data.tokens.extend import extend_tokenizer

    if overrides:
        raise ConfigError(f"unrecognised argument '{overrides[0]}'")
    if bool(args.checkpoint) != bool(args.weights_out):
        raise ConfigError("--checkpoint and --weights-out go together: the model to grow and where to write it")
    source = Path(args.tokenizer)
    if not source.is_file():
        raise ConfigError(f"{args.tokenizer}: no such tokenizer.json")
    check_output(args.out)
    if args.weights_out:
        check_output(args.weights_out, makes_parents=True)
    checkpoint = _checkpoint_dir(args.checkpoint) if args.checkpoint else None  # found before anything is written
    read_stats: dict = {}
    try:
        extension = extend_tokenizer(source.read_text(), (text for _, text in _documents(args, read_stats)), args.add)
    except (DataError, ValueError) as err:
        raise ConfigError(f"{args.tokenizer}: {str(err).splitlines()[0]}") from None
    say_skipped(read_stats)
    added = len(extension.sources)
    if not added:
        raise ConfigError(f"{args.tokenizer}: no new token to add: the text's frequent pieces are already in its"
                          " vocabulary; nothing written")  # fmt: skip
    grown = _grow_checkpoint(args, checkpoint, extension) if checkpoint is not None else None  # may still fail
    atomic_write(Path(args.out), extension.tokenizer_json)
    print(f"added {added} token(s) to {args.tokenizer} (ids {extension.old_size}..{extension.old_size + added - 1}),"
          f" every earlier id kept: {args.out}")  # fmt: skip
    if grown is not None:
        grown()
    return 0


def _checkpoint_dir(given: str):
    from liandan.checkpoint.info import resolve_checkpoint
    from liandan.run.remote import locate

    return resolve_checkpoint(locate(given))


def _grow_checkpoint(args: argparse.Namespace, checkpoint, extension) -> Callable[[], None]:
    """The checkpoint's model grown by the extension's rows, in memory (where loading fails, before anything is
    written); returns what writes it."""
    from liandan.checkpoint import hf
    from liandan.checkpoint.loading import load_model
    from liandan.model.spec import padded_vocab
    from liandan.model.vocab import grow_vocabulary

    model, meta = load_model(checkpoint)
    rows = model.tok_embeddings.num_embeddings
    if rows < extension.old_size:
        raise ConfigError(f"{args.checkpoint}: its model has {rows} embedding rows, fewer than the tokenizer's"
                          f" {extension.old_size} ids: not the model of this tokenizer")  # fmt: skip
    size = max(rows, padded_vocab(0, extension.old_size + len(extension.sources)))
    grow_vocabulary(model, size, extension.sources)

    def write() -> None:
        hf.save_consolidated({k: v.detach().cpu() for k, v in model.state_dict().items()}, model.args,
                             Path(args.weights_out))  # fmt: skip
        print(f"grew step {meta['step']} of {args.checkpoint} from {rows} to {size} vocabulary rows, each new"
              f" token's rows the mean of its old tokens': {args.weights_out} (checkpoint.init_from, with"
              f" data.tokenizer = {args.out})")  # fmt: skip

    return write


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


def _documents(args: argparse.Namespace, read_stats: dict) -> Iterator[tuple[str, str]]:
    """(source, text) of each document; what each file's reader skips is counted in `read_stats` (source ->
    ReadStats), to be said once the documents are read."""
    from liandan.data.documents.corpus import ReadStats
    from liandan.data.documents.readers import files_in_directory, read_file

    for name in args.paths:
        path = Path(name)
        if not path.exists():
            raise ConfigError(f"{name}: no such file or directory")
        for file in files_in_directory(path, name) if path.is_dir() else [path]:
            source = Path(file).name.split(".")[0]
            stats = read_stats.setdefault(source, ReadStats())
            docs = read_file(Path(file), source=source, text_field=args.text_field, txt_mode=args.txt_mode,
                             stats=stats)  # fmt: skip
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
