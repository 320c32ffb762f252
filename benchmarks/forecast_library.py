"""Train the forecast library: tiny real runs on the shared text, each kept as a small metric fixture.

    python benchmarks/forecast_library.py                  # every run, two at a time
    python benchmarks/forecast_library.py --only wsd-m-1200 --jobs 1
    python benchmarks/forecast_library.py --list
    python benchmarks/forecast_library.py --fit            # refit the library set into library/fits.json
    python benchmarks/forecast_library.py --fit --choose   # ...choosing the forecast's settings again

Each run is `liandan train` on the byte tokenizer over the shared corpus (../shared/data/corpus), one
thread per run. Its metrics.jsonl becomes src/liandan/plan/library/<name>.json.gz: step, loss, lr and
tokens of every record (thinned to at most ~600 records for long runs), with the model, optimizer and
schedule it ran with. Runs marked held-out are never used as the prior; `liandan forecast --backtest
--library` replays them. One run takes a 100x learning-rate burst (a loss spike, with the guard off so
that it stays in the curve) and one is killed mid-run and resumed by the supervisor from its checkpoint,
so its metrics repeat the steps since that checkpoint.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "liandan" / "plan" / "library"
CORPUS = ROOT.parent / "shared" / "data" / "corpus"
MAX_RECORDS = 600

SIZES = {  # dim, layers, heads, kv heads, seq_len, global batch
    "s": (48, 2, 4, 2, 64, 8),
    "m": (64, 2, 4, 2, 64, 16),
    "l": (96, 3, 6, 2, 128, 8),
    "xl": (128, 3, 8, 4, 64, 8),
}
CORPORA = {
    "en": ["en-shakespeare.txt", "en-wikitext2.jsonl"],
    "shakespeare": ["en-shakespeare.txt"],
    "zh": ["zh-classics.jsonl"],
}


@dataclass(frozen=True)
class Spec:
    name: str
    schedule: str
    size: str
    steps: int
    lr: float
    heldout: bool = False
    corpus: str = "en"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    seed: int = 1
    faults: str = ""  # $LIANDAN_FAULTS for the first attempt
    optimizer: str = "adamw"
    extra: tuple[str, ...] = field(default=())


def specs() -> list[Spec]:
    out = []

    def add(schedule, size, steps, lr, heldout=False, **kw):
        tag = kw.pop("tag", "")
        name = f"{schedule}-{size}-{steps}-lr{lr:g}{tag}"
        out.append(Spec(name, schedule, size, steps, lr, heldout, **kw))

    # the library
    add("cosine", "s", 600, 3e-3)
    add("cosine", "m", 1200, 2e-3)
    add("cosine", "l", 800, 1e-3)
    add("cosine", "m", 2000, 4e-3, corpus="shakespeare")
    add("cosine", "xl", 1000, 2e-3, min_lr_ratio=0.0, tag="-floor0")
    add("wsd", "s", 800, 4e-3)
    add("wsd", "m", 1500, 2e-3)
    add("wsd", "l", 600, 2e-3, decay_fraction=0.3, tag="-d30")
    add("wsd", "m", 1000, 1e-3, corpus="zh")
    add("wsd", "xl", 1200, 2e-3, decay_fraction=0.1, tag="-d10")
    add("linear", "s", 1000, 2e-3)
    add("linear", "m", 600, 4e-3)
    add("linear", "l", 1000, 2e-3, corpus="shakespeare")
    add("linear", "xl", 800, 1e-3, min_lr_ratio=0.0, tag="-floor0")
    add("constant", "s", 1200, 2e-3)
    add("constant", "m", 800, 1e-3)
    add("constant", "l", 1000, 3e-3, corpus="zh")
    add("cosine", "s", 1500, 2e-3, corpus="zh")
    add("constant", "xl", 600, 2e-3)
    # a spike and a restart, in the library and held out
    add("cosine", "m", 1000, 2e-3, tag="-spike", faults="burst@update:400", extra=("--guard.enabled=false",))
    add("wsd", "m", 1200, 3e-3, tag="-restart", faults="kill@step:700", extra=("--checkpoint.every=250",))
    # Muon (hidden matrices; AdamW for the rest), at AdamW's rates: its curves differ in shape
    add("cosine", "m", 1000, 2e-3, tag="-muon", optimizer="muon")
    add("wsd", "m", 800, 3e-3, tag="-muon", optimizer="muon")
    add("linear", "s", 800, 2e-3, tag="-muon", optimizer="muon")
    add("constant", "m", 800, 2e-3, tag="-muon", optimizer="muon")
    add("cosine", "s", 600, 3e-3, tag="-muon", optimizer="muon")
    # ...and more Muon runs, sizes, rates and schedules varied as the AdamW runs are: with 5 the conformal
    # 80% band of Muon forecasts was their largest error
    add("cosine", "s", 1000, 2e-3, tag="-muon", optimizer="muon")
    add("cosine", "m", 800, 4e-3, tag="-muon", optimizer="muon", corpus="shakespeare")
    add("cosine", "l", 600, 1e-3, tag="-muon", optimizer="muon")
    add("wsd", "s", 1000, 4e-3, tag="-muon", optimizer="muon")
    add("wsd", "m", 600, 1e-3, tag="-muon", optimizer="muon", corpus="zh")
    add("wsd", "xl", 600, 2e-3, tag="-d30-muon", optimizer="muon", decay_fraction=0.3)
    add("linear", "m", 1000, 3e-3, tag="-muon", optimizer="muon")
    add("linear", "s", 600, 4e-3, tag="-floor0-muon", optimizer="muon", min_lr_ratio=0.0)
    add("constant", "s", 1000, 1e-3, tag="-muon", optimizer="muon", corpus="zh")
    add("constant", "l", 600, 3e-3, tag="-muon", optimizer="muon", corpus="shakespeare")
    # held out: every schedule, sizes and lengths the library also spans
    add("cosine", "l", 1200, 2e-3, heldout=True)
    add("cosine", "m", 800, 3e-3, heldout=True, corpus="zh")
    add("wsd", "l", 1000, 3e-3, heldout=True)
    add("wsd", "s", 2000, 2e-3, heldout=True, corpus="shakespeare")
    add("linear", "m", 1500, 2e-3, heldout=True)
    add("linear", "l", 700, 3e-3, heldout=True, corpus="zh")
    add("constant", "m", 1500, 2e-3, heldout=True)
    add("constant", "xl", 900, 1e-3, heldout=True, corpus="shakespeare")
    add("wsd", "m", 1000, 2e-3, heldout=True, corpus="zh", tag="-spike", faults="burst@update:300",
        extra=("--guard.enabled=false",))  # fmt: skip
    add("cosine", "s", 1200, 3e-3, heldout=True, tag="-restart", faults="kill@step:500",
        extra=("--checkpoint.every=200",))  # fmt: skip
    return out


def overrides(spec: Spec, out_dir: Path) -> list[str]:
    dim, layers, heads, kv, seq, batch = SIZES[spec.size]
    paths = json.dumps([str(CORPUS / name) for name in CORPORA[spec.corpus]])
    return [
        f"--run.output_dir={out_dir}",
        f"--run.name={spec.name}",
        f"--run.seed={spec.seed}",
        "--run.device=cpu",
        f"--model.dim={dim}",
        f"--model.n_layers={layers}",
        f"--model.n_heads={heads}",
        f"--model.n_kv_heads={kv}",
        f"--model.max_seq_len={seq}",
        f"--train.steps={spec.steps}",
        f"--train.global_batch={batch}",
        f"--train.seq_len={seq}",
        "--train.dtype=fp32",
        f"--optim.lr={spec.lr}",
        f"--optim.name={spec.optimizer}",
        f"--schedule.kind={spec.schedule}",
        f"--schedule.warmup_steps={max(10, spec.steps // 20)}",
        f"--schedule.min_lr_ratio={spec.min_lr_ratio}",
        f"--schedule.decay_fraction={spec.decay_fraction}",
        "--data.tokenizer=byte",
        f"--data.paths={paths}",
        *spec.extra,
    ]


def train(spec: Spec, work: Path, args: list[str] | None = None) -> Path:
    """`liandan train` of `spec` under `work` (its overrides: `args`, default the library's)."""
    config = work / "base.toml"
    config.write_text("[run]\nseed = 1\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    env.pop("LIANDAN_FAULTS", None)
    if spec.faults:
        env["LIANDAN_FAULTS"] = spec.faults
    args = overrides(spec, work) if args is None else args
    cmd = [sys.executable, "-m", "liandan.cli", "train", str(config), *args]
    log = work / f"{spec.name}.log"
    with log.open("w") as handle:
        done = subprocess.run(cmd, check=False, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=work)
    if done.returncode != 0:
        raise RuntimeError(f"{spec.name}: liandan train exited {done.returncode}; see {log}")
    return work / spec.name


def fixture(spec: Spec, run_dir: Path) -> dict:
    dim, layers, heads, kv, seq, batch = SIZES[spec.size]
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r and "step" in r:
            records.append(r)
    every = max(1, -(-len(records) // MAX_RECORDS))
    # thinning keeps raw records (their noise intact), the last one always, and every record near a restart
    keep = [r for i, r in enumerate(records) if i % every == 0 or i == len(records) - 1]
    steps = [int(r["step"]) for r in keep]
    return {
        "name": spec.name,
        "set": "heldout" if spec.heldout else "library",
        "corpus": spec.corpus,
        "model": {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv},
        "train": {"steps": spec.steps, "global_batch": batch, "seq_len": seq},
        "optim": {"lr": spec.lr, "name": spec.optimizer},
        "schedule": {
            "kind": spec.schedule,
            "warmup_steps": max(10, spec.steps // 20),
            "min_lr_ratio": spec.min_lr_ratio,
            "decay_fraction": spec.decay_fraction,
        },
        "faults": spec.faults,
        "records": {
            "step": steps,
            "loss": [round(float(r["loss"]), 5) if r["loss"] is not None else None for r in keep],
            "lr": [float(f"{r.get('lr', 0.0):.4g}") for r in keep],
            "tokens": [s * batch * seq for s in steps],
        },
    }


def fit(choose: bool) -> int:
    """Whole-run fits and calibration scores, with the settings fits.json holds or (`choose`) those the
    library's leave-one-run-out forecasts choose."""
    sys.path.insert(0, str(ROOT / "src"))
    from liandan.plan.forecast_library import FITS, save_fits

    start = time.monotonic()
    settings = None if choose or not FITS.is_file() else json.loads(FITS.read_text())["settings"]
    library = save_fits(settings=settings)
    print(f"{FITS}: {len(library.taught)} runs in {time.monotonic() - start:.0f}s; settings {library.settings}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once (one thread each)")
    parser.add_argument("--only", nargs="*", help="names of the runs to train (default: all)")
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    parser.add_argument("--keep", type=Path, help="keep the run directories under this folder")
    parser.add_argument("--fit", action="store_true", help="train nothing: refit the library set into fits.json")
    parser.add_argument("--choose", action="store_true", help="with --fit: choose the forecast's settings again")
    args = parser.parse_args()
    if args.fit:
        return fit(args.choose)
    todo = [s for s in specs() if not args.only or s.name in args.only]
    if args.list:
        for s in todo:
            print(f"{s.name:36s} {'held out' if s.heldout else 'library':9s} {s.corpus:12s} {s.faults}")
        return 0
    if not CORPUS.is_dir():
        print(f"the shared corpus is not at {CORPUS}", file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    root = args.keep or Path(tempfile.mkdtemp(prefix="forecast-library-"))

    def one(spec: Spec) -> str:
        work = root / spec.name
        work.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        run_dir = train(spec, work)
        data = fixture(spec, run_dir)
        path = OUT / f"{spec.name}.json.gz"
        with gzip.open(path, "wt") as handle:
            json.dump(data, handle, separators=(",", ":"))
        return f"{spec.name}: {len(data['records']['step'])} records, {time.monotonic() - start:.0f}s"

    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(one, todo):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
