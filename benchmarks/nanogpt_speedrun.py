"""nanoGPT's own CPU benchmark against liandan, side by side in one run: the time liandan takes to reach the
final train loss nanoGPT ends its documented run with, as a share of nanoGPT's wall time.

    python benchmarks/nanogpt_speedrun.py --nanogpt ../nanogpt

nanoGPT (a checkout of karpathy/nanoGPT) runs its README's CPU command ("I only have a macbook"):
`train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000
--dropout=0.0`, in a scratch copy whose data/shakespeare_char/input.txt is the shared Shakespeare text (its
prepare.py then downloads nothing). liandan trains `configs/shakespeare-char.toml` on the same text with the
byte tokenizer (the text is ASCII: bytes are characters). Each side's data is prepared before any clock starts,
as nanoGPT's README has it (`prepare.py`, then `train.py`): nanoGPT's train.bin and val.bin, and liandan's token
store, made by the same pipeline `liandan train` runs on `[data] paths` and then opened by the timed run
through `[data] stores`. Both start at once, each with one thread
(OMP_NUM_THREADS=1) and pinned to its own core.

The measure. nanoGPT's figure is the train loss its last evaluation prints: the mean loss of its final model
over `eval_iters` (20) random batches of the training split. liandan's is its training loss averaged over the
last 20 steps (the same 20 batches of 12 x 64 tokens), each taken before that step's update; it is the first
step at which that average is at or below nanoGPT's figure that counts, timed from liandan's launch (start-up
included) to that step's end. The trailing average lags the model by up to 20 steps, so it is a little
pessimistic for liandan. nanoGPT's wall time is from its launch to its exit (start-up and its evaluations
included). The ratio printed is liandan's time over nanoGPT's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NANOGPT_COMMAND = [
    "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
    "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0",
]  # fmt: skip
WINDOW = 20  # liandan's steps averaged: as many batches as nanoGPT's eval_iters


def single_thread_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)


def pinned(core: int) -> list[str]:
    """The command prefix that runs a process (and all its threads and children) on one core only."""
    return ["taskset", "-c", str(core)]


def nanogpt_copy(checkout: Path, corpus: Path, root: Path) -> Path:
    """A scratch copy of the checkout's code with the corpus as its Shakespeare input, prepared (train.bin,
    val.bin, meta.pkl) before any clock starts."""
    work = _mkdir(root / "nanogpt")
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(checkout / name, work / name)
    shutil.copytree(checkout / "config", work / "config")
    data = _mkdir(work / "data" / "shakespeare_char")
    shutil.copy(checkout / "data" / "shakespeare_char" / "prepare.py", data / "prepare.py")
    shutil.copy(corpus, data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return work


def liandan_store(config: Path, corpus: Path, root: Path) -> Path:
    """liandan's counterpart of nanoGPT's prepare.py, also run before any clock starts: the corpus tokenized
    into a token store by the same pipeline `liandan train` runs on `[data] paths` (the same store, so the
    same batches), which the timed run then opens through `[data] stores`."""
    store = root / "liandan-store"
    script = (
        "import sys; from pathlib import Path; from liandan.config import load_config; "
        "from liandan.data.pipeline.prepare import prepare_store; "
        "cfg = load_config(Path(sys.argv[1]), [f'--data.paths=[\"{sys.argv[2]}\"]']); "
        "prepare_store(cfg.data, Path(sys.argv[3]), say=lambda line: None)"
    )
    env = single_thread_env(PYTHONPATH=str(REPO / "src"))
    subprocess.run([sys.executable, "-c", script, str(config), str(corpus.resolve()), str(store)], env=env, check=True)
    return store


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def nanogpt_result(log: str) -> tuple[float, list[float]]:
    """(final train loss, per-iteration milliseconds) from nanoGPT's output."""
    evals = re.findall(r"step (\d+): train loss ([\d.]+), val loss", log)
    if not evals:
        raise SystemExit(f"nanoGPT printed no evaluation:\n{log[-2000:]}")
    iteration_ms = [float(ms) for ms in re.findall(r"iter \d+: loss [\d.]+, time ([\d.]+)ms", log)]
    return float(evals[-1][1]), iteration_ms[1:]  # the first iteration pays for warm-up


def step_rows(metrics: Path) -> list[dict]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row for row in rows if "loss" in row and "time" in row]


def time_to_reach(rows: list[dict], target: float, started: float) -> tuple[int, float] | None:
    """(step, seconds since launch) at which the trailing mean of liandan's training loss (`rows` of its
    metrics.jsonl, one per step) first reaches `target`, or None."""
    for i in range(WINDOW, len(rows) + 1):
        window = rows[i - WINDOW : i]
        if statistics.fmean(row["loss"] for row in window) <= target:
            return rows[i - 1]["step"], rows[i - 1]["time"] - started
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, default=REPO.parent / "nanogpt", help="a karpathy/nanoGPT checkout")
    parser.add_argument(
        "--corpus", type=Path, default=REPO.parent / "shared" / "data" / "corpus" / "en-shakespeare.txt"
    )
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "shakespeare-char.toml")
    parser.add_argument("--cores", default="0,1", help="nanoGPT's core and liandan's (default 0,1)")
    parser.add_argument("--setting", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                        help="a setting for liandan's run, repeatable")  # fmt: skip
    parser.add_argument("--target", type=float, help="liandan alone, against this train loss (no nanoGPT run)")
    args = parser.parse_args()
    nanogpt_core, liandan_core = (int(c) for c in args.cores.split(","))
    with tempfile.TemporaryDirectory(prefix="nanogpt-speedrun-") as tmp:
        root = Path(tmp)
        store = liandan_store(args.config, args.corpus, root)
        nanogpt = None
        if args.target is None:
            work = nanogpt_copy(args.nanogpt.resolve(), args.corpus, root)
            command = [*pinned(nanogpt_core), sys.executable, *NANOGPT_COMMAND, f"--out_dir={root / 'nanogpt-out'}"]
            nanogpt_start = time.time()
            nanogpt = subprocess.Popen(command, cwd=work, env=single_thread_env(PYTHONUNBUFFERED="1"),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
            nanogpt_lines: list[tuple[float, str]] = []  # (arrival time, line): nanoGPT prints no times
            nanogpt_exit: list[float] = []  # when it exited, maybe long before liandan

            def read_nanogpt() -> None:
                nanogpt_lines.extend((time.time(), line) for line in nanogpt.stdout)
                nanogpt.wait()
                nanogpt_exit.append(time.time())

            reader = threading.Thread(target=read_nanogpt)
            reader.start()
        command = [*pinned(liandan_core), sys.executable, "-m", "liandan.cli", "train", str(args.config), "--data.paths=[]", f'--data.stores=["{store}"]',
                   f"--run.output_dir={root}", "--run.name=liandan", *args.setting]  # fmt: skip
        liandan_start = time.time()
        liandan = subprocess.Popen(command, env=single_thread_env(PYTHONPATH=str(REPO / "src")), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)  # fmt: skip
        liandan_out = liandan.communicate()[0]
        liandan_end = time.time()
        if liandan.returncode:
            raise SystemExit(f"liandan exited {liandan.returncode}:\n{liandan_out[-3000:]}")
        if nanogpt is not None:
            reader.join()
            nanogpt_seconds = nanogpt_exit[0] - nanogpt_start
            target, iteration_ms = nanogpt_result("".join(line for _, line in nanogpt_lines))
            print(f"nanoGPT: final train loss {target:.4f} in {nanogpt_seconds:.1f}s wall "
                  f"({statistics.median(iteration_ms):.1f} ms per iteration, median)")  # fmt: skip
        else:
            target, nanogpt_seconds = args.target, None
        summary = json.loads((root / "liandan" / "summary.json").read_text())
        step_ms = 1000 * summary["seconds"] / max(summary["steps"], 1)
        print(f"liandan: {summary['steps']} steps in {liandan_end - liandan_start:.1f}s wall "
              f"({step_ms:.1f} ms per step, loop mean), final train loss {summary['final_loss_smoothed']:.4f} (smoothed)")  # fmt: skip
        rows = step_rows(root / "liandan" / "metrics.jsonl")
        startup = rows[0]["time"] - rows[0]["step_time_s"] - liandan_start
        print(f"liandan: launch to its first step {startup:.1f}s (start-up: imports, data, model, preflight)")
        reached = time_to_reach(rows, target, liandan_start)
        if reached is None:
            print(f"liandan did not reach {target:.4f} (mean of {WINDOW} steps)")
            return
        step, seconds = reached
        line = f"liandan reached {target:.4f} (mean of its last {WINDOW} steps' loss) at step {step}, {seconds:.1f}s after launch"
        if nanogpt_seconds is not None:
            line += f": {seconds / nanogpt_seconds:.2f}x nanoGPT's wall time"
        print(line)
        if nanogpt_seconds is not None:
            same_window(nanogpt_lines, rows, liandan_start + seconds)


def same_window(nanogpt_lines: list[tuple[float, str]], rows: list[dict], reached_at: float) -> None:
    """What nanoGPT did while liandan ran, under the same load from the rest of the machine: its iteration
    when liandan reached the target, and both per-step times from liandan's first step to that moment."""
    iterations = [(at, int(m.group(1)), float(m.group(2))) for at, line in nanogpt_lines
                  if (m := re.match(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", line))]  # fmt: skip
    first = rows[0]["time"]
    done = [it for at, it, _ in iterations if at <= reached_at]
    window = [ms for at, it, ms in iterations if first <= at <= reached_at and it > 0]
    steps = [1000 * row["step_time_s"] for row in rows if first <= row["time"] <= reached_at]
    if not done or not window:
        return
    print(f"when liandan reached it, nanoGPT was at iteration {done[-1]} of {iterations[-1][1]} "
          f"({done[-1] / iterations[-1][1]:.2f} of its run)")  # fmt: skip
    print(f"meanwhile: nanoGPT {statistics.median(window):.1f} ms per iteration, liandan {statistics.median(steps):.1f} ms "
          f"per step (medians): {statistics.median(steps) / statistics.median(window):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
