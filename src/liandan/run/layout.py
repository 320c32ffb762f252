"""Where each of a run's files lives. A run directory holds:

    config.toml           the resolved config the run trains with
    metrics.jsonl         one record per logged step (rank 0)
    events.jsonl          what happened: starts, resumes, saves, incidents, forecasts (trainer and supervisor)
    summary.json          the run's totals, written when it ends
    doctor.json           the preflight doctor's report: every rank's checks and verdicts (the newest launch,
                          or the newest `liandan doctor` with this run's name)
    doctor-bisect.json    the newest `liandan doctor --bisect` with this run's name: its rounds and verdict
    training.png          loss, learning rate and throughput against step, drawn when it ends
    heartbeat/            rank-N.json: each rank's step and phase, for the supervisor's hang detection
    logs/                 each worker's output, per attempt
    checkpoints/          step-NNNNNNNN/ per save (or `checkpoint.dir`)
    data/                 the token store made from `[data] paths` (none with `[data] stores`)
    guard/                the loss-spike guard's reports (spike-step-NNNNNNNN.json) and layer statistics
                          (layers.jsonl)
    nodes/, excluded_nodes.json, excluded_nodes.txt   failure attribution across nodes
    logs/verified.json    the supervisor's verdict on the newest checkpoint, handed to the next attempt
    run.lock              held by the process that owns the run (run-<node>.lock: by each node's supervisor)

Only this module spells those names; everyone else asks a `RunDir`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from liandan.run.files import atomic_write, atomic_write_json
from liandan.run.jsonl import JsonlTail, keep_jsonl, read_json, read_jsonl


@dataclass(frozen=True)
class RunDir:
    path: Path
    checkpoint_dir: Path | None = None  # `checkpoint.dir`, when checkpoints live elsewhere

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))

    @classmethod
    def of(cls, path: Path | str, checkpoint_dir: str | Path | None = "") -> RunDir:
        """A run directory; an empty `checkpoint_dir` (the config's default) means `<run>/checkpoints`."""
        return cls(Path(path), Path(checkpoint_dir) if checkpoint_dir else None)

    # -- files -------------------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def doctor(self) -> Path:
        return self.path / "doctor.json"

    @property
    def doctor_bisection(self) -> Path:
        return self.path / "doctor-bisect.json"

    @property
    def heartbeats(self) -> Path:
        return self.path / "heartbeat"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir if self.checkpoint_dir is not None else self.path / "checkpoints"

    @property
    def data(self) -> Path:
        return self.path / "data"

    @property
    def guard(self) -> Path:
        return self.path / "guard"

    def guard_report(self, kind: str, step: int) -> Path:
        return self.guard / f"{kind}-step-{step:08d}.json"

    @property
    def layer_stats(self) -> Path:
        return self.guard / "layers.jsonl"

    @property
    def nodes(self) -> Path:
        return self.path / "nodes"

    @property
    def excluded_nodes(self) -> Path:
        return self.path / "excluded_nodes.json"

    @property
    def excluded_hostlist(self) -> Path:
        return self.path / "excluded_nodes.txt"

    def node_logs(self, node: str | None = None) -> Path:
        """Where a supervisor keeps its workers' logs: `logs/`, or `logs/<node>/` on each node of a multi-node
        run."""
        return self.logs / node if node else self.logs

    def verdict(self, node: str | None = None) -> Path:
        """The supervisor's checkpoint verdict for its next attempt, among its logs."""
        return self.node_logs(node) / "verified.json"

    @property
    def lock(self) -> Path:
        return self.path / "run.lock"

    def node_lock(self, node: str) -> Path:
        """The lock each node's supervisor of a multi-node run holds."""
        return self.path / f"run-{node}.lock"

    def plot(self, name: str = "training") -> Path:
        return self.path / f"{name}.png"

    # -- reading -----------------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.path.is_dir()

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.metrics)

    def read_events(self) -> list[dict]:
        return read_jsonl(self.events)

    def read_summary(self) -> dict:
        summary = read_json(self.summary, {})
        return summary if isinstance(summary, dict) else {}

    def follow_metrics(self) -> JsonlTail:
        return JsonlTail(self.metrics)

    def follow_events(self) -> JsonlTail:
        return JsonlTail(self.events)

    # -- writing -----------------------------------------------------------------------------------------
    def write_config(self, toml: str) -> None:
        atomic_write(self.config, toml)

    def write_summary(self, summary: dict) -> None:
        atomic_write_json(self.summary, summary)

    def write_doctor(self, report: dict) -> None:
        atomic_write_json(self.doctor, report)

    def read_doctor(self) -> dict:
        report = read_json(self.doctor, {})
        return report if isinstance(report, dict) else {}

    def truncate_metrics(self, step: int) -> None:
        """Drop the records of steps after `step` (they are about to be trained again), in place: the run's
        logger keeps metrics.jsonl open for appending."""
        keep_jsonl(self.metrics, lambda record: record.get("step", step + 1) <= step)
