"""Small shared builders for tests: a corpus written from Python's own documentation, a tiny run config,
`liandan` run as a subprocess, and what a run directory holds."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from liandan.config import Config, load_config
from liandan.run import RunDir

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_corpus(directory: Path, n_docs: int = 40) -> Path:
    """A .jsonl of real English prose: language-reference topics that ship with Python."""
    from pydoc_data.topics import topics

    names = sorted(topics)[:n_docs]
    path = directory / "corpus.jsonl"
    with path.open("w") as handle:
        for name in names:
            handle.write(json.dumps({"id": name, "text": topics[name]}) + "\n")
    return path


# The smallest model worth training in a test: a trial or a forecast run is mostly process start-up.
MICRO_MODEL = [
    "--model.dim=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--model.max_seq_len=32",
    "--train.seq_len=32",
    "--train.global_batch=8",
]


def tiny_config(run_dir: Path, corpus: Path, *overrides: str) -> Config:
    return load_config(
        None,
        [
            f"--run.output_dir={run_dir}",
            "--run.name=run",
            "--model.dim=64",
            "--model.n_layers=2",
            "--model.n_heads=4",
            "--model.n_kv_heads=2",
            "--model.max_seq_len=64",
            "--train.steps=6",
            "--train.global_batch=4",
            "--train.seq_len=64",
            "--train.dtype=fp32",
            "--schedule.warmup_steps=2",
            "--data.tokenizer=byte",
            f'--data.paths=["{corpus}"]',
            *overrides,
        ],
    )


def run_liandan(
    *args, timeout: float = 600, env: dict[str, str] | None = None, check: bool = False, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m liandan.cli ARGS...` in a subprocess, its output captured as text; `env` replaces the
    environment (None: this process's). With `check`, a non-zero exit raises CalledProcessError."""
    return subprocess.run(
        [sys.executable, "-m", "liandan.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=env, check=check, cwd=cwd,
    )  # fmt: skip


@dataclass
class RunRecords:
    """What a run directory holds, read through `liandan.run.RunDir`."""

    path: Path
    metrics: list[dict]
    events: list[dict]
    summary: dict

    def of_kind(self, kind: str) -> list[dict]:
        """The events of one kind, in order."""
        return [e for e in self.events if e["kind"] == kind]


def read_run(run_dir: Path | str) -> RunRecords:
    """A run directory's metrics, events and summary (empty where a file is missing)."""
    run = RunDir.of(run_dir)
    return RunRecords(run.path, run.read_metrics(), run.read_events(), run.read_summary())
