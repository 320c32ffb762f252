"""Backtest the final-loss forecast on held-out runs unlike the library: other widths and depths, learning
rates, schedules, data and tokenizers, tokens per step, and optimizers than the library's runs hold.

    python benchmarks/forecast_unlike.py              # train the missing runs (one at a time), then backtest
    python benchmarks/forecast_unlike.py --list
    python benchmarks/forecast_unlike.py --backtest   # train nothing: backtest the runs kept so far

Each run is `liandan train` on one thread (as `benchmarks/forecast_library.py` trains the library) and is
kept as a small fixture in benchmarks/forecast_unlike/<name>.json.gz, so the backtest reruns in seconds
without training. The backtest forecasts each run from 10, 20 and 50% of its steps with the shipped library
(none of these runs teaches) and prints the 80% interval's coverage overall and by kind of unlikeness, the
table docs/benchmarks.md holds, and the runs of other optimizers than AdamW forecast again from the
library's AdamW runs alone. Runs whose optimizer is not registered here are not trained.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import forecast_library as lib  # the library's trainer and fixture writer, beside this script

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "forecast_unlike"
SHARED = ROOT.parent / "shared" / "data"
FRACTIONS = (0.1, 0.2, 0.5)

SIZES = {  # dim, layers, heads, kv heads, seq_len, global batch: beside the library's s, m, l, xl
    **lib.SIZES,
    "xs": (24, 2, 2, 1, 64, 8),  # narrower than any library run
    "wide": (192, 2, 6, 2, 64, 8),  # wider
    "deep": (64, 6, 4, 2, 64, 8),  # deeper
    "b2": (64, 2, 4, 2, 64, 2),  # 128 tokens per step
    "b48": (48, 2, 4, 2, 64, 48),  # 3072 tokens per step
    "xs-b2": (24, 2, 2, 1, 64, 2),  # narrower and 128 tokens per step
    # the second set, defined before any of its runs was trained
    "n32": (32, 2, 2, 1, 64, 8),  # narrower
    "w160": (160, 2, 4, 2, 64, 8),  # wider
    "deep8": (48, 8, 4, 2, 64, 8),  # deeper and narrow
    "b4": (48, 2, 4, 2, 64, 4),  # 256 tokens per step
    "b32": (64, 2, 4, 2, 64, 32),  # 2048 tokens per step
}
DATA = {  # corpus name: (files, jsonl text field)
    "en": (["corpus/en-shakespeare.txt", "corpus/en-wikitext2.jsonl"], "text"),
    "wikitext": (["corpus/en-wikitext2.jsonl"], "text"),
    "gsm8k": (["eval/gsm8k-test.jsonl"], "question"),
    "gsm8k-answers": (["eval/gsm8k-test.jsonl"], "answer"),
    "zh": (["corpus/zh-classics.jsonl"], "text"),
}


@dataclass(frozen=True)
class Unlike:
    kind: str  # how the run differs from the library
    spec: lib.Spec
    warmup: int | None = None  # default: the library's, steps / 20
    optimizer: str = "adamw"
    tokenizer: str = "byte"
    extra: tuple[str, ...] = field(default=())


def runs() -> list[Unlike]:
    out = []

    def add(kind, schedule, size, steps, lr, *, tag="", corpus="en", optimizer="adamw", **kw):
        name = f"{kind}-{schedule}-{size}-{steps}-lr{lr:g}{tag}"
        spec_kw = {k: kw.pop(k) for k in ("min_lr_ratio", "decay_fraction") if k in kw}
        spec = lib.Spec(name, schedule, size, steps, lr, True, corpus, **spec_kw)
        out.append(Unlike(kind, spec, optimizer=optimizer, **kw))

    add("width", "wsd", "xs", 800, 3e-3)
    add("width", "cosine", "wide", 500, 2e-3)
    add("width", "linear", "deep", 600, 2e-3)
    add("lr", "cosine", "m", 600, 1e-2)
    add("lr", "wsd", "m", 800, 2.5e-4)
    add("schedule", "cosine", "m", 600, 2e-3, tag="-warmup30", warmup=180)
    add("schedule", "wsd", "m", 800, 2e-3, tag="-d50", decay_fraction=0.5)
    add("schedule", "linear", "s", 600, 3e-3, tag="-warmup0-floor50", warmup=0, min_lr_ratio=0.5)
    add("data", "cosine", "m", 600, 2e-3, tag="-gsm8k", corpus="gsm8k")
    add("data", "wsd", "m", 600, 2e-3, tag="-bpe1024", tokenizer="bpe", extra=("--data.bpe_vocab_size=1024",))
    add("data", "linear", "s", 800, 2e-3, tag="-wikitext", corpus="wikitext")
    add("batch", "cosine", "b2", 800, 1e-3)
    add("batch", "wsd", "b48", 400, 3e-3)
    add("several", "wsd", "xs-b2", 800, 1e-2, tag="-gsm8k", corpus="gsm8k")  # far: the run's own fit
    add("optimizer", "cosine", "m", 600, 2e-3, tag="-muon", optimizer="muon")
    add("optimizer", "wsd", "m", 800, 2e-3, tag="-muon", optimizer="muon")
    # The second set: 15 more, defined (and committed) before any of them was trained, so that no choice among
    # them follows from their forecasts. Each differs from the runs above and from the library's.
    add("width", "linear", "n32", 800, 3e-3)
    add("width", "wsd", "w160", 500, 2e-3)
    add("width", "cosine", "deep8", 500, 2e-3)
    add("lr", "cosine", "m", 800, 5e-4)
    add("lr", "linear", "s", 600, 1.5e-2)
    add("schedule", "cosine", "s", 800, 3e-3, tag="-warmup15-floor30", warmup=120, min_lr_ratio=0.3)
    add("schedule", "wsd", "s", 600, 3e-3, tag="-d05", decay_fraction=0.05)
    add("schedule", "constant", "m", 600, 2e-3, tag="-warmup25", warmup=150)
    add("data", "cosine", "s", 600, 3e-3, tag="-gsm8k-answers", corpus="gsm8k-answers")
    add(
        "data",
        "linear",
        "m",
        600,
        2e-3,
        tag="-zh-bpe1024",
        corpus="zh",
        tokenizer="bpe",
        extra=("--data.bpe_vocab_size=1024",),
    )
    add("batch", "linear", "b4", 800, 2e-3)
    add("batch", "cosine", "b32", 400, 2e-3)
    add("optimizer", "constant", "m", 600, 3e-3, tag="-muon", optimizer="muon")
    add("several", "cosine", "w160", 600, 5e-4, tag="-wikitext", corpus="wikitext")
    add("several", "wsd", "n32", 600, 5e-3, tag="-gsm8k-muon", corpus="gsm8k", optimizer="muon")
    return out


def overrides(run: Unlike, out_dir: Path) -> list[str]:
    spec = run.spec
    dim, layers, heads, kv, seq, batch = SIZES[spec.size]
    files, field_name = DATA[spec.corpus]
    base = lib.overrides(replace(spec, size="m", corpus="en"), out_dir)  # the library's keys; the run's own follow
    keep = [o for o in base if not o.startswith(("--model.", "--train.global_batch", "--train.seq_len"))]
    keep = [o for o in keep if not o.startswith(("--data.", "--schedule.warmup_steps"))]
    warmup = max(10, spec.steps // 20) if run.warmup is None else run.warmup
    return [
        *keep,
        f"--model.dim={dim}",
        f"--model.n_layers={layers}",
        f"--model.n_heads={heads}",
        f"--model.n_kv_heads={kv}",
        f"--model.max_seq_len={seq}",
        f"--train.global_batch={batch}",
        f"--train.seq_len={seq}",
        f"--schedule.warmup_steps={warmup}",
        f"--data.tokenizer={run.tokenizer}",
        f"--data.paths={json.dumps([str(SHARED / f) for f in files])}",
        f"--data.text_field={field_name}",
        f"--optim.name={run.optimizer}",
        *run.extra,
    ]


def fixture(run: Unlike, run_dir: Path) -> dict:
    spec = run.spec
    dim, layers, heads, kv, seq, batch = SIZES[spec.size]
    data = lib.fixture(replace(spec, size="m"), run_dir)  # records thinned as the library's
    files, _ = DATA[spec.corpus]
    data.update(
        kind=run.kind,
        tokenizer=run.tokenizer,
        files=sorted(Path(f).name for f in files),
        model={"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv},
        train={"steps": spec.steps, "global_batch": batch, "seq_len": seq},
        optim={"lr": spec.lr, "name": run.optimizer},
    )
    data["schedule"]["warmup_steps"] = max(10, spec.steps // 20) if run.warmup is None else run.warmup
    data["records"]["tokens"] = [s * batch * seq for s in data["records"]["step"]]
    return data


def optimizer_known(name: str) -> bool:
    sys.path.insert(0, str(ROOT / "src"))
    from liandan.plugins import names

    return name in names("optimizer")


def train_missing(todo: list[Unlike], keep: Path | None) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    root = keep or Path(tempfile.mkdtemp(prefix="forecast-unlike-"))
    for run in todo:
        path = OUT / f"{run.spec.name}.json.gz"
        if path.is_file():
            continue
        if not optimizer_known(run.optimizer):
            print(f"{run.spec.name}: skipped, no optimizer {run.optimizer!r} here", flush=True)
            continue
        work = root / run.spec.name
        work.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        run_dir = lib.train(run.spec, work, overrides(run, work))
        data = fixture(run, run_dir)
        with gzip.open(path, "wt") as handle:
            json.dump(data, handle, separators=(",", ":"))
        print(f"{run.spec.name}: {len(data['records']['step'])} records, {time.monotonic() - start:.0f}s", flush=True)


def backtest() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from liandan.plan.forecast import backtest_curves
    from liandan.plan.forecast_library import load_fixture

    paths = sorted(OUT.glob("*.json.gz"))
    if not paths:
        print(f"no runs in {OUT}; train them first", file=sys.stderr)
        return 1
    curves = [load_fixture(p) for p in paths]
    kinds = {}
    for curve, path in zip(curves, paths):
        with gzip.open(path, "rt") as handle:
            kinds[curve.name] = json.load(handle)["kind"]
    start = time.monotonic()
    rows = backtest_curves(curves, FRACTIONS)
    seconds = time.monotonic() - start
    groups: dict[str, list] = defaultdict(list)
    print("| run | kind | distance | from 10% | from 20% | from 50% |")
    print("|---|---|---|---|---|---|")
    for curve in curves:
        mine = [r for r in rows if Path(r.run).name == curve.name]
        cells = []
        for r in mine:
            if r.forecast is None:
                cells.append("refused")
                continue
            groups[kinds[curve.name]].append(r)
            groups["all"].append(r)
            cells.append(f"{100 * r.error:+.1f}%" + ("" if r.covered else " (out)"))
        distance = next((r.forecast.distance for r in mine if r.forecast is not None), float("nan"))
        print(f"| {curve.name} | {kinds[curve.name]} | {distance:.1f} | " + " | ".join(cells) + " |")
    print()
    print("| kind | runs | forecasts | in 80% interval | mean \\|error\\| | mean half-width |")
    print("|---|---|---|---|---|---|")
    for kind in [*sorted(k for k in groups if k != "all"), "all"]:
        group = groups[kind]
        n = len(group)
        covered = sum(bool(r.covered) for r in group)
        error = sum(abs(r.error) for r in group) / n
        half = sum((r.forecast.high - r.forecast.low) / (2 * r.forecast.final_loss) for r in group) / n
        runs_n = len({r.run for r in group})
        print(
            f"| {kind} | {runs_n} | {n} | {covered} ({100 * covered / n:.0f}%) | {100 * error:.1f}% | {100 * half:.1f}% |"
        )
    print(f"\n{len(rows)} forecasts in {seconds:.0f}s")
    others = [c for c in curves if c.features.optimizer != "adamw"]
    if others:
        print("\nThe same runs of other optimizers, forecast from the library's AdamW runs alone:\n")
        print("| run | distance | from 10% | from 20% | from 50% |\n|---|---|---|---|---|")
        for curve in others:
            mine = backtest_curves([curve], FRACTIONS, without(curve.features.optimizer))
            cells = [f"{100 * r.error:+.1f}%" + ("" if r.covered else " (out)") for r in mine]
            print(f"| {curve.name} | {mine[0].forecast.distance:.1f} | " + " | ".join(cells) + " |")
    return 0


def without(optimizer: str):
    """The shipped library without its runs of `optimizer`: what a forecast of such a run had before them."""
    from liandan.plan.forecast_library import Calibration, Library, default_library

    library = default_library()
    taught = tuple(t for t in library.taught if t.features.optimizer != optimizer)
    scores = tuple(s for s in library.calibration.scores if s.optimizer != optimizer)
    names = tuple(t.name for t in taught)
    return Library(library.priors, Calibration(scores), names, taught, library.settings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="names of the runs to train (default: all)")
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    parser.add_argument("--backtest", action="store_true", help="train nothing: backtest the runs kept")
    parser.add_argument("--keep", type=Path, help="keep the run directories under this folder")
    args = parser.parse_args()
    todo = [r for r in runs() if not args.only or r.spec.name in args.only]
    if args.list:
        for r in todo:
            kept = "kept" if (OUT / f"{r.spec.name}.json.gz").is_file() else "-"
            print(f"{r.spec.name:44s} {r.kind:10s} {r.optimizer:6s} {kept}")
        return 0
    if not args.backtest:
        train_missing(todo, args.keep)
    return backtest()


if __name__ == "__main__":
    sys.exit(main())
