"""Checkpoint save time on this machine: how long training is blocked by an async save, against a synchronous
DCP save and a plain `torch.save` of the full state.

The state is a liandan `Transformer` of a few tens of millions of fp32 parameters after one AdamW step, so it
holds the weights and AdamW's two moment buffers (three fp32 copies, a few hundred MB). Single process, CPU.

    python benchmarks/checkpoint_save.py                        # ~60M parameters, 5 repetitions
    python benchmarks/checkpoint_save.py --params-millions 20 --reps 2
    python benchmarks/checkpoint_save.py --json results.json   # what docs/benchmarks.md reports

Methods, each repetition in a fresh directory under --dir (default: the system temp directory), deleted
afterwards, with `os.sync()` before and after so that write-back of one save does not land on the next:

* torch.save: `torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f)`, then fsync of the
  file and its directory (a durable save, as DCP's writer and the manager make theirs).
* dcp.save: `torch.distributed.checkpoint.save` of `get_state_dict(model, optimizer)` alone (DCP's writer
  fsyncs its files), without liandan's RNG file, meta.json or manifest.
* manager sync: `CheckpointManager(root, async_save=False).save(...)`; the time until it returns, which covers
  the DCP save, the manifest (fsync and xxh64 of every file) and the rename into place.
* manager async: `CheckpointManager(root, async_save=True).save(...)`; "blocking" is the seconds it returns
  (the time training would be blocked: staging the state in host memory and starting the writer), "total" the
  time until `manager.wait()` returns (the checkpoint complete, with its manifest).
  One manager serves all repetitions of a mode, as one serves a run, so its staging buffers are reused.

The script prints the async blocking time over each synchronous save and whether it meets the target (at most
10% of the synchronous manager save), and, for the synchronous manager save, the share of its time that save()
reports as blocking.

The methods run in interleaved rounds (one repetition of each per round), so a load spike from another process
is shared rather than landing on one method; one untimed round on a tiny model first warms up imports and thread
pools. Medians over the repetitions are reported. MB/s is the bytes of the state's tensors over the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from liandan.checkpoint.manager import CheckpointManager
from liandan.checkpoint.verify import fsync_path
from liandan.config import OptimSection
from liandan.model import ModelArgs, Transformer, count_params
from liandan.train.optimizers.adamw import build_adamw

TARGET = 0.10  # async blocking time at most this fraction of the synchronous save
METHODS = ("torch.save", "dcp.save", "manager sync", "manager async")


# ---------------------------------------------------------------------------------------------------------
# model and state


def model_args(params_millions: float) -> ModelArgs:
    """Vocabulary 32000, width 512, 8 heads, untied head; as many layers as come closest to the target."""
    base = {"vocab_size": 32000, "dim": 512, "n_heads": 8, "max_seq_len": 256}
    one = count_params(ModelArgs(**base, n_layers=1)).total
    two = count_params(ModelArgs(**base, n_layers=2)).total
    per_layer, fixed = two - one, one - (two - one)
    layers = max(1, round((params_millions * 1e6 - fixed) / per_layer))
    return ModelArgs(**base, n_layers=layers)


def trained_state(args: ModelArgs, seed: int = 0) -> tuple[Transformer, torch.optim.Optimizer]:
    """The model and its AdamW after one forward/backward/step, so the optimizer holds its moments."""
    torch.manual_seed(seed)
    model = Transformer(args)
    optimizer = build_adamw(model, OptimSection(), torch.device("cpu"))
    tokens = torch.randint(0, args.vocab_size, (2, 65))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for per_param in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in per_param.values() if isinstance(t, torch.Tensor))
    return total


def dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------------
# the methods: each takes a fresh directory and returns {"seconds": ..., [other timings]}, leaving its output
# in that directory


def save_torch(model, optimizer, out: Path, step: int) -> dict[str, float]:
    path = out / "state.pt"
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(out)
    return {"seconds": time.perf_counter() - started}


def save_dcp(model, optimizer, out: Path, step: int) -> dict[str, float]:
    started = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out / "dcp"), no_dist=True)
    return {"seconds": time.perf_counter() - started}


# One manager per mode lives across the repetitions, as one lives across a run's saves: the first repetition
# pays for allocating the host staging buffers, the later ones show the steady state. Each finished checkpoint
# is moved into the repetition's directory so that it is measured and deleted like the other methods' output.
_MANAGERS: dict[bool, CheckpointManager] = {}


def _manager_save(model, optimizer, out: Path, step: int, async_save: bool) -> dict[str, float]:
    if async_save not in _MANAGERS:
        _MANAGERS[async_save] = CheckpointManager(out.parent / f"manager-{'async' if async_save else 'sync'}",
                                                  async_save=async_save, keep_last=0)  # fmt: skip
    manager = _MANAGERS[async_save]
    meta = {"model_args": dict(vars(model.args)), "tokens": step * 1000}
    started = time.perf_counter()
    blocking = manager.save(step, model, optimizer, meta)
    returned = time.perf_counter() - started
    outcome = manager.wait() if async_save else (manager.outcomes[-1] if manager.outcomes else None)
    total = time.perf_counter() - started
    if outcome is None or not outcome.ok:
        raise RuntimeError(f"checkpoint save failed: {outcome.error if outcome else 'no outcome'}")
    outcome.path.rename(out / outcome.path.name)
    if async_save:
        return {"seconds": total, "blocking": blocking, "returned": returned}
    # save() waited for the whole save; `blocking` is what it reported as the time training was blocked
    return {"seconds": returned, "reported_blocking": blocking}


def save_manager_sync(model, optimizer, out: Path, step: int) -> dict[str, float]:
    return _manager_save(model, optimizer, out, step, async_save=False)


def save_manager_async(model, optimizer, out: Path, step: int) -> dict[str, float]:
    return _manager_save(model, optimizer, out, step, async_save=True)


SAVERS: dict[str, Callable[..., dict[str, float]]] = {
    "torch.save": save_torch,
    "dcp.save": save_dcp,
    "manager sync": save_manager_sync,
    "manager async": save_manager_async,
}


def run_once(name: str, model, optimizer, base: Path, step: int) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix=f"ckpt-{name.replace(' ', '-').replace('.', '-')}-", dir=base))
    try:
        os.sync()
        result = SAVERS[name](model, optimizer, out, step)
        result["bytes_on_disk"] = dir_bytes(out)
        return result
    finally:
        shutil.rmtree(out, ignore_errors=True)
        os.sync()


# ---------------------------------------------------------------------------------------------------------
# reporting


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
    }


def filesystem(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True, timeout=10, check=False).stdout
        fields = out.splitlines()[1].split()
        return f"{fields[0]} ({fields[1]}, mounted on {fields[6]})"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def summarise(results: dict[str, list[dict[str, float]]], nbytes: int) -> dict[str, dict[str, float]]:
    summary = {}
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        row = {
            "seconds": seconds,
            "seconds_all": [r["seconds"] for r in runs],
            "mb_per_s": nbytes / 1e6 / seconds,
            "bytes_on_disk": runs[-1]["bytes_on_disk"],
        }
        for key in ("blocking", "reported_blocking"):
            if key in runs[0]:
                row[key] = statistics.median(r[key] for r in runs)
                row[f"{key}_all"] = [r[key] for r in runs]
        summary[name] = row
    return summary


def print_report(summary, ratios, info) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text where rich is missing
        Console = None

    sync = summary.get("manager sync", {}).get("seconds")
    rows = []

    def add(label: str, seconds: float, runs: list[float], digits: int) -> None:
        ratio = f"{seconds / sync:.3f}" if sync else ""
        rows.append((label, f"{seconds:.{digits}f}", f"{info['state_mb'] / seconds:,.0f}",
                     f"{min(runs):.{digits}f}-{max(runs):.{digits}f}", ratio))  # fmt: skip

    for name in METHODS:
        if name not in summary:
            continue
        s = summary[name]
        if name.startswith("manager async"):
            label = name
            add(f"{label}: blocking", s["blocking"], s["blocking_all"], 3)
            add(f"{label}: total", s["seconds"], s["seconds_all"], 2)
        else:
            add(name, s["seconds"], s["seconds_all"], 2)

    title = (f"Checkpoint save, {info['params'] / 1e6:.1f}M parameters + AdamW: {info['state_mb']:,.0f} MB of "
             f"tensors, median of {info['reps']}")  # fmt: skip
    if Console is not None:
        table = Table(title=title)
        table.add_column("method", no_wrap=True)
        for col in ("seconds", "MB/s", "min-max (s)", "/ manager sync"):
            table.add_column(col, justify="right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        console = Console(width=None if sys.stdout.isatty() else 120)
        console.print(table)
        out = console.print
    else:
        print(title)
        for row in rows:
            print("  ".join(row))
        out = print
    for key, value in ratios.items():
        out(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-millions", type=float, default=60.0, help="model size (default 60)")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions of each method (default 5)")
    parser.add_argument(
        "--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to save (default: the temp directory)"
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--json", type=Path, help="write the results here")
    opts = parser.parse_args()
    # DCP says once per save that it is saving in a single process, which is the point here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    started = time.perf_counter()
    info = machine()
    opts.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="liandan-ckpt-bench-", dir=opts.dir))
    try:
        # warm-up: imports, DCP's planner and thread pools, on a tiny model
        tiny, tiny_opt = trained_state(ModelArgs(vocab_size=256, dim=64, n_layers=1, n_heads=2, max_seq_len=64))
        for name in opts.methods:
            run_once(name, tiny, tiny_opt, base, step=1)
        del tiny, tiny_opt

        args = model_args(opts.params_millions)
        if count_params(args).total > 1.5 * opts.params_millions * 1e6:
            print(
                f"note: the smallest model of this shape (one layer, vocabulary 32000, width 512) has "
                f"{count_params(args).total / 1e6:.1f}M parameters"
            )
        model, optimizer = trained_state(args)
        params = sum(p.numel() for p in model.parameters())
        nbytes = state_bytes(model, optimizer)
        info.update(params=params, state_mb=nbytes / 1e6, reps=opts.reps, dir=str(opts.dir),
                    filesystem=filesystem(opts.dir), model_args=dict(vars(args)))  # fmt: skip
        print(f"model: {args.n_layers} layers, width {args.dim}, vocabulary {args.vocab_size}: {params / 1e6:.2f}M "
              f"parameters; state with AdamW moments {nbytes / 1e6:,.0f} MB; saving under {opts.dir} "
              f"on {info['filesystem']}")  # fmt: skip

        results: dict[str, list[dict[str, float]]] = {name: [] for name in opts.methods}
        for rep in range(opts.reps):
            for name in opts.methods:
                results[name].append(run_once(name, model, optimizer, base, step=100 + rep))
                r = results[name][-1]
                extra = f", blocking {r['blocking']:.3f} s" if name.startswith("manager async") else ""
                print(f"  round {rep + 1}: {name:<28} {r['seconds']:6.2f} s{extra}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        for manager in _MANAGERS.values():
            manager.close()

    summary = summarise(results, nbytes)
    ratios: dict[str, object] = {}
    if "manager async" in summary:
        blocking = summary["manager async"]["blocking"]
        for name, key in (("manager sync", "async blocking / manager sync save"),
                          ("dcp.save", "async blocking / plain dcp.save"),
                          ("torch.save", "async blocking / torch.save")):  # fmt: skip
            if name in summary:
                ratios[key] = blocking / summary[name]["seconds"]
        if "manager sync" in summary:
            met = ratios["async blocking / manager sync save"] <= TARGET
            ratios["target (async blocking <= 10% of sync save)"] = "met" if met else "NOT met"
    if "manager sync" in summary:  # what a synchronous save() reports as its blocking time, against the truth
        ratios["manager sync: seconds save() reports as blocking / seconds it blocks"] = (
            summary["manager sync"]["reported_blocking"] / summary["manager sync"]["seconds"]
        )
    info["load_average_end"] = list(os.getloadavg())
    info["wall_seconds"] = time.perf_counter() - started
    print_report(summary, ratios, info)
    print(f"load average {info['load_average'][0]:.2f} at the start, {info['load_average_end'][0]:.2f} at the end; "
          f"{info['wall_seconds']:.0f} s in all")  # fmt: skip
    if opts.json:
        opts.json.write_text(json.dumps({"machine": info, "results": summary, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
