"""`liandan skipped`: the batches the loss-spike guard skipped in a run, the documents in each, and their text
for a closer look or to train on again."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from liandan.checkpoint.info import run_checkpoint_root
from liandan.checkpoint.verify import CheckpointError, complete_checkpoints
from liandan.config import load_config
from liandan.data.pipeline.prepare import open_prepared, open_stores
from liandan.data.tokens.loader import DocumentRef, PackedLoader
from liandan.run import META, RunDir, read_json


def add_commands(sub) -> None:
    p = sub.add_parser("skipped")
    p.add_argument("run", help="a run directory")
    p.add_argument("--export", metavar="FILE.jsonl", help="write the skipped documents' text, one JSON record each")
    p.set_defaults(command=cmd_skipped)


@dataclass
class SkippedRange:
    first: int  # [first, end) data steps
    end: int
    rollback: dict | None  # the rollback event that skipped them, where the events name it
    saved: bool  # in the newest checkpoint's loader state (else only in the events, after that checkpoint)
    culprits: set[int] = field(default_factory=set)


def cmd_skipped(args: argparse.Namespace, overrides: list[str]) -> int:
    run = Path(args.run)
    loader, checkpoint, ranges = skipped_batches(run)
    where = f"newest checkpoint {checkpoint.name}" if checkpoint else "no checkpoint: from events.jsonl only"
    steps = sum(r.end - r.first for r in ranges)
    print(f"{steps} skipped batch(es) of {run} ({where})" + ("" if ranges else ": the guard skipped none"))
    records = []
    for r in ranges:
        print(describe_range(r))
        for step in range(r.first, r.end):
            documents = loader.documents_for_step(step)
            culprit = ", culprit: anomalous on the model from before the spike" if step in r.culprits else ""
            print(f"  data step {step}: {len(documents)} document(s){culprit}")
            for ref in documents:
                print(f"    {ref.store}  {ref.source}  {ref.doc_id}")
            records += [(step, ref) for ref in documents]
    if args.export:
        written = export(loader, records, Path(args.export))
        print(f"wrote {written} document(s) of {steps} skipped batch(es) to {args.export}")
    return 0


def skipped_batches(run: Path) -> tuple[PackedLoader, Path | None, list[SkippedRange]]:
    """The run's loader (as its trainer built it), its newest checkpoint, and the data steps the guard skipped:
    those in that checkpoint's loader state, and those of rollbacks logged after it."""
    room = RunDir(run)
    if not room.config.is_file():
        raise CheckpointError(f"no {room.config.name} in {run}: not a run directory")
    cfg = load_config(room.config)
    saves = complete_checkpoints(run_checkpoint_root(run))
    checkpoint = saves[-1] if saves else None
    rollbacks = [e for e in room.read_events() if e.get("kind") == "rollback"] if room.events.is_file() else []
    if checkpoint is None and not rollbacks:
        raise CheckpointError(f"no checkpoints in {run} and no rollbacks in its events: nothing to list")
    loader = open_loader(cfg, room)
    ranges: list[SkippedRange] = []
    saved_up_to = 0  # data steps before this are the checkpoint's to speak for
    if checkpoint is not None:
        state = read_json(checkpoint / META, {}).get("loader")
        if not isinstance(state, dict):
            raise CheckpointError(f"{checkpoint}: meta.json has no loader state")
        loader.load_state_dict(state)
        saved_up_to = loader.step
        ranges = [SkippedRange(first, end, None, True) for first, end in loader.skipped]
    by_range = {(r.first, r.end): r for r in ranges}
    for event in rollbacks:
        first, end = event["skipped"]
        if (first, end) in by_range:
            by_range[first, end].rollback = event
        elif first >= saved_up_to and end > first:  # a skip the run undid by resuming from before it is no skip
            by_range[first, end] = SkippedRange(first, end, event, False)
        if (first, end) in by_range:
            by_range[first, end].culprits = set(event.get("culprit_data_steps") or [])
    return loader, checkpoint, sorted(by_range.values(), key=lambda r: r.first)


def open_loader(cfg, room: RunDir) -> PackedLoader:
    """The run's loader over the whole global batch: the trainer's, seen from one rank of one."""
    if cfg.data.stores:
        stores, _ = open_stores(cfg.data.stores, cfg.data.cache_dir)
    else:
        stores = [open_prepared(room.data)[0]]
    t = cfg.train
    return PackedLoader(stores, t.seq_len, t.global_batch, cfg.run.seed, cfg.data.val_fraction,
                        weights=cfg.data.weights or None, split_seed=cfg.data.split_seed)  # fmt: skip


def describe_range(r: SkippedRange) -> str:
    steps = f"data step {r.first}" if r.end - r.first == 1 else f"data steps {r.first}..{r.end - 1}"
    e = r.rollback
    why = f": rollback at step {e['step']} to step {e['to']}; report {e['report']}" if e else ""
    return steps + why + ("" if r.saved else " (after the newest checkpoint)")


def export(loader: PackedLoader, records: list[tuple[int, DocumentRef]], path: Path) -> int:
    """Each skipped document's whole text, decoded with its store's tokenizer, as one JSON line."""
    stores = {s.name: s for s in loader.stores}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for step, ref in records:
            store = stores[ref.store]
            shard = store.shards[ref.shard]
            ids = shard.tokens[shard.doc_starts[ref.document] : shard.doc_starts[ref.document + 1]].tolist()
            if ids and ids[-1] == store.eos_id:
                ids.pop()  # the separator the store adds, not the document's text
            record = {"data_step": step, "store": ref.store, "source": ref.source, "id": ref.doc_id,
                      "shard": ref.shard, "document": ref.document, "text": store.tokenizer.decode(ids)}  # fmt: skip
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return len(records)
