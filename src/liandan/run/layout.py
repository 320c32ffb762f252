"""Where each of a run's files lives. A run directory holds:

    config.toml           the resolved config the run trains with
    metrics.jsonl         one record per logged step (rank 0)
    events.jsonl          what happened: starts, resumes, saves, incidents, forecasts (trainer and supervisor)
    summary.json          the run's totals, written when it ends
    doctor.json           the preflight doctor's report: every rank's checks and verdicts (the newest launch,
                          or the newest `liandan doctor` with this run's name)
    doctor-bisect.json    the newest `liandan doctor --bisect` with this run's name: its rounds and verdict
    rank-times.jsonl      the straggler check's mean phase times per step of every rank, one record per window
                          (rank 0): the dashboard's step-time heat map
    training.png          loss, learning rate and throughput against step, incidents marked, drawn when it ends
    report.html           `liandan report` of this run alone (report-<run>.png beside it), when asked for
    heartbeat/            rank-NNNNN.json: each rank's step and phase, for the supervisor's hang detection;
                          stacks/rank-NNNNN.txt: each rank's Python stacks, dumped when it hangs
    logs/                 attempt-N.log: each attempt's worker output; failure.json: which worker failed first
                          (torchrun's report); errors/rank-NNNNN.txt: a worker's user error, for its launcher;
                          nccl-trace-rank-N: NCCL's flight recorder dumps after a collective timeout
    checkpoints/          step-NNNNNNNN/ per save, step-NNNNNNNN.tmp/ while it is written (or `checkpoint.dir`)
    data/                 the token store made from `[data] paths` (none with `[data] stores`), manifest.json
                          written last; data/pipeline/: the data pipeline's own files (its stages' done markers)
    guard/                the loss-spike guard's reports (spike-step-NNNNNNNN.json) and layer statistics
                          (layers.jsonl)
    nodes/, excluded_nodes.json, excluded_nodes.txt   failure attribution across nodes
    logs/verified.json    the supervisor's verdict on the newest checkpoint, handed to the next attempt
    run.lock              held by the process that owns the run (run-<node>.lock: by each node's supervisor)
    trial.log             a sweep trial's output, when the run is one
    trackers.json         the exporters' state: the W&B and MLflow run ids this run resumes, and how far
                          into events.jsonl the trackers have been given the events
    tensorboard/          TensorBoard event files (`[track] exporters`): the metrics, and events/ the events
    wandb/                Weights & Biases run files (offline mode: for `wandb sync`)

Beside the run directories, their parent (the project directory, `run.output_dir`) holds liandan.db: the run
store, an index of every run's files (`project_store`).

Only this module spells those names; everyone else asks a `RunDir`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from liandan.run.files import atomic_write, atomic_write_json
from liandan.run.jsonl import JsonlTail, keep_jsonl, load_json_object, read_json, read_jsonl
from liandan.run.remote import locate
from liandan.run.steps import complete_step_dirs, partial_step_dirs, step_dirs


def project_store(project: Path) -> Path:
    """The run store of a project directory (the parent of its run directories)."""
    return Path(project) / "liandan.db"


def rank_file(directory: Path, rank: int, suffix: str) -> Path:
    """A rank's file in a directory of one file per rank (heartbeats, stack dumps, user errors)."""
    return locate(directory) / f"rank-{rank:05d}{suffix}"


def rank_files(directory: Path, suffix: str) -> list[Path]:
    """Every rank's file of a directory of one file per rank, by rank."""
    return sorted(Path(directory).glob(f"rank-*{suffix}"))


@dataclass(frozen=True)
class RunDir:
    path: Path
    # `checkpoint.dir`, when checkpoints live elsewhere: a local directory or a store's URL (a RemotePath)
    checkpoint_dir: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.checkpoint_dir is not None:
            object.__setattr__(self, "checkpoint_dir", locate(self.checkpoint_dir))

    @classmethod
    def of(cls, path: Path | str, checkpoint_dir: str | Path | None = "") -> RunDir:
        """A run directory; an empty `checkpoint_dir` (the config's default) means `<run>/checkpoints`."""
        return cls(Path(path), locate(checkpoint_dir) if checkpoint_dir else None)

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

    def heartbeat(self, rank: int) -> Path:
        return rank_file(self.heartbeats, rank, ".json")

    def heartbeat_files(self) -> list[Path]:
        return rank_files(self.heartbeats, ".json")

    @property
    def stacks(self) -> Path:
        return self.heartbeats / "stacks"

    def stack_dump(self, rank: int) -> Path:
        return rank_file(self.stacks, rank, ".txt")

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
    def data_manifest(self) -> Path:
        """Written last by the store made from `[data] paths`: its presence means the store is complete."""
        return self.data / "manifest.json"

    @property
    def guard(self) -> Path:
        return self.path / "guard"

    def guard_report(self, kind: str, step: int) -> Path:
        return self.guard / f"{kind}-step-{step:08d}.json"

    @property
    def layer_stats(self) -> Path:
        return self.guard / "layers.jsonl"

    @property
    def rank_times(self) -> Path:
        """Every rank's mean seconds per step in each phase, one record per window of the straggler check."""
        return self.path / "rank-times.jsonl"

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

    def attempt_log(self, number: int, node: str | None = None) -> Path:
        return self.node_logs(node) / f"attempt-{number}.log"

    def failure_report(self, node: str | None = None) -> Path:
        """torchrun's report of the worker that failed first, left for the supervisor's incident record."""
        return self.node_logs(node) / "failure.json"

    def worker_errors(self, node: str | None = None) -> Path:
        """Where supervised workers leave a user error's message (`rank_file(..., ".txt")`) for the supervisor."""
        return self.node_logs(node) / "errors"

    def nccl_trace_prefix(self, node: str | None = None) -> Path:
        """Where NCCL's flight recorder dumps each rank's trace on a collective timeout (CUDA only): this
        prefix and the rank."""
        return self.node_logs(node) / "nccl-trace-rank-"

    def nccl_traces(self, node: str | None = None) -> list[Path]:
        prefix = self.nccl_trace_prefix(node)
        return sorted(prefix.parent.glob(prefix.name + "*"))

    def verdict(self, node: str | None = None) -> Path:
        """The supervisor's checkpoint verdict for its next attempt, among its logs."""
        return self.node_logs(node) / "verified.json"

    @property
    def lock(self) -> Path:
        return self.path / "run.lock"

    def node_lock(self, node: str) -> Path:
        """The lock each node's supervisor of a multi-node run holds."""
        return self.path / f"run-{node}.lock"

    @property
    def trial_log(self) -> Path:
        """The output of a sweep's trial, whose run this is."""
        return self.path / "trial.log"

    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    def plot(self, name: str = "training") -> Path:
        return self.path / f"{name}.png"

    @property
    def report(self) -> Path:
        """Where `liandan report` of this run alone goes by default."""
        return self.path / "report.html"

    @property
    def project(self) -> Path:
        """The project directory: the parent of the run directory, where the run store lives."""
        return self.path.resolve().parent

    @property
    def name(self) -> str:
        return self.path.resolve().name

    # -- reading -----------------------------------------------------------------------------------------
    @classmethod
    def from_saved_config(cls, path: Path | str) -> RunDir:
        """A run directory with its checkpoints where the config it saved says (`checkpoint.dir`), else in
        `<run>/checkpoints`, just as training chose. A saved config that cannot be read raises ConfigError."""
        from liandan.config import read_toml

        config = cls(Path(path)).config
        directory = read_toml(config).get("checkpoint", {}).get("dir") if config.is_file() else None
        return cls.of(path, directory)

    def exists(self) -> bool:
        return self.path.is_dir()

    def checkpoint_steps(self) -> list[Path]:
        """Every step directory under the checkpoints, complete or not, oldest first."""
        return step_dirs(self.checkpoints)

    def complete_checkpoints(self) -> list[Path]:
        """The step directories under the checkpoints that have their manifest, oldest first (not verified)."""
        return complete_step_dirs(self.checkpoints)

    def partial_saves(self) -> list[Path]:
        """The step directories under the checkpoints that are still being written or were left half-done."""
        return partial_step_dirs(self.checkpoints)

    def read_metrics(self) -> list[dict]:
        return read_jsonl(self.metrics)

    def read_events(self) -> list[dict]:
        return read_jsonl(self.events)

    def read_summary(self) -> dict:
        summary = read_json(self.summary, {})
        return summary if isinstance(summary, dict) else {}

    def load_summary(self) -> dict:
        """The summary, for a reader that must have it: FileNotFoundError when the run has none (unfinished),
        ValueError saying what is wrong with it otherwise."""
        return load_json_object(self.summary)

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

    def truncate_metrics(self, step: int) -> None:
        """Drop the records of steps after `step` (they are about to be trained again), in place: the run's
        logger keeps metrics.jsonl open for appending."""
        keep_jsonl(self.metrics, lambda record: record.get("step", step + 1) <= step)
