"""Tokenizing into a token store against tokenizing alone: the cost of `write_shard` over the tokenizer it wraps.

The text is the shared corpora (English Wikipedia articles, Chinese classics, Shakespeare in ~4 KB pieces), or
the Python documentation corpus where those are absent, and the tokenizer a byte-level BPE trained on it with
`liandan.data.tokens.tokenizer.train_bpe`. Single process; the Hugging Face tokenizer uses its own thread pool in
every method alike.

    python benchmarks/tokenize_store.py                     # vocabulary 8192, 5 rounds
    python benchmarks/tokenize_store.py --vocab 32000 --rounds 3

Methods, on the same documents in batches of 256:

* encode_batch: `tokenizers.Tokenizer.encode_batch(texts, add_special_tokens=False)`, the encodings discarded.
* encode_batch + ids: the same, plus `[e.ids for e in encodings]`, the least that yields the token ids.
* encode_batch_fast + ids: `encode_batch_fast` (tokenizers >= 0.21: no character offsets), plus the ids: the
  fastest way to token ids that `tokenizers` offers, and what liandan's tokenizer calls.
* write_shard: `liandan.data.tokens.store.write_shard` into a fresh directory: tokenize, convert to uint16, write the
  tokens, the document index and the provenance file, rename into place and checksum both files.

The methods run in interleaved rounds, so load from other processes is shared rather than landing on one
method. Each method's best round is its cost (other processes only ever add time; the median is printed too).
The ratio is write_shard's throughput over each tokenizer-only method's; the target is at least 0.9 against
"encode_batch + ids", and the ratio against "encode_batch_fast + ids" shows the pipeline's own overhead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from liandan.data import Document, python_docs_corpus, train_bpe, write_shard

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"
TARGET = 0.9
BATCH = 256


def documents() -> tuple[list[Document], str]:
    if not (SHARED / "en-wikitext2.jsonl").is_file():
        return list(python_docs_corpus()), "the Python documentation corpus"
    docs = []
    for name in ("en-wikitext2.jsonl", "zh-classics.jsonl"):
        for line in (SHARED / name).read_text().splitlines():
            record = json.loads(line)
            docs.append(Document(name, str(record["id"]), record["text"]))
    plays = (SHARED / "en-shakespeare.txt").read_text()
    docs += [Document("shakespeare", str(i), plays[i : i + 4096]) for i in range(0, len(plays), 4096)]
    return docs, "the shared corpora (en-wikitext2, zh-classics, en-shakespeare)"


def batches(texts: list[str]) -> list[list[str]]:
    return [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    docs, described = documents()
    texts = [d.text for d in docs]
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    tokenizer = train_bpe(texts, args.vocab)
    hf = tokenizer._tok  # the underlying tokenizers.Tokenizer, the peer measured here
    workdir = Path(tempfile.mkdtemp(prefix="liandan-tokenize-bench-"))

    def encode_only() -> None:
        for batch in batches(texts):
            hf.encode_batch(batch, add_special_tokens=False)

    def encode_ids() -> None:
        for batch in batches(texts):
            [e.ids for e in hf.encode_batch(batch, add_special_tokens=False)]

    def encode_fast_ids() -> None:
        for batch in batches(texts):
            [e.ids for e in hf.encode_batch_fast(batch, add_special_tokens=False)]

    def store(round_index: int) -> None:
        write_shard(docs, tokenizer, workdir / f"r{round_index}" / "shard-00000.bin", batch_docs=BATCH)

    methods = {
        "encode_batch": lambda r: encode_only(),
        "encode_batch + ids": lambda r: encode_ids(),
        "encode_batch_fast + ids": lambda r: encode_fast_ids(),
        "write_shard": store,
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    try:
        encode_ids()  # warm up the thread pool and caches
        for r in range(args.rounds):
            for name, fn in methods.items():
                started = time.perf_counter()
                fn(r)
                times[name].append(time.perf_counter() - started)
        tokens = sum(
            1 + len(ids) for ids in itertools.chain.from_iterable(tokenizer.encode_batch(b) for b in batches(texts))
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"{len(docs):,} documents, {megabytes:.1f} MB of UTF-8 from {described}; {tokens:,} tokens;"
          f" BPE vocabulary {args.vocab}; {args.rounds} rounds; python {sys.version.split()[0]}")  # fmt: skip
    print(f"{'method':24s} {'best s':>8s} {'median s':>9s} {'MB/s':>8s} {'write_shard / method':>21s}")
    shard_s = min(times["write_shard"])
    for name, values in times.items():
        best = min(values)
        print(f"{name:24s} {best:8.3f} {statistics.median(values):9.3f} {megabytes / best:8.2f} {best / shard_s:21.3f}")
    ratio = min(times["encode_batch + ids"]) / shard_s
    verdict = "meets" if ratio >= TARGET else "misses"
    print(f"write_shard runs at {ratio:.3f}x the throughput of encode_batch + ids: {verdict} the target of {TARGET}x")
    fast = min(times["encode_batch_fast + ids"]) / shard_s
    print(
        f"write_shard runs at {fast:.3f}x the throughput of encode_batch_fast + ids (pipeline overhead {1 - fast:+.1%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
