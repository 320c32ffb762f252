"""The run store: one SQLite database per project directory (`<project>/liandan.db`, beside the run
directories) that indexes every run's files — resolved config, metrics per step, events (incidents,
checkpoints, evaluations, forecasts) and summary — so that runs can be listed, compared and charted without
reading every JSON-lines file again.

The run directories stay the source of truth. The store ingests them incrementally: for each file it keeps
the byte offset it has read up to and a hash of the bytes just before it, and each ingest reads only the
complete lines written since, in one transaction with the new offset. So a writer killed mid-transaction
loses nothing committed (SQLite's write-ahead log rolls the rest back) and the next ingest reads those lines
again; several processes may ingest the same run at once (rank 0 while it trains, the supervisor after an
incident, the dashboard on a request): `BEGIN IMMEDIATE` serialises them and the offsets make a second read of
the same lines a no-op. A file rewritten under the store (a resume drops the metrics of steps it trains again)
no longer matches its hash and is read again from its start. `rebuild` makes the whole index anew from the
files; a database that is not one any more is put aside and rebuilt.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from liandan.config import ConfigError, read_toml
from liandan.run import RunDir, holder_running, parse_line, project_store

SCHEMA_VERSION = 1
_TAIL = 256  # bytes before the offset whose hash tells a grown file from a rewritten one
_STALE_S = 600.0  # a run of another host whose files have not changed for this long is no longer running

# Events that interrupted or changed the course of a run, marked on its curves.
INCIDENT_KINDS = ("incident", "restart", "gave_up", "preempted", "rollback", "too_good", "nonfinite_loss",
                  "checkpoint_failed", "checkpoint_rejected", "node_excluded", "sdc", "straggler", "device_fault",
                  "train_stopped", "guard", "doctor")  # fmt: skip
EVAL_KINDS = ("eval", "eval_task", "eval_heldout")
CHECKPOINT_KINDS = ("checkpoint_saved", "checkpoint_failed", "checkpoint_rejected")
X_AXES = ("step", "tokens", "flops", "time")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    config TEXT,
    summary TEXT,
    status TEXT NOT NULL DEFAULT 'unknown',
    started REAL,
    updated REAL,
    last_step INTEGER,
    tokens_per_step INTEGER,
    flops_per_token REAL
);
CREATE TABLE IF NOT EXISTS metrics (
    run TEXT NOT NULL, key TEXT NOT NULL, step INTEGER NOT NULL, value REAL,
    PRIMARY KEY (run, key, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    run TEXT NOT NULL, seq INTEGER NOT NULL, time REAL, kind TEXT NOT NULL, step INTEGER, body TEXT NOT NULL,
    PRIMARY KEY (run, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_by_kind ON events (run, kind);
CREATE TABLE IF NOT EXISTS files (
    run TEXT NOT NULL, file TEXT NOT NULL, offset INTEGER NOT NULL, tail TEXT NOT NULL,
    PRIMARY KEY (run, file)
) WITHOUT ROWID;
"""


class StoreError(RuntimeError):
    """The run store cannot be used (a read-only or full disk, say); the run's own files are unaffected."""


def is_run_dir(path: Path) -> bool:
    room = RunDir(Path(path))
    return path.is_dir() and any(p.is_file() for p in (room.config, room.metrics, room.events))


class RunStore:
    """The run store of one project directory. Open with `RunStore(project)` or `RunStore.of_run(run_dir)`;
    `ingest(run_dir)` brings one run up to date with its files, `sync()` every run of the project."""

    def __init__(self, project: Path | str, *, timeout_s: float = 30.0):
        self.project = Path(project)
        self.path = project_store(self.project)
        self.timeout_s = timeout_s
        self._db = self._open()

    @classmethod
    def of_run(cls, run_dir: Path | str | RunDir) -> RunStore:
        room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        return cls(room.project)

    # -- opening ---------------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        try:
            return self._connect()
        except sqlite3.DatabaseError as err:
            if isinstance(err, sqlite3.OperationalError):
                raise StoreError(f"cannot open the run store {self.path}: {err}") from None
        # Not a database (any more): the files are the source of truth, so set it aside and start anew.
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        for suffix in ("", "-wal", "-shm"):
            src = Path(f"{self.path}{suffix}")
            if src.exists():
                os.replace(src, f"{aside}{suffix}")
        db = self._connect()
        self._rebuild_all(db)
        return db

    def _connect(self) -> sqlite3.Connection:
        self.project.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False)
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self.timeout_s * 1000)}")
            if db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise StoreError(f"the run store {self.path} cannot use write-ahead logging on this file system")
            # In WAL mode NORMAL loses nothing committed when a process dies, only on a power cut.
            db.execute("PRAGMA synchronous = NORMAL")
            with _transaction(db):
                for statement in _statements():
                    db.execute(statement)
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            found = int(db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()[0])
            if found != SCHEMA_VERSION:
                raise StoreError(f"the run store {self.path} has schema {found}, this liandan reads"
                                 f" {SCHEMA_VERSION}: run `liandan runs --rebuild {self.project}`")  # fmt: skip
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------------------------
    def ingest(self, run_dir: Path | str | RunDir) -> int:
        """Bring one run up to date with its files; returns how many new records were read."""
        room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        name = room.name
        try:
            with _transaction(self._db, immediate=True):
                return self._ingest(self._db, room, name)
        except sqlite3.OperationalError as err:
            raise StoreError(f"run store {self.path}: {err}") from None

    def sync(self) -> list[str]:
        """Ingest every run directory of the project; returns their names."""
        names = []
        for path in self.run_dirs():
            self.ingest(path)
            names.append(path.name)
        return names

    def rebuild(self) -> list[str]:
        """Forget everything and index every run directory of the project again from its files."""
        try:
            return self._rebuild_all(self._db)
        except sqlite3.OperationalError as err:
            raise StoreError(f"run store {self.path}: {err}") from None

    def run_dirs(self) -> list[Path]:
        if not self.project.is_dir():
            return []
        return sorted(p for p in self.project.iterdir() if is_run_dir(p))

    def _rebuild_all(self, db: sqlite3.Connection) -> list[str]:
        names = []
        with _transaction(db, immediate=True):
            for table in ("runs", "metrics", "events", "files"):
                db.execute(f"DELETE FROM {table}")
            for path in self.run_dirs():
                self._ingest(db, RunDir(path), path.name)
                names.append(path.name)
        return names

    def _ingest(self, db: sqlite3.Connection, room: RunDir, name: str) -> int:
        if db.execute("SELECT 1 FROM runs WHERE name = ?", (name,)).fetchone() is None:
            db.execute("INSERT INTO runs (name, path) VALUES (?, ?)", (name, str(room.path.resolve())))
        new = 0
        for record, _ in self._new_records(db, name, room.metrics, forget="metrics"):
            step = record.get("step")
            if not isinstance(step, int):
                continue
            rows = [(name, key, step, _number(value)) for key, value in record.items() if key != "step"]
            db.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?)", [r for r in rows if r[3] is not _SKIP])
            new += 1
        for record, seq in self._new_records(db, name, room.events, forget="events"):
            kind = record.get("kind")
            if not isinstance(kind, str):
                continue
            step = record.get("step") if isinstance(record.get("step"), int) else None
            when = record.get("time") if isinstance(record.get("time"), (int, float)) else None
            db.execute("INSERT OR REPLACE INTO events VALUES (?, ?, ?, ?, ?, ?)",
                       (name, seq, when, kind, step, json.dumps(record, allow_nan=False, default=str)))  # fmt: skip
            new += 1
        self._update_run(db, room, name)
        return new

    def _new_records(self, db: sqlite3.Connection, name: str, path: Path, forget: str) -> Iterator[tuple[dict, int]]:
        """The complete lines of `path` written since the last ingest, with the byte offset of each; the
        offset row moves past them in the same transaction."""
        row = db.execute("SELECT offset, tail FROM files WHERE run = ? AND file = ?", (name, path.name)).fetchone()
        offset, tail = (row[0], row[1]) if row else (0, "")
        try:
            with path.open("rb") as handle:
                if offset and _tail_hash(handle, offset) != tail:
                    # Rewritten under us (a resume dropped the steps it trains again): read it all again.
                    db.execute(f"DELETE FROM {forget} WHERE run = ?", (name,))
                    offset = 0
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            if offset:
                db.execute(f"DELETE FROM {forget} WHERE run = ?", (name,))
                db.execute("DELETE FROM files WHERE run = ? AND file = ?", (name, path.name))
            return
        end = data.rfind(b"\n") + 1
        if end == 0:
            return
        position = offset
        for line in data[:end].split(b"\n")[:-1]:
            record = parse_line(line.decode("utf-8", errors="replace"))
            if record is not None:
                yield record, position
            position += len(line) + 1
        with path.open("rb") as handle:
            new_tail = _tail_hash(handle, offset + end)
        db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)", (name, path.name, offset + end, new_tail))

    def _update_run(self, db: sqlite3.Connection, room: RunDir, name: str) -> None:
        config = _read_text(room.config)
        summary = room.read_summary() if room.summary.is_file() else None
        tokens_per_step = _tokens_per_step(room.config) if config else None
        start = db.execute("SELECT MIN(time) FROM events WHERE run = ?", (name,)).fetchone()[0]
        last = db.execute("SELECT MAX(step) FROM metrics WHERE run = ? AND key = 'time'", (name,)).fetchone()[0]
        flops = (summary or {}).get("flops_per_token")
        if flops is None:
            found = db.execute("SELECT body FROM events WHERE run = ? AND kind = 'train_start' AND body LIKE"
                               " '%flops_per_token%' ORDER BY seq DESC LIMIT 1", (name,)).fetchone()  # fmt: skip
            flops = json.loads(found[0]).get("flops_per_token") if found else None
        db.execute(
            "UPDATE runs SET path = ?, config = ?, summary = ?, status = ?, started = ?, updated = ?, last_step = ?,"
            " tokens_per_step = ?, flops_per_token = ? WHERE name = ?",
            (str(room.path.resolve()), config, json.dumps(summary) if summary is not None else None,
             self._status(db, room, name, summary), start, _newest_change(room), last, tokens_per_step, flops,
             name),
        )  # fmt: skip

    def _status(self, db: sqlite3.Connection, room: RunDir, name: str, summary: dict | None) -> str:
        ended = {k for (k,) in db.execute("SELECT DISTINCT kind FROM events WHERE run = ? AND kind IN"
                                           " ('gave_up', 'preempted', 'train_stopped')", (name,))}  # fmt: skip
        alive = holder_running(room)
        if alive is None:  # another host's run: judge by how recently its files changed
            alive = summary is None and time.time() - _newest_change(room) < _STALE_S
        if alive:
            return "running"
        if summary is not None and not summary.get("gave_up"):
            return "stopped" if "train_stopped" in ended else "finished"
        if "gave_up" in ended or (summary or {}).get("gave_up"):
            return "gave up"
        if "preempted" in ended:
            return "preempted"
        return "stopped" if "train_stopped" in ended else "interrupted"

    # -- reading ---------------------------------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        """Every run the store knows, newest first: name, path, status, steps, tokens, goodput, the final or
        latest loss and the latest forecast."""
        rows = self._db.execute("SELECT name FROM runs ORDER BY COALESCE(started, 0) DESC, name").fetchall()
        return [self.run(name) for (name,) in rows]

    def run(self, name: str) -> dict[str, Any]:
        """One run's row; KeyError when the store has no run of that name."""
        row = self._db.execute(
            "SELECT name, path, config, summary, status, started, updated, last_step, tokens_per_step,"
            " flops_per_token FROM runs WHERE name = ?", (name,)).fetchone()  # fmt: skip
        if row is None:
            raise KeyError(name)
        name, path, config, summary, status, started, updated, last, per_step, flops = row
        summary = json.loads(summary) if summary else {}
        loss = self._db.execute("SELECT value FROM metrics WHERE run = ? AND key = 'loss' AND value IS NOT NULL"
                                " ORDER BY step DESC LIMIT 1", (name,)).fetchone()  # fmt: skip
        forecast = self.events(name, ("forecast",), newest=1)
        incidents = len(self.incidents(name))
        return {
            "name": name, "path": path, "status": status, "started": started, "updated": updated,
            "step": last, "tokens": (last or 0) * per_step if per_step else summary.get("tokens"),
            "tokens_per_step": per_step, "flops_per_token": flops, "loss": loss[0] if loss else None,
            "final_loss": summary.get("final_loss"), "val_loss": summary.get("val_loss"),
            "goodput": summary.get("goodput"), "restarts": summary.get("restarts"), "incidents": incidents,
            "forecast": forecast[0] if forecast else None, "summary": summary, "config": config or "",
        }  # fmt: skip

    def metric_keys(self, name: str) -> list[str]:
        return [k for (k,) in self._db.execute("SELECT DISTINCT key FROM metrics WHERE run = ? ORDER BY key", (name,))]

    def curve(
        self,
        name: str,
        key: str,
        x: str = "step",
        start: int | None = None,
        end: int | None = None,
        max_points: int | None = None,
    ) -> dict[str, list]:
        """One metric of one run against `x` (step, tokens, flops or time), steps `start`..`end` inclusive.
        With `max_points`, longer curves come back as that many buckets of consecutive steps: their mean in
        `y` and their extremes in `low` and `high`, so a spike survives the thinning."""
        if x not in X_AXES:
            raise ValueError(f"x must be one of {', '.join(X_AXES)}, not {x!r}")
        lo = -(2**62) if start is None else int(start)
        hi = 2**62 if end is None else int(end)
        args = (name, key, lo, hi)
        where = "run = ? AND key = ? AND step BETWEEN ? AND ?"
        count, first, last = self._db.execute(
            f"SELECT COUNT(*), MIN(step), MAX(step) FROM metrics WHERE {where}",
            args,
        ).fetchone()
        if max_points and count > max_points:
            width = max(1, math.ceil((last - first + 1) / max_points))
            rows = self._db.execute(
                f"SELECT MIN(step), AVG(value), MIN(value), MAX(value) FROM metrics WHERE {where}"
                f" GROUP BY (step - ?) / ? ORDER BY 1", (*args, first, width)).fetchall()  # fmt: skip
        else:
            rows = self._db.execute(
                f"SELECT step, value, value, value FROM metrics WHERE {where} ORDER BY step",
                args,
            ).fetchall()
        steps = [r[0] for r in rows]
        return {"step": steps, "x": self._x(name, x, steps), "y": [r[1] for r in rows],
                "low": [r[2] for r in rows], "high": [r[3] for r in rows]}  # fmt: skip

    def _x(self, name: str, x: str, steps: list[int]) -> list[float] | list[int]:
        if x == "step":
            return steps
        if x == "time":
            times = dict(self._db.execute("SELECT step, value FROM metrics WHERE run = ? AND key = 'time'", (name,)))
            return [times.get(s) for s in steps]
        per_step, flops = self._db.execute(
            "SELECT tokens_per_step, flops_per_token FROM runs WHERE name = ?", (name,)
        ).fetchone() or (None, None)
        if not per_step or (x == "flops" and not flops):
            raise ValueError(f"run {name} does not record its {'FLOPs' if x == 'flops' else 'tokens'} per step")
        scale = per_step * (flops if x == "flops" else 1)
        return [s * scale for s in steps]

    def events(self, name: str, kinds: Iterable[str] | None = None, newest: int | None = None) -> list[dict]:
        """A run's events (oldest first; with `newest`, only that many of the newest), each the record of
        events.jsonl with its `seq` (its place in the file, a stable id)."""
        kinds = tuple(kinds) if kinds is not None else None
        sql = "SELECT seq, body FROM events WHERE run = ?"
        args: tuple = (name,)
        if kinds is not None:
            sql += f" AND kind IN ({_marks(kinds)})"
            args += kinds
        if newest is not None:
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, int(newest))).fetchall()[::-1]
        else:
            rows = self._db.execute(sql + " ORDER BY seq", args).fetchall()
        return [{**json.loads(body), "seq": seq} for seq, body in rows]

    def event(self, name: str, seq: int) -> dict | None:
        row = self._db.execute("SELECT body FROM events WHERE run = ? AND seq = ?", (name, int(seq))).fetchone()
        return {**json.loads(row[0]), "seq": int(seq)} if row else None

    def incidents(self, name: str) -> list[dict]:
        """The events that interrupted or changed the run: failures, restarts, rollbacks, skipped updates,
        silent data corruption, stragglers, preemptions, doctor findings (a clean preflight is none)."""
        return [e for e in self.events(name, INCIDENT_KINDS) if is_incident(e)]

    def checkpoints(self, name: str) -> list[dict]:
        """Saved, failed and rejected checkpoints, each with `present`: whether its directory is still there."""
        found = self.events(name, CHECKPOINT_KINDS)
        path = self._db.execute("SELECT path FROM runs WHERE name = ?", (name,)).fetchone()
        where = RunDir.from_saved_config(path[0]).checkpoints if path else None
        for e in found:
            # Paths are as the run saw them, often relative to where it was started.
            saved = Path(e.get("path") or "")
            e["present"] = bool(e.get("path")) and (
                saved.is_dir() or (where is not None and (where / saved.name).is_dir())
            )
        return found

    def evaluations(self, name: str) -> list[dict]:
        return self.events(name, EVAL_KINDS)

    def forecasts(self, name: str) -> list[dict]:
        return self.events(name, ("forecast",))


def is_incident(event: dict) -> bool:
    kind = event.get("kind")
    if kind == "doctor":
        return not event.get("ok") or bool(event.get("warnings"))
    if kind == "guard":  # a rollback's own event tells it; the guard's verdict is the incident otherwise
        return event.get("action") != "rollback"
    return kind in INCIDENT_KINDS


_SKIP = object()


def _number(value: Any) -> Any:
    """A metric value as SQLite keeps it: numbers as they are (non-finite ones, written as null, as NULL);
    anything else is not a metric."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _SKIP
    return value if math.isfinite(value) else None


def _tail_hash(handle, offset: int) -> str:
    begin = max(0, offset - _TAIL)
    handle.seek(begin)
    return xxhash.xxh64_hexdigest(handle.read(offset - begin))


def _tokens_per_step(config: Path) -> int | None:
    try:
        train = read_toml(config).get("train", {})
        return int(train["global_batch"]) * int(train["seq_len"])
    except (ConfigError, KeyError, TypeError, ValueError, AttributeError):
        return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _newest_change(room: RunDir) -> float:
    times = [p.stat().st_mtime for p in (room.metrics, room.events, room.summary) if p.is_file()]
    return max(times, default=0.0)


def _marks(items: tuple) -> str:
    return ", ".join("?" * len(items))


def _statements() -> list[str]:
    return [s.strip() for s in _SCHEMA.split(";") if s.strip()]


@contextmanager
def _transaction(db: sqlite3.Connection, immediate: bool = False) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


class StoreLogger:
    """Keeps the project's run store up to date while a run trains (rank 0): after the JSON-lines logger has
    written a step or an event, the store ingests what is new, at most every `every_s` seconds and at the end.
    The store is an index: when it cannot be written (a locked or full disk), one warning says so and training
    goes on, the files unaffected."""

    def __init__(self, run_dir: Path | RunDir, every_s: float = 2.0):
        self.room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        self.every_s = every_s
        self._last = 0.0
        self._store: RunStore | None = None
        self._failed = False
        self._update()

    def _update(self) -> None:
        if self._failed:
            return
        try:
            if self._store is None:
                self._store = RunStore.of_run(self.room)
            self._store.ingest(self.room)
            self._last = time.monotonic()
        except (StoreError, sqlite3.Error, OSError) as err:
            self._failed = True
            import warnings

            warnings.warn(f"run store not updated from now on (the run's files are): {err}", stacklevel=3)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self._update()

    def log_event(self, kind: str, **fields: Any) -> None:
        if kind in INCIDENT_KINDS or time.monotonic() - self._last >= self.every_s:
            self._update()

    def close(self) -> None:
        self._update()
        if self._store is not None:
            self._store.close()
            self._store = None


def ingest_quietly(run_dir: Path | RunDir) -> str | None:
    """Ingest one run into its project's store for a writer that must not fail on the store's account (the
    supervisor after an incident); returns the error in one line, or None."""
    try:
        with RunStore.of_run(run_dir) as store:
            store.ingest(run_dir)
    except (StoreError, sqlite3.Error, OSError) as err:
        return f"run store not updated: {err}"
    return None
