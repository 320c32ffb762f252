"""The training loop of two liandan source trees against each other: the same run trained by each, in
alternation, with the loop's own time (`seconds` in summary.json: from the first step to the last, set-up
excluded) compared pair by pair. For checking that a change to the loop costs no speed.

    git worktree add /tmp/liandan-before <commit>
    python benchmarks/loop_before_after.py --before /tmp/liandan-before --after . --pairs 5

Each run is a fresh `python -m liandan.cli train` process with the chosen tree's `src/` first on the path,
on the shipped tiny config made smaller (see RUN), fp32, no checkpoints, one process. The ratio printed is
after/before loop seconds per pair (below 1: the change is faster), with its median and range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = [
    "--model.dim=128",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.max_seq_len=128",
    "--train.seq_len=128",
    "--train.global_batch=8",
    "--train.dtype=fp32",
    "--train.eval_every=0",
    "--checkpoint.every=0",
    "--resilience.supervise=false",
    "--data.tokenizer=byte",
]


def corpus(directory: Path) -> Path:
    from pydoc_data.topics import topics

    path = directory / "corpus.jsonl"
    with path.open("w") as handle:
        for name in sorted(topics)[:200]:
            handle.write(json.dumps({"id": name, "text": topics[name]}) + "\n")
    return path


def loop_seconds(tree: Path, run_dir: Path, data: Path, steps: int, extra: list[str] = ()) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    config = tree / "configs" / "tiny.toml"
    command = [sys.executable, "-m", "liandan.cli", "train", str(config), *RUN, f"--train.steps={steps}",
               f"--run.output_dir={run_dir.parent}", f"--run.name={run_dir.name}", f'--data.paths=["{data}"]', *extra]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the source tree before the change")
    parser.add_argument("--after", type=Path, required=True, help="the source tree after the change")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--after-setting", action="append", default=[], metavar="--SECTION.KEY=VALUE",
                        help="a setting for the after tree's runs only, repeatable (e.g. to leave out callbacks the before tree"
                        " lacks, and time the loop alone)")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = corpus(root)
        ratios, seconds = [], {"before": [], "after": []}
        for i in range(args.pairs + 1):  # the first pair warms the caches and is not counted
            pair = {}
            for name, tree in (("before", args.before), ("after", args.after)):
                extra = args.after_setting if name == "after" else []
                pair[name] = loop_seconds(tree.resolve(), root / f"{name}-{i}", data, args.steps, extra)
            if i:
                ratios.append(pair["after"] / pair["before"])
                for name, value in pair.items():
                    seconds[name].append(value)
                print(f"pair {i}: before {pair['before']:.2f}s  after {pair['after']:.2f}s  ratio {ratios[-1]:.3f}")
    print(f"loop seconds for {args.steps} steps, median: before {statistics.median(seconds['before']):.2f}, "
          f"after {statistics.median(seconds['after']):.2f}")  # fmt: skip
    print(f"after/before: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
