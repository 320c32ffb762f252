"""The data loader's share of a training step: producing one step's batch from a mixture of token stores,
against one optimizer step of the tiny model on that batch.

Three stores (English Wikipedia, Chinese classics, Shakespeare from the shared corpora; the Python
documentation corpus split three ways where those are absent), tokenized with a BPE of configs/tiny.toml's
vocabulary (4096) and mixed 0.5 / 0.3 / 0.2. The model is configs/tiny.toml's shape (dim 192, 4 layers, 6 heads,
2 KV heads, sequences of 256, global batch 16, fp32 on the CPU), built from `liandan.model.Transformer`.

    python benchmarks/loader.py                 # 300 loader steps, 10 training steps
    python benchmarks/loader.py --train-steps 20

Timed:

* loader step: `PackedLoader.next_step(16)` (the whole global batch as one micro-batch on one rank): the mixture
  counts, the in-batch placement, the epoch permutations, the reads from the memory-mapped shards and the
  document ids. Both the mean over consecutive steps and the first step of an epoch (which draws a new
  permutation) are reported.
* documents_for_step: the provenance of one step's global batch, as the loss-spike guard asks for it.
* training step: forward, backward and AdamW step of the model on one such batch, with the document mask.

The ratio is the mean loader step over the median training step; the target is below 1%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from liandan.data import (
    Document,
    PackedLoader,
    TokenStore,
    python_docs_corpus,
    shard_path,
    train_bpe,
    write_manifest,
    write_shard,
)
from liandan.model import ModelArgs, Transformer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"
TARGET = 0.01
SEQ_LEN, GLOBAL_BATCH, WEIGHTS = 256, 16, (0.5, 0.3, 0.2)


def sources() -> dict[str, list[Document]]:
    if not (SHARED / "en-wikitext2.jsonl").is_file():
        docs = list(python_docs_corpus())
        return {name: docs[i::3] for i, name in enumerate(("docs-a", "docs-b", "docs-c"))}
    out = {}
    for name in ("en-wikitext2", "zh-classics"):
        lines = (SHARED / f"{name}.jsonl").read_text().splitlines()
        out[name] = [Document(name, str(r["id"]), r["text"]) for r in map(json.loads, lines)]
    plays = (SHARED / "en-shakespeare.txt").read_text()
    out["en-shakespeare"] = [Document("shakespeare", str(i), plays[i : i + 4096]) for i in range(0, len(plays), 4096)]
    return out


def build_stores(root: Path) -> list[TokenStore]:
    corpora = sources()
    tokenizer = train_bpe((d.text for docs in corpora.values() for d in docs), 4096)
    stores = []
    for name, docs in corpora.items():
        half = len(docs) // 2  # two shards, so windows come from both
        infos = [
            write_shard(part, tokenizer, shard_path(root / name, i))
            for i, part in enumerate((docs[:half], docs[half:]))
        ]
        write_manifest(root / name, infos, tokenizer)
        stores.append(TokenStore(root / name))
    return stores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader-steps", type=int, default=300)
    parser.add_argument("--train-steps", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory(prefix="liandan-loader-bench-") as tmp:
        stores = build_stores(Path(tmp))
        loader = PackedLoader(stores, SEQ_LEN, GLOBAL_BATCH, seed=0, val_fraction=0.02, weights=list(WEIGHTS))
        loader.next_step(GLOBAL_BATCH)  # the first epoch's permutations
        step_s = []
        for _ in range(args.loader_steps):
            started = time.perf_counter()
            loader.next_step(GLOBAL_BATCH)
            step_s.append(time.perf_counter() - started)
        epoch_s = []
        for stream in loader.streams:  # a fresh permutation: the costliest step of an epoch
            stream._epochs.clear()
        started = time.perf_counter()
        batch = loader.next_step(GLOBAL_BATCH)[0]
        epoch_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        refs = loader.documents_for_step(loader.step - 1)
        provenance_s = time.perf_counter() - started
        sizes = [f"{s.name} {s.num_tokens / 1e6:.2f}M tokens" for s in stores]

    model = Transformer(ModelArgs(vocab_size=4096, dim=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=SEQ_LEN))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_s = []
    for i in range(args.train_steps + 1):
        started = time.perf_counter()
        loss = model(batch.inputs, batch.targets, doc_ids=batch.doc_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step warms up allocators and kernels
            train_s.append(time.perf_counter() - started)

    loader_mean, train_median = statistics.mean(step_s), statistics.median(train_s)
    print(f"stores: {', '.join(sizes)}; weights {WEIGHTS}; global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens;"
          f" torch {torch.__version__}, {torch.get_num_threads()} threads; python {sys.version.split()[0]}")  # fmt: skip
    print(f"{'what':34s} {'ms':>9s} {'/ training step':>16s}")
    rows = [
        (f"loader step (mean of {len(step_s)})", loader_mean),
        ("loader step (median)", statistics.median(step_s)),
        ("loader step starting new epochs", epoch_s[0]),
        (f"documents_for_step ({len(refs)} docs)", provenance_s),
        (f"training step (median of {len(train_s)})", train_median),
    ]
    for name, seconds in rows:
        print(f"{name:34s} {seconds * 1e3:9.3f} {seconds / train_median:16.5f}")
    ratio = loader_mean / train_median
    verdict = "meets" if ratio < TARGET else "misses"
    print(f"a loader step costs {ratio:.3%} of a training step: {verdict} the target of < {TARGET:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
