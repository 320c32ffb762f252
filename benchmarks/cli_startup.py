"""Start-up time of the read-only CLI commands, each as a whole process: interpreter start, imports, the
command's work, exit. What a person waits for when they type `liandan --help`.

    python benchmarks/cli_startup.py                 # 7 runs of each command
    python benchmarks/cli_startup.py --runs 11
    PYTHONPATH=/other/checkout/src python benchmarks/cli_startup.py   # the same figures for another checkout

Commands: `liandan --help`, `liandan config --keys`, `liandan runs <an empty directory>`, each started as
`python -m liandan.cli ...` with this interpreter and this environment (PYTHONPATH included), stdout and
stderr discarded. The first, untimed round warms the file system cache, so every timed run reads the same
cached files. Runs of the commands interleave, so a load spike from another process is shared rather than
landing on one command. Prints the minimum and the median of each command's wall seconds, and the
machine's load (`os.getloadavg`) before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def commands(empty_dir: str) -> dict[str, list[str]]:
    return {
        "liandan --help": ["--help"],
        "liandan config --keys": ["config", "--keys"],
        "liandan runs <empty dir>": ["runs", empty_dir],
    }


def time_once(args: list[str]) -> float:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "liandan.cli", *args], capture_output=True, check=False)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"liandan {' '.join(args)} failed ({done.returncode}): {done.stderr.decode()[-500:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each command (default 7)")
    args = parser.parse_args()
    import liandan

    print(f"liandan from {os.path.dirname(liandan.__file__)}")
    print("load average before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    with tempfile.TemporaryDirectory() as empty_dir:
        timed = commands(empty_dir)
        for argv in timed.values():  # untimed: the file system cache
            time_once(argv)
        seconds: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.runs):
            for name, argv in timed.items():
                seconds[name].append(time_once(argv))
    print("load average after:  {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    print(f"{'command':28s} {'min s':>7s} {'median s':>9s}  ({args.runs} runs)")
    for name, values in seconds.items():
        print(f"{name:28s} {min(values):7.2f} {statistics.median(values):9.2f}")


if __name__ == "__main__":
    main()
