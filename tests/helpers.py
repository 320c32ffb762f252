"""Small shared builders for tests: a corpus written from Python's own documentation and a tiny run config."""

from __future__ import annotations

import json
from pathlib import Path

from liandan.config import Config, load_config

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


def fill_disk(path: Path) -> Path:
    """Write zeros into the file `path` until its file system is full (a real ENOSPC); returns the path."""
    import errno

    chunk = bytes(64 << 10)
    with open(path, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)  # short writes fill the last pages; the write after them fails
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    return path
