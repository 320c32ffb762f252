"""The writers of the run store: rank 0 while it trains (`StoreLogger`, one of its loggers) and the supervisor
after it records an incident, a restart or the end of a run (`ingest_quietly`). The store is an index of the
run's files: neither ever fails a run on its account."""

from __future__ import annotations

import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from liandan.run import RunDir
from liandan.track.store import INCIDENT_KINDS, RunStore, StoreError


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StoreLogger:
    """Keeps the project's run store up to date while a run trains (rank 0): after the JSON-lines logger has
    written a step or an event, the store ingests what is new, at once after an incident, else at most every
    `every_s` seconds, and at the end. When the store cannot be written (a locked or full disk), one warning
    says so and training goes on, the files unaffected."""

    def __init__(self, run_dir: Path | RunDir, every_s: float = 2.0, warn: Callable[[str], None] = _to_stderr):
        self.room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        self.every_s = every_s
        self.warn = warn
        self._last = 0.0
        self._store: RunStore | None = None
        self._failed = False
        self.flush()

    def flush(self) -> None:
        """Ingest what the run's files hold now."""
        if self._failed:
            return
        try:
            if self._store is None:
                self._store = RunStore.of_run(self.room)
            self._store.ingest(self.room)
            self._last = time.monotonic()
        except (StoreError, sqlite3.Error, OSError, ValueError) as err:  # ValueError: a file it cannot take
            self._failed = True
            self.warn(f"warning: the run store is not updated from now on (the run's files are): {err}")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def log_event(self, kind: str, **fields: Any) -> None:
        if kind in INCIDENT_KINDS or time.monotonic() - self._last >= self.every_s:
            self.flush()

    def close(self) -> None:
        """Ingest what is new and let the store go; a later close (after a file written once the other
        loggers closed, as the summary is) opens it again for one more ingest."""
        self.flush()
        if self._store is not None:
            self._store.close()
            self._store = None


def ingest_quietly(run_dir: Path | RunDir) -> str | None:
    """Ingest one run into its project's store for a writer that must not fail on the store's account (the
    supervisor after an incident, the trainer after its summary); returns the error in one line, or None."""
    try:
        with RunStore.of_run(run_dir) as store:
            store.ingest(run_dir)
    except (StoreError, sqlite3.Error, OSError, ValueError) as err:
        return f"run store not updated: {err}"
    return None
