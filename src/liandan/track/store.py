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

import contextlib
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from liandan.config import ConfigError
from liandan.run import RunDir, dumps_json, holder_running, project_store
from liandan.track.store_db import (
    SCHEMA_VERSION,
    TABLES,
    locked,
    marks,
    nothing,
    one_at_a_time,
    readable,
    schema_version,
    statements,
    transaction,
)
from liandan.track.store_files import (
    SKIP,
    is_int,
    newest_change,
    number,
    positive,
    read_new,
    read_text,
    real,
    tokens_per_step,
)

_STALE_S = 600.0  # a run of another host whose files have not changed for this long is no longer running

# Events that interrupted or changed the course of a run, marked on its curves.
INCIDENT_KINDS = ("incident", "restart", "gave_up", "preempted", "rollback", "too_good", "nonfinite_loss",
                  "checkpoint_failed", "checkpoint_rejected", "node_excluded", "sdc", "straggler", "device_fault",
                  "train_stopped", "guard", "doctor")  # fmt: skip
EVAL_KINDS = ("eval", "eval_task", "eval_heldout", "eval_sample", "eval_tax")
CHECKPOINT_KINDS = ("checkpoint_saved", "checkpoint_failed", "checkpoint_rejected")
# The events that start or end a stretch of training: the newest of them tells how the run stands.
LIFECYCLE_KINDS = ("train_start", "train_end", "train_stopped", "gave_up", "preempted", "supervisor_start",
                   "supervisor_end", "restart", "incident")  # fmt: skip
_ENDED = {"train_end": "finished", "gave_up": "gave up", "preempted": "preempted", "train_stopped": "stopped"}
X_AXES = ("step", "tokens", "flops", "time")


class StoreError(RuntimeError):
    """The run store cannot be used (a read-only or full disk, say); the run's own files are unaffected."""


def is_run_dir(path: Path) -> bool:
    room = RunDir(Path(path))
    return path.is_dir() and any(p.is_file() for p in (room.config, room.metrics, room.events))


class RunStore:
    """The run store of one project directory. Open with `RunStore(project)` or `RunStore.of_run(run_dir)`;
    `ingest(run_dir)` brings one run up to date with its files, `sync()` every run of the project."""

    def __init__(self, project: Path | str, *, timeout_s: float = 30.0, database: Path | None = None):
        """`database`: where the index is kept, for a project whose own `liandan.db` cannot be used (a
        read-only share); its runs are still those of `project`."""
        self.project = Path(project)
        self.path = Path(database) if database is not None else project_store(self.project)
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._db = self._open()

    @classmethod
    def of_run(cls, run_dir: Path | str | RunDir) -> RunStore:
        room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        return cls(room.project)

    # -- opening ---------------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        try:
            return self._connect()
        except sqlite3.OperationalError as err:
            raise StoreError(f"cannot open the run store {self.path}: {err}") from None
        except sqlite3.DatabaseError:
            return self._start_anew()

    def _start_anew(self, broken: bool = False) -> sqlite3.Connection:
        """Set a database that is not one any more aside and build a new one from the files (they are the
        source of truth). Several processes may find it broken at once: the first one sets it aside while it
        holds the project directory's lock, the others then find the new one."""
        with locked(self.path.parent):
            try:
                if not broken:
                    return self._connect()
            except sqlite3.OperationalError as err:
                raise StoreError(f"cannot open the run store {self.path}: {err}") from None
            except sqlite3.DatabaseError:
                pass
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside = next(a for n in range(1, 10**6) if not (a := self.path.with_name(
                f"{self.path.name}.corrupt-{stamp}" + (f"-{n}" if n > 1 else ""))).exists())  # fmt: skip
            for suffix in ("", "-wal", "-shm"):
                src = Path(f"{self.path}{suffix}")
                if src.exists():
                    os.replace(src, f"{aside}{suffix}")
            db = self._connect()
            self._rebuild_all(db)
            return db

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False)
        try:
            db.execute(f"PRAGMA busy_timeout = {int(self.timeout_s * 1000)}")
            if db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
                raise StoreError(f"the run store {self.path} cannot use write-ahead logging on this file system")
            # In WAL mode NORMAL loses nothing committed when a process dies, only on a power cut.
            db.execute("PRAGMA synchronous = NORMAL")
            if schema_version(db) != SCHEMA_VERSION:
                self._make_schema(db)
        except BaseException:
            db.close()
            raise
        return db

    def _make_schema(self, db: sqlite3.Connection) -> None:
        with transaction(db, immediate=True):  # another process may be making it at the same moment
            found = schema_version(db)
            if found == SCHEMA_VERSION:
                return
            if found is not None and found > SCHEMA_VERSION:
                raise StoreError(f"the run store {self.path} was made by a newer liandan (schema {found}, this one"
                                 f" reads {SCHEMA_VERSION}); upgrade, or remove the file to rebuild it")  # fmt: skip
            for table in TABLES if found is not None else ():  # an older index: made again from the files
                db.execute(f"DROP TABLE IF EXISTS {table}")
            for statement in statements():
                db.execute(statement)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            if found is not None:
                for path in self.run_dirs():
                    self._ingest(db, RunDir(path), RunDir(path).name)

    @one_at_a_time
    def close(self) -> None:
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------------------------
    @one_at_a_time
    def ingest(self, run_dir: Path | str | RunDir) -> int:
        """Bring one run up to date with its files; returns how many new records were read."""
        room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        if room.project != self.project.resolve():
            raise StoreError(f"{room.path} is not a run directory of {self.project}")
        with self._writing():
            return self._ingest(self._db, room, room.name)

    @one_at_a_time
    def sync(self) -> list[str]:
        """Ingest every run directory of the project and forget the runs whose directories are gone; returns
        the names of those that are there."""
        paths = self.run_dirs()
        with self._writing():
            for path in paths:
                self._ingest(self._db, RunDir(path), RunDir(path).name)
            present = {RunDir(p).name for p in paths}
            for (name,) in self._db.execute("SELECT name FROM runs").fetchall():
                if name not in present:
                    self._forget(self._db, name)
        return sorted(present)

    @one_at_a_time
    def rebuild(self) -> list[str]:
        """Forget everything and index every run directory of the project again from its files (a database
        that is not one any more is set aside first)."""
        try:
            with self._writing():
                return self._rebuild_all(self._db)
        except StoreError:
            if self.path.is_file() and readable(self.path):
                raise
        self._db.close()
        self._db = self._start_anew(broken=True)
        return [RunDir(p).name for p in self.run_dirs()]

    def run_dirs(self) -> list[Path]:
        """The run directories of the project: its subdirectories with a run's files. A link that leads out
        of the project is none of its runs."""
        if not self.project.is_dir():
            return []
        root = self.project.resolve()
        return sorted(p for p in self.project.iterdir() if p.resolve().parent == root and is_run_dir(p))

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        try:
            with transaction(self._db, immediate=True):
                yield
        except sqlite3.DatabaseError as err:
            hint = "" if isinstance(err, sqlite3.OperationalError) else "; `liandan runs --rebuild` makes it anew"
            raise StoreError(f"run store {self.path}: {err}{hint}") from None

    def _rebuild_all(self, db: sqlite3.Connection) -> list[str]:
        names = []
        with nothing() if db.in_transaction else transaction(db, immediate=True):
            for table in TABLES:
                db.execute(f"DELETE FROM {table}")
            for path in self.run_dirs():
                self._ingest(db, RunDir(path), RunDir(path).name)
                names.append(RunDir(path).name)
        return sorted(set(names))

    @staticmethod
    def _forget(db: sqlite3.Connection, name: str) -> None:
        for table, column in (("runs", "name"), ("metrics", "run"), ("events", "run"), ("files", "run")):
            db.execute(f"DELETE FROM {table} WHERE {column} = ?", (name,))

    def _ingest(self, db: sqlite3.Connection, room: RunDir, name: str) -> int:
        if db.execute("SELECT 1 FROM runs WHERE name = ?", (name,)).fetchone() is None:
            db.execute("INSERT INTO runs (name, path) VALUES (?, ?)", (name, str(room.path.resolve())))
        metrics = read_new(db, name, room.metrics, "metrics")
        rows = []
        for record, _ in metrics:
            step = record.get("step")
            if isinstance(step, int) and not isinstance(step, bool):
                rows += [(name, k, step, v) for k, value in record.items() if k != "step" and (v := number(value))
                         is not SKIP]  # fmt: skip
        db.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?)", rows)
        events = [
            (name, seq, real(r.get("time")), r["kind"], r.get("step") if is_int(r.get("step")) else None,
             dumps_json(r))
            for r, seq in read_new(db, name, room.events, "events") if isinstance(r.get("kind"), str)
        ]  # fmt: skip
        db.executemany("INSERT OR REPLACE INTO events VALUES (?, ?, ?, ?, ?, ?)", events)
        self._update_run(db, room, name)
        return len(metrics) + len(events)

    def _update_run(self, db: sqlite3.Connection, room: RunDir, name: str) -> None:
        config = read_text(room.config)
        summary = room.read_summary() if room.summary.is_file() else None
        start = db.execute("SELECT MIN(time) FROM events WHERE run = ?", (name,)).fetchone()[0]
        last = db.execute("SELECT MAX(step) FROM metrics WHERE run = ? AND key = 'time'", (name,)).fetchone()[0]
        # The newest start says what this run trains with; older runs' starts did not say: their config does.
        said = self._newest(db, name, ("train_start",))
        per_step = positive(said.get("tokens_per_step")) or (tokens_per_step(room.config) if config else None)
        flops = positive(said.get("flops_per_token")) or positive((summary or {}).get("flops_per_token"))
        db.execute(
            "UPDATE runs SET path = ?, config = ?, summary = ?, status = ?, started = ?, updated = ?, last_step = ?,"
            " tokens_per_step = ?, flops_per_token = ? WHERE name = ?",
            (str(room.path.resolve()), config, dumps_json(summary) if summary is not None else None,
             self._status(db, room, name, summary), start, newest_change(room), last, per_step, flops,
             name),
        )  # fmt: skip

    @staticmethod
    def _newest(db: sqlite3.Connection, name: str, kinds: tuple[str, ...]) -> dict:
        row = db.execute(f"SELECT body FROM events WHERE run = ? AND kind IN ({marks(kinds)}) ORDER BY seq DESC"
                         " LIMIT 1", (name, *kinds)).fetchone()  # fmt: skip
        return json.loads(row[0]) if row else {}

    def _status(self, db: sqlite3.Connection, room: RunDir, name: str, summary: dict | None) -> str:
        """running, finished, stopped (on an error a restart cannot mend: a bad config or input, checkpoints
        that were not being saved), gave up
        (the supervisor did), preempted, or interrupted (its process ended without a word: killed, crashed)."""
        newest = self._newest(db, name, LIFECYCLE_KINDS)
        kind = newest.get("kind")
        if kind == "supervisor_end":  # the supervisor's summary of how its workers' last stretch ended
            if newest.get("gave_up"):
                return "gave up"
            before = self._newest(db, name, tuple(k for k in LIFECYCLE_KINDS if k != "supervisor_end"))
            return _ENDED.get(before.get("kind"), "finished")
        if kind in _ENDED:
            return _ENDED[kind]
        if kind is None and summary is not None:  # a run from before events were kept
            return "finished"
        return "running" if _alive(room.path, newest_change(room)) else "interrupted"

    # -- reading ---------------------------------------------------------------------------------------------
    @one_at_a_time
    def runs(self) -> list[dict[str, Any]]:
        """Every run the store knows, newest first: name, path, status, steps, tokens, goodput, the final or
        latest loss and the latest forecast."""
        rows = self._db.execute("SELECT name FROM runs ORDER BY COALESCE(started, 0) DESC, name").fetchall()
        return [self.run(name) for (name,) in rows]

    @one_at_a_time
    def run(self, name: str) -> dict[str, Any]:
        """One run's row; KeyError when the store has no run of that name."""
        row = self._db.execute(
            "SELECT name, path, config, summary, status, started, updated, last_step, tokens_per_step,"
            " flops_per_token FROM runs WHERE name = ?", (name,)).fetchone()  # fmt: skip
        if row is None:
            raise KeyError(name)
        name, path, config, summary, status, started, updated, last, per_step, flops = row
        if status == "running" and not _alive(Path(path), updated or 0.0):  # it ended since it was last read
            status = "interrupted"
        summary = json.loads(summary) if summary else {}
        loss = self._db.execute("SELECT value FROM metrics WHERE run = ? AND key = 'loss' AND value IS NOT NULL"
                                " ORDER BY step DESC LIMIT 1", (name,)).fetchone()  # fmt: skip
        forecast = self.events(name, ("forecast",), newest=1)
        # A failure and the restart after it are one incident; restarts have their own count.
        incidents = sum(1 for e in self.incidents(name) if e["kind"] != "restart")
        return {
            "name": name, "path": path, "status": status, "started": started, "updated": updated,
            "step": last, "tokens": (last or 0) * per_step if per_step else summary.get("tokens"),
            "tokens_per_step": per_step, "flops_per_token": flops, "loss": loss[0] if loss else None,
            "final_loss": summary.get("final_loss"), "val_loss": summary.get("val_loss", self._newest_val(name)),
            "goodput": summary.get("goodput"), "restarts": summary.get("restarts"), "incidents": incidents,
            "forecast": forecast[0] if forecast else None, "summary": summary, "config": config or "",
        }  # fmt: skip

    def _newest_val(self, name: str) -> float | None:
        """The latest validation loss of a run still training (a finished one's is in its summary)."""
        newest = self.events(name, ("eval",), newest=1)
        loss = newest[0].get("loss") if newest else None
        return loss if isinstance(loss, (int, float)) and math.isfinite(loss) else None

    @one_at_a_time
    def metric_keys(self, name: str) -> list[str]:
        return [k for (k,) in self._db.execute("SELECT DISTINCT key FROM metrics WHERE run = ? ORDER BY key", (name,))]

    @one_at_a_time
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
        if max_points is not None and int(max_points) < 1:
            raise ValueError(f"max_points must be at least 1, not {max_points}")
        lo = -(2**62) if start is None else max(-(2**62), int(start))
        hi = 2**62 if end is None else min(2**62, int(end))
        args = (name, key, lo, hi)
        where = "run = ? AND key = ? AND step BETWEEN ? AND ?"
        count, first, last = self._db.execute(
            f"SELECT COUNT(*), MIN(step), MAX(step) FROM metrics WHERE {where}",
            args,
        ).fetchone()
        if max_points and count > max_points:
            width = max(1, math.ceil((last - first + 1) / int(max_points)))
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

    @one_at_a_time
    def events(self, name: str, kinds: Iterable[str] | None = None, newest: int | None = None) -> list[dict]:
        """A run's events (oldest first; with `newest`, only that many of the newest), each the record of
        events.jsonl with its `seq` (its place in the file, a stable id)."""
        kinds = tuple(kinds) if kinds is not None else None
        sql = "SELECT seq, body FROM events WHERE run = ?"
        args: tuple = (name,)
        if kinds is not None:
            sql += f" AND kind IN ({marks(kinds)})"
            args += kinds
        if newest is not None:
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?", (*args, int(newest))).fetchall()[::-1]
        else:
            rows = self._db.execute(sql + " ORDER BY seq", args).fetchall()
        return [{**json.loads(body), "seq": seq} for seq, body in rows]

    @one_at_a_time
    def event(self, name: str, seq: int) -> dict | None:
        row = self._db.execute("SELECT body FROM events WHERE run = ? AND seq = ?", (name, int(seq))).fetchone()
        return {**json.loads(row[0]), "seq": int(seq)} if row else None

    def incidents(self, name: str) -> list[dict]:
        """The events that interrupted or changed the run: failures, restarts, rollbacks, skipped updates,
        silent data corruption, stragglers, preemptions, doctor findings (a clean preflight is none)."""
        return [e for e in self.events(name, INCIDENT_KINDS) if is_incident(e)]

    @one_at_a_time
    def checkpoints(self, name: str) -> list[dict]:
        """Saved, failed and rejected checkpoints, each with `present`: whether its directory is still there."""
        found = self.events(name, CHECKPOINT_KINDS)
        path = self._db.execute("SELECT path FROM runs WHERE name = ?", (name,)).fetchone()
        try:
            where = RunDir.from_saved_config(path[0]).checkpoints if path else None
        except ConfigError:  # a config that cannot be read: the default place
            where = RunDir(Path(path[0])).checkpoints
        for e in found:
            # Paths are as the run saw them, often relative to where it was started.
            saved = Path(e.get("path") or "")
            e["present"] = bool(e.get("path")) and (saved.is_dir() or _is_dir(where, saved.name))
        return found

    def evaluations(self, name: str) -> list[dict]:
        return self.events(name, EVAL_KINDS)

    def forecasts(self, name: str) -> list[dict]:
        return self.events(name, ("forecast",))


def _is_dir(root, name: str) -> bool:
    """Whether `root/name` is a directory; a store (`checkpoint.dir = "s3://..."`) that cannot be reached now
    counts as not holding it, rather than failing the page that asked."""
    if root is None:
        return False
    try:
        return (root / name).is_dir()
    except Exception:  # noqa: BLE001 - a store's client fails in many ways (credentials, network, a missing extra)
        return False


def is_incident(event: dict) -> bool:
    kind = event.get("kind")
    if kind == "doctor":
        return not event.get("ok") or bool(event.get("warnings"))
    if kind == "guard":  # a rollback's own event tells it; the guard's verdict is the incident otherwise
        return event.get("action") != "rollback"
    return kind in INCIDENT_KINDS


def _alive(path: Path, changed: float) -> bool:
    """Whether the run's process is still at work: its lock's holder lives (on this host), or, for a run of
    another host, its files changed lately."""
    alive = holder_running(path)
    return alive if alive is not None else time.time() - changed < _STALE_S


from liandan.track.store_logger import StoreLogger, ingest_quietly

__all__ = ["RunStore", "StoreError", "StoreLogger", "ingest_quietly", "is_incident", "is_run_dir"]
