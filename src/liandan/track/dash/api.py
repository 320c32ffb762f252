"""What the dashboard's JSON API answers, without the web server: every question checked first (run names,
metric keys, ranges, sizes), every answer read through the run store or, for an incident's evidence, from
files inside the run's own directory — resolved, symlinks followed, and refused when they land outside the
project directory.

Errors are `ApiError`s with the HTTP status the web layer answers with and a one-line message."""

from __future__ import annotations

import math
import re
import threading
import time
from pathlib import Path
from typing import Any

from liandan.config import ConfigError, check_run_name
from liandan.run import RunDir, read_jsonl
from liandan.run.jsonl import loads_bounded
from liandan.track.store import X_AXES, RunStore, StoreError
from liandan.track.triage import triage

MAX_POINTS = 20_000  # the most points one curve may come back with
DEFAULT_POINTS = 2_000
MAX_STEP = 10**12  # the widest step range a question may name
MAX_COMPARED = 12  # runs on one comparison chart
MAX_BODY = 64 << 10  # bytes of a request body
TAIL_BYTES = 64 << 10  # of a log or a stack dump shown as evidence
MAX_REPORT_BYTES = 4 << 20  # a JSON report larger than this is shown as its tail, not parsed
MAX_LAYER_RECORDS = 400
MAX_WINDOWS = 2_000  # of the straggler check's per-rank phase times on the heat map
SYNC_EVERY_S = 1.0  # the store reads new lines of the run files at most this often

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=@-]{0,199}")
_KEY = re.compile(r"[A-Za-z0-9_./:-]{1,100}")
_EXPERT_KEY = re.compile(r"moe/(\d{1,6})/expert/(\d{1,6})")  # a MoE layer's expert load over the mean


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def bad(message: str) -> ApiError:
    return ApiError(400, message)


def parse_int(value: str | None, what: str, low: int, high: int, default: int | None = None) -> int | None:
    if value is None or value == "":
        return default
    try:
        number = int(value, 10)
    except ValueError:
        raise bad(f"{what} must be a whole number, not {value[:40]!r}") from None
    if not low <= number <= high:
        raise bad(f"{what} must be between {low} and {high}, not {number}")
    return number


def parse_x(value: str | None) -> str:
    x = value or "step"
    if x not in X_AXES:
        raise bad(f"x must be one of {', '.join(X_AXES)}, not {x[:40]!r}")
    return x


def check_key(key: str | None) -> str:
    if not key or not _KEY.fullmatch(key) or ".." in key:
        raise bad(f"key must name a metric (letters, digits, _ . / : -), not {str(key)[:40]!r}")
    return key


class Dashboard:
    """The dashboard's reads of one project directory. One SQLite connection is shared by the server's
    threads, so every use of it holds the lock; the store ingests what the runs wrote since at most every
    `sync_every_s` seconds, on the request that finds it stale (a running run's new steps show up that way)."""

    def __init__(self, project: Path | str, sync_every_s: float = SYNC_EVERY_S):
        self.project = Path(project).resolve()
        self.sync_every_s = sync_every_s
        self._lock = threading.Lock()
        self._synced = 0.0
        self._names: set[str] = set()
        self.store = RunStore(self.project)
        self.sync(force=True)

    def close(self) -> None:
        with self._lock:
            self.store.close()

    def sync(self, force: bool = False) -> None:
        with self._lock:
            if force or time.monotonic() - self._synced >= self.sync_every_s:
                try:
                    names = self.store.sync()
                except StoreError as err:
                    raise ApiError(503, str(err)) from None
                # A run directory that is a symlink out of the project is not served: its files are elsewhere.
                self._names = {n for n in names if self.run_dir(n) is not None}
                self._synced = time.monotonic()

    # -- runs --------------------------------------------------------------------------------------------
    def check_run(self, name: str) -> str:
        """A run name the store knows, or a 400 (not a plain name) or 404 (no such run)."""
        try:  # JSON admits lone surrogates (\ud800), which no file name can hold: encoding refuses them
            too_long = len(name.encode("utf-8")) > 255
        except (AttributeError, UnicodeEncodeError):  # not a string, or one with a lone surrogate
            too_long = True
        if too_long or not name:
            raise bad(f"not a run name: {str(name)[:60]!r}")
        try:  # what `liandan train` accepts (`炼丹-1`, `my run`), and nothing that is a path
            check_run_name(name)
        except ConfigError:
            raise bad(f"not a run name: {name[:60]!r}") from None
        if name not in self._names and self.run_dir(name) is not None:
            self.sync(force=True)  # a run that began since the last sync
        if name not in self._names:
            raise ApiError(404, f"no run named {name!r} in {self.project}")
        return name

    def run_dir(self, name: str) -> Path | None:
        """The run's directory when it resolves inside the project (a run directory that is a symlink out of
        it serves no files)."""
        path = (self.project / name).resolve()
        return path if path.parent == self.project and path.is_dir() else None

    def runs(self) -> list[dict[str, Any]]:
        self.sync()
        with self._lock:
            rows = self.store.runs()
        return [_listed(row) for row in rows if row["name"] in self._names]

    def run(self, name: str) -> dict[str, Any]:
        self.sync()
        self.check_run(name)
        with self._lock:
            row = self.store.run(name)
            keys = self.store.metric_keys(name)
        listed = _listed(row)
        return {**listed, "config": row["config"], "summary": row["summary"], "metric_keys": keys}

    def progress(self, name: str) -> dict[str, Any]:
        """What tells a page watching a run that it has something new to draw."""
        self.sync()
        self.check_run(name)
        with self._lock:
            row = self.store.run(name)
        return {k: row.get(k) for k in ("step", "status", "incidents", "updated")}

    def curve(self, name: str, key: str, x: str = "step", start: int | None = None, end: int | None = None,
              max_points: int = DEFAULT_POINTS) -> dict[str, Any]:  # fmt: skip
        self.sync()
        self.check_run(name)
        check_key(key)
        if start is not None and end is not None and start > end:
            raise bad(f"start ({start}) is after end ({end})")
        with self._lock:
            if key not in self.store.metric_keys(name):
                raise ApiError(404, f"run {name} has no metric {key!r}")
            try:
                curve = self.store.curve(name, key, x, start, end, max_points)
            except ValueError as err:
                raise bad(str(err)) from None
        return {"run": name, "key": key, "x_axis": x, **_finite(curve)}

    def compare(self, body: bytes) -> dict[str, Any]:
        """Several runs' curves of one metric: the body is JSON {"runs": [...], "key": "loss", "x": "step",
        "max_points": N}."""
        if len(body) > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY} bytes")
        try:
            question = loads_bounded(body.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise bad(f"malformed JSON: {str(err).splitlines()[0][:120]}") from None
        if not isinstance(question, dict):
            raise bad("the body must be a JSON object with runs, key, x, max_points")
        names = question.get("runs")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise bad("runs must be a non-empty list of run names")
        if len(names) > MAX_COMPARED:
            raise bad(f"at most {MAX_COMPARED} runs on one chart, not {len(names)}")
        key = question.get("key", "loss")
        x = question.get("x", "step")
        points = question.get("max_points", DEFAULT_POINTS)
        if not isinstance(key, str) or not isinstance(x, str):
            raise bad("key and x must be strings")
        check_key(key)  # as a curve's is: a compared key is no looser
        if isinstance(points, bool) or not isinstance(points, int) or not 1 <= points <= MAX_POINTS:
            raise bad(f"max_points must be a whole number from 1 to {MAX_POINTS}")
        x = parse_x(x)
        curves = []
        for name in dict.fromkeys(names):
            self.check_run(name)
            with self._lock:
                present = key in self.store.metric_keys(name)
            if not present:
                curves.append({"run": name, "missing": f"no metric {key!r}"})
                continue
            try:
                curves.append(self.curve(name, key, x, max_points=points))
            except ApiError as err:  # a run that does not know its tokens or FLOPs per step
                curves.append({"run": name, "missing": err.message})
        return {"key": key, "x_axis": x, "curves": curves}

    # -- incidents ---------------------------------------------------------------------------------------
    def incidents(self, name: str) -> list[dict[str, Any]]:
        self.sync()
        self.check_run(name)
        with self._lock:
            return [_brief(e) for e in self.store.incidents(name)]

    def incident(self, name: str, seq: int) -> dict[str, Any]:
        """One incident's event and the evidence it points to inside the run directory: the guard's report
        (and the documents it names), stack dumps, the attempt's log tail, the doctor's report, and the layer
        statistics around its step."""
        self.sync()
        self.check_run(name)
        with self._lock:
            event = self.store.event(name, seq)
        if event is None:
            raise ApiError(404, f"run {name} has no event {seq}")
        root = self.run_dir(name)
        evidence = Evidence(self.project, root, name).gather(event) if root else []
        step = event.get("step")
        layers = self.layers(name, around=step, window=20) if isinstance(step, int) else {"records": []}
        found = triage(event)
        event = {**event, "triage": found.as_dict() if found else None}
        return {"event": event, "evidence": evidence, "layers": layers["records"]}

    def evaluations(self, name: str) -> list[dict]:
        self.sync()
        self.check_run(name)
        with self._lock:
            return self.store.evaluations(name)

    def checkpoints(self, name: str) -> list[dict]:
        self.sync()
        self.check_run(name)
        with self._lock:
            return self.store.checkpoints(name)

    def forecasts(self, name: str) -> list[dict]:
        self.sync()
        self.check_run(name)
        with self._lock:
            return self.store.forecasts(name)

    # -- ranks and layers ---------------------------------------------------------------------------------
    def health(self, name: str) -> dict[str, Any]:
        """Per-rank health: the straggler check's phase times per window (the heat map), its and the
        silent-data-corruption checks' findings, the doctor's per-rank measurements and the heartbeats."""
        self.sync()
        self.check_run(name)
        root = self.run_dir(name)
        with self._lock:
            findings = self.store.events(name, ("straggler", "sdc", "device_fault", "node_excluded"))
        out: dict[str, Any] = {"windows": [], "findings": findings, "doctor": None, "heartbeats": []}
        if root is None:
            return out
        room = RunDir(root)
        if _inside(self.project, room.rank_times):
            out["windows"] = _finite(read_jsonl(room.rank_times)[-MAX_WINDOWS:])
        doctor = _read_json(self.project, room.doctor)
        if isinstance(doctor, dict):
            out["doctor"] = {k: doctor.get(k) for k in ("ok", "summary", "step", "world_size", "findings")}
            out["doctor"]["ranks"] = [_doctor_rank(r) for r in doctor.get("ranks") or [] if isinstance(r, dict)]
        for path in room.heartbeat_files()[:4096]:
            beat = _read_json(self.project, path)
            if isinstance(beat, dict):
                out["heartbeats"].append({k: beat.get(k) for k in ("rank", "host", "step", "phase", "time")})
        return out

    def experts(self, name: str, step: int | None = None) -> dict[str, Any]:
        """The expert-load heat map of a mixture-of-experts run: each MoE layer's experts' loads over the
        layer's mean (`moe/<layer>/expert/<e>`, 1.0 is balanced) at the newest logged step at or before `step`
        (the newest of all when None), and the first and last steps there are, for a slider. A run without
        such metrics answers with no layers."""
        self.sync()
        self.check_run(name)
        with self._lock:
            keys = [(k, m) for k in self.store.metric_keys(name) if (m := _EXPERT_KEY.fullmatch(k))]
            out: dict[str, Any] = {"run": name, "step": None, "first": None, "last": None, "layers": [],
                                   "experts": 0, "load": []}  # fmt: skip
            if not keys:
                return out
            steps = self.store.curve(name, keys[0][0], "step", None, step)["step"]
            everywhere = self.store.curve(name, keys[0][0])["step"]
            values = {k: self.store.curve(name, k, "step", steps[-1], steps[-1])["y"] for k, _ in keys} if steps else {}
        layers = sorted({int(m[1]) for _, m in keys})
        experts = max(int(m[2]) for _, m in keys) + 1
        load = [[None] * experts for _ in layers]
        row = {layer: i for i, layer in enumerate(layers)}
        for key, m in keys:
            found = values.get(key)
            load[row[int(m[1])]][int(m[2])] = found[0] if found else None
        out.update(step=steps[-1] if steps else None, first=everywhere[0], last=everywhere[-1], layers=layers,
                   experts=experts, load=_finite(load))  # fmt: skip
        return out

    def layers(self, name: str, around: int | None = None, window: int = 50) -> dict[str, Any]:
        """The guard's per-layer statistics (layers.jsonl): all of them (the newest `MAX_LAYER_RECORDS`), or
        those within `window` steps of `around`."""
        self.check_run(name)
        root = self.run_dir(name)
        records = []
        if root is not None and _inside(self.project, RunDir(root).layer_stats):
            records = read_jsonl(RunDir(root).layer_stats)
        # A rollback or a resume trains some steps again: the newest record of a step stands, in step order.
        newest = {r["step"]: r for r in records if isinstance(r.get("step"), int)}
        records = [newest[step] for step in sorted(newest)]
        if around is not None:
            records = [r for r in records if isinstance(r.get("step"), int) and abs(r["step"] - around) <= window]
        return {"records": _finite(records[-MAX_LAYER_RECORDS:])}


class Evidence:
    """The files an incident points to, each checked to lie inside the run directory and the project."""

    def __init__(self, project: Path, root: Path, name: str):
        self.project, self.root, self.name = project, root, name
        self.room = RunDir(root)
        self.seen: set[Path] = set()
        self.items: list[dict[str, Any]] = []

    def gather(self, event: dict) -> list[dict[str, Any]]:
        kind = event.get("kind")
        for value in _strings(event):
            self.add_named(value)
        if kind == "doctor":
            self.add(self.room.doctor, "doctor report")
        if kind in ("incident", "restart", "gave_up"):
            node = event.get("node") if isinstance(event.get("node"), str) else None
            attempt = event.get("attempt")
            if kind == "restart" and isinstance(attempt, int):
                attempt -= 1  # the attempt that failed, not the one that starts
            if isinstance(attempt, int) and attempt >= 0:
                self.add(self.room.attempt_log(attempt, node) if _NAME.fullmatch(node or "x") else None, "log")
            self.add(self.room.failure_report(), "failure report")
            for dump in sorted(self.room.stacks.glob("rank-*.txt"))[:64]:
                self.add(dump, "stack dump")
        return self.items

    def add_named(self, value: str) -> None:
        """A path an event names, as the run saw it (often relative to where it was started: the part after
        the run's own name is what is looked up in the run directory)."""
        if len(value) > 1000 or any(c.isspace() or c == "\0" for c in value):
            return
        if not value.endswith((".json", ".txt", ".log", ".jsonl")):
            return
        parts = Path(value).parts
        inside = parts[parts.index(self.name) + 1 :] if self.name in parts else parts
        if not inside or Path(value).is_absolute() and self.name not in parts:
            return
        what = "report" if value.endswith(".json") else "file"
        self.add(self.root.joinpath(*inside), what)

    def add(self, path: Path | None, what: str) -> None:
        if path is None:
            return
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError):
            return
        if resolved in self.seen or not resolved.is_file() or resolved.stat().st_size == 0:
            return
        if not (resolved.is_relative_to(self.root) and resolved.is_relative_to(self.project)):
            return
        self.seen.add(resolved)
        item: dict[str, Any] = {"what": what, "file": resolved.relative_to(self.root).as_posix()}
        size = resolved.stat().st_size
        if resolved.suffix == ".json" and size <= MAX_REPORT_BYTES:
            try:
                item["json"] = _finite(loads_bounded(resolved.read_text(encoding="utf-8")))
            except (ValueError, UnicodeDecodeError, OSError):
                item["text"], item["truncated"] = _tail(resolved)
        else:
            item["text"], item["truncated"] = _tail(resolved)
        self.items.append(item)


def _inside(project: Path, path: Path) -> bool:
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError):
        return False
    return resolved.is_file() and resolved.is_relative_to(project)


def _read_json(project: Path, path: Path) -> Any:
    if not _inside(project, path) or path.stat().st_size > MAX_REPORT_BYTES:
        return None
    try:
        return _finite(loads_bounded(path.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError, OSError):
        return None


def _tail(path: Path) -> tuple[str, bool]:
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - TAIL_BYTES))
        data = handle.read()
    return data.decode("utf-8", errors="replace"), size > TAIL_BYTES


def _strings(value: Any, depth: int = 0) -> list[str]:
    if isinstance(value, str):
        return [value]
    if depth > 3:
        return []
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v, depth + 1)]
    if isinstance(value, list):
        return [s for v in value[:100] for s in _strings(v, depth + 1)]
    return []


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they go out as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _listed(row: dict[str, Any]) -> dict[str, Any]:
    forecast = row.get("forecast")
    return _finite({k: row.get(k) for k in ("name", "status", "started", "updated", "step", "tokens", "loss",
                                             "final_loss", "val_loss", "goodput", "restarts", "incidents")}
                   | {"forecast": _forecast(forecast) if forecast else None,
                      "tokens_per_step": row.get("tokens_per_step"), "flops_per_token": row.get("flops_per_token"),
                      "mfu": (row.get("summary") or {}).get("mfu")})  # fmt: skip


def _forecast(event: dict) -> dict[str, Any]:
    return {k: v for k, v in event.items() if isinstance(v, (int, float, str)) or v is None}


def _brief(event: dict) -> dict[str, Any]:
    """An incident for the markers: its kind, step, time and one line saying what happened."""
    line = event.get("detail") or event.get("cause") or event.get("summary") or event.get("verdict")
    if event.get("kind") == "rollback":
        line = (
            f"rolled back to step {event.get('to')} from {event.get('from')}, skipped data steps"
            f" {event.get('skipped')}, detectors {event.get('detectors')}"
        )
    elif event.get("kind") == "restart":
        line = f"attempt {event.get('attempt')} started {event.get('after_seconds')}s after the failure"
    if not line:
        fields = [f"{k}={event[k]}" for k in ("failure", "action", "rank", "phase", "to", "host") if k in event]
        line = ", ".join(fields)
    found = triage(event)
    return {"seq": event["seq"], "kind": event.get("kind"), "step": event.get("step"), "time": event.get("time"),
            "line": str(line)[:300], "triage": found.as_dict() if found else None}  # fmt: skip


def _doctor_rank(rank: dict) -> dict[str, Any]:
    golden = rank.get("golden") or {}
    matmul = rank.get("matmul") or {}
    return {"rank": rank.get("rank"), "host": rank.get("host"), "device": rank.get("device"),
            "golden_ok": all(g.get("ok", True) for g in golden.values() if isinstance(g, dict)),
            "matmul_flops": {k: v.get("flops") for k, v in matmul.items() if isinstance(v, dict)},
            "memory_bandwidth": rank.get("memory_bandwidth")}  # fmt: skip
