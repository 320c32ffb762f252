"""The run store at a million metric rows: how fast it ingests them, and how fast one curve comes back.

    python benchmarks/bench_store.py                 # 10 runs x 10 keys x 10,000 steps, about a minute
    python benchmarks/bench_store.py --steps 2000    # smaller, for a quick look

Runs: `--runs` run directories in a fresh project directory, each with a config.toml, an events.jsonl whose
train_start says the tokens per step and FLOPs per token, and a metrics.jsonl of `--steps` records of nine
metrics plus the writer's `time` (ten keys, as the trainer logs them: `dumps_json` lines). Ingest: one
`RunStore.sync()` of the whole project into an empty store, timed; rows/s is metric rows over its seconds.
Queries: the loss curve of the middle run, whole (every step) and thinned to `max_points=2000` (means and
extremes of buckets), each the median of `--repeats` calls on an open store. The peer is what a reader without
the store does: read that run's metrics.jsonl and parse every line with `json.loads` to pick out the loss
(no pandas), the median of as many repeats. Both are asserted under 100 ms (the store's queries).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from liandan.config import load_config
from liandan.run import RunDir, dumps_json
from liandan.track.store import RunStore

LIMIT_S = 0.100
KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "step_time_s", "z_loss", "val_gap")


def write_project(project: Path, runs: int, steps: int) -> list[str]:
    names = []
    for r in range(runs):
        name = f"run-{r:02d}"
        room = RunDir(project / name)
        room.path.mkdir(parents=True)
        room.write_config(load_config(None, [f"--run.name={name}", f"--train.steps={steps}"]).to_toml())
        start = {"time": 1.7e9, "kind": "train_start", "step": 0, "tokens_per_step": 8192, "flops_per_token": 5e7}
        room.events.write_text(dumps_json(start) + "\n")
        with room.metrics.open("w") as handle:
            for step in range(1, steps + 1):
                values = {k: (10.0 / (1 + step / 100) + 0.001 * (step % 7) + i) for i, k in enumerate(KEYS)}
                handle.write(dumps_json({"step": step, "time": 1.7e9 + step * 0.5, **values}) + "\n")
        names.append(name)
    return names


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def peer_loss_curve(path: Path) -> tuple[list[int], list[float]]:
    steps, losses = [], []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if "loss" in record:
                steps.append(record["step"])
                losses.append(record["loss"])
    return steps, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--dir", type=Path, help="where the project goes (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        project = Path(tmp) / "runs"
        began = time.perf_counter()
        names = write_project(project, args.runs, args.steps)
        written = time.perf_counter() - began
        rows = args.runs * args.steps * (len(KEYS) + 1)
        began = time.perf_counter()
        with RunStore(project) as store:
            store.sync()
        ingest_s = time.perf_counter() - began
        name = names[len(names) // 2]
        with RunStore(project) as store:
            stored = store._db.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
            assert stored == rows, (stored, rows)
            full_s, full = median_seconds(lambda: store.curve(name, "loss"), args.repeats)
            thin_s, thin = median_seconds(lambda: store.curve(name, "loss", max_points=2000), args.repeats)
            tokens_s, _ = median_seconds(lambda: store.curve(name, "loss", x="tokens", max_points=2000), args.repeats)
        peer_s, (peer_steps, peer_losses) = median_seconds(lambda: peer_loss_curve(project / name / "metrics.jsonl"),
                                                           args.repeats)  # fmt: skip
        db_mib = sum(p.stat().st_size for p in project.glob("liandan.db*")) / 2**20
    assert full["step"] == peer_steps and full["y"] == peer_losses, "the store's curve differs from the file's"
    assert len(thin["y"]) <= 2000 and max(thin["high"]) == max(peer_losses)
    results = {
        "runs": args.runs, "steps": args.steps, "metric_rows": rows, "write_files_s": round(written, 2),
        "ingest_s": round(ingest_s, 2), "ingest_rows_per_s": round(rows / ingest_s), "db_mib": round(db_mib, 1),
        "curve_full_ms": round(1e3 * full_s, 2), "curve_2000_ms": round(1e3 * thin_s, 2),
        "curve_2000_tokens_ms": round(1e3 * tokens_s, 2), "peer_jsonl_ms": round(1e3 * peer_s, 2),
        "peer_over_store_full": round(peer_s / full_s, 1), "peer_over_store_2000": round(peer_s / thin_s, 1),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "python": platform.python_version(), "sqlite": __import__("sqlite3").sqlite_version,
    }  # fmt: skip
    for key, value in results.items():
        print(f"{key:24s} {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    assert full_s < LIMIT_S and thin_s < LIMIT_S, f"a curve query took over {1e3 * LIMIT_S:.0f} ms"
    return 0


if __name__ == "__main__":
    sys.exit(main())
