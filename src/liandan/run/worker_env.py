"""The contract between the supervisor (or launcher) and its workers: every `LIANDAN_*` environment
variable, its type and its meaning, named here and nowhere else.

Two halves, each a frozen dataclass with `to_env()` (the variables to set; fields left at their default are
left out) and `from_env(environ)` (typed fields; a malformed value is a `ConfigError` of one line that names
the variable, the value and what is allowed):

- `WorkerEnv`, what a worker reads: what the supervisor sets for each attempt (that it is supervised, the
  attempt number and its token, the owner of the memory snapshots, the checkpoint verdict, where failures go),
  what a launcher sets for its workers (where user errors go), and what the user's environment passes
  through (node name, cache directory, injected faults).
- `NodeEnv`, what a node's supervisor reads, set by the user or the job script: the multi-node rendezvous,
  the node failure limit, standby workers.

The files of the contract live with the modules that write them: the checkpoint verdict
(`liandan.checkpoint.handoff`), heartbeats (`liandan.train.heartbeat`), user errors under `error_dir`
(`liandan.train.distributed`), the first failure in `failure_file` (`liandan.train.distributed`).

`liandan.faults` sits below this module (everything that can fail injects through it) and reads its own two
variables; their names are defined there and taken from there here. Injected faults are transient: the
supervisor hands `$LIANDAN_FAULTS` to the first attempt only (`WorkerEnv.for_attempt`), while
`$LIANDAN_FAULTS_ALWAYS` reaches every attempt, the way a deterministic bug would.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.config import ConfigError
from liandan.faults import ENV as FAULTS
from liandan.faults import ENV_ALWAYS as FAULTS_ALWAYS

# -- WorkerEnv: set by the supervisor for each attempt
SUPERVISED = "LIANDAN_SUPERVISED"  # "1": a worker of the supervisor (it restarts after a crash)
ATTEMPT = "LIANDAN_ATTEMPT"  # 0, 1, ...: the supervisor's attempt; > 0 is a restart
ATTEMPT_TOKEN = "LIANDAN_ATTEMPT_TOKEN"  # marks every process of an attempt, so that none survives its end
SNAPSHOT_OWNER = "LIANDAN_SNAPSHOT_OWNER"  # the supervisor whose memory snapshots the workers write and read
SNAPSHOT_DIR = "LIANDAN_SNAPSHOT_DIR"  # the private directory (mode 0700) the supervisor made for them
VERIFIED_CHECKPOINT = "LIANDAN_VERIFIED_CHECKPOINT"  # the supervisor's checkpoint verdict (checkpoint/handoff.py)
FAILURE_FILE = "LIANDAN_FAILURE_FILE"  # where the multi-node agent leaves the rank that failed first
PREEMPT_GRACE_S = "LIANDAN_PREEMPT_GRACE_S"  # seconds the supervisor gives its workers once it asks them to stop
# -- WorkerEnv: set by the supervisor and by launch_local (`--nproc`, the multi-node agent)
# Signals between them: the supervisor forwards the SIGTERM or SIGINT it received (EXTERNAL) to its workers as
# PREEMPT_REQUEST, which they answer by saving and exiting within the grace period.
PREEMPT_REQUEST = signal.SIGUSR2
EXTERNAL_SIGNALS = (signal.SIGTERM, signal.SIGINT)
ERROR_DIR = "LIANDAN_ERROR_DIR"  # where a worker leaves its user error, for its launcher to print once
CRASHED = ".crashed"  # in ERROR_DIR, rank-N.crashed: when (time.time()) a worker crashed
# -- set by launch_local only, and taken out of the environment by the worker that reads it (`end_with_launcher`)
LAUNCHER_PID = "LIANDAN_LAUNCHER_PID"  # the process that started the worker: the worker ends when it does
# -- WorkerEnv: from the user's environment, passed through
NODE_NAME = "LIANDAN_NODE_NAME"  # this node's name (default: Slurm's, else the host name)
CACHE_DIR = "LIANDAN_CACHE_DIR"  # liandan's cache (measured CPU peaks); default $XDG_CACHE_HOME/liandan
# FAULTS, FAULTS_ALWAYS: from liandan.faults, above
# -- NodeEnv: from the user or the job script, for a node's supervisor
NNODES = "LIANDAN_NNODES"  # "N" or "MIN:MAX": a multi-node elastic run
RDZV_ENDPOINT = "LIANDAN_RDZV_ENDPOINT"  # host:port of the rendezvous
RDZV_ID = "LIANDAN_RDZV_ID"  # the rendezvous id (default: the run name)
RDZV_LAST_CALL_S = "LIANDAN_RDZV_LAST_CALL_S"  # seconds the rendezvous waits for more nodes past the minimum
NODE_FAILURE_LIMIT = "LIANDAN_NODE_FAILURE_LIMIT"  # failures attributed to a node before it is excluded
STANDBY = "LIANDAN_STANDBY"  # "0": start no standby workers ahead of a restart
NODE_ADDR = "LIANDAN_NODE_ADDR"  # the address this node's stores listen on (default: its route to the endpoint)

WORKER_NAMES = (SUPERVISED, ATTEMPT, ATTEMPT_TOKEN, SNAPSHOT_OWNER, SNAPSHOT_DIR, VERIFIED_CHECKPOINT, FAILURE_FILE,
                PREEMPT_GRACE_S, ERROR_DIR, NODE_NAME, CACHE_DIR, FAULTS, FAULTS_ALWAYS)  # fmt: skip
NODE_NAMES = (NNODES, RDZV_ENDPOINT, RDZV_ID, RDZV_LAST_CALL_S, NODE_FAILURE_LIMIT, STANDBY, NODE_ADDR)


def _text(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name, "").strip()
    return value or None


def _path(environ: Mapping[str, str], name: str) -> Path | None:
    value = environ.get(name, "")  # a path is taken as it is written
    return Path(value) if value else None


def _number(environ: Mapping[str, str], name: str, parse: type, least: float, what: str) -> Any:
    """The variable `name` as a `parse` (int or float) of at least `least`, or None when unset."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not value >= least:  # NaN too
        raise ConfigError(f"${name} = '{raw}' must be a {what}, at least {least}")
    return value


def _whole(environ: Mapping[str, str], name: str, default: int, least: int, what: str) -> int:
    value = _number(environ, name, int, least, f"whole number of {what}")
    return default if value is None else value


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    return _number(environ, name, float, 0, "number of seconds")


def _switch(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if raw not in ("0", "1"):
        raise ConfigError(f"${name} = '{raw}' must be 1 (on) or 0 (off)")
    return raw == "1"


def _emit(pairs: list[tuple[str, object]]) -> dict[str, str]:
    return {name: str(value) for name, value in pairs if value is not None}


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker process reads from its environment (see the module's doc for who sets what)."""

    supervised: bool = False
    attempt: int = 0
    attempt_token: str | None = None
    snapshot_owner: str | None = None
    snapshot_dir: Path | None = None
    verified_checkpoint: Path | None = None
    failure_file: Path | None = None
    preempt_grace_s: float | None = None  # None: the worker's own resilience.preempt_grace_s
    error_dir: Path | None = None
    node_name: str | None = None
    cache_dir: Path | None = None
    faults: str | None = None
    faults_always: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        return cls(
            supervised=_switch(env, SUPERVISED, False),
            attempt=_whole(env, ATTEMPT, 0, 0, "attempts"),
            attempt_token=_text(env, ATTEMPT_TOKEN),
            snapshot_owner=_text(env, SNAPSHOT_OWNER),
            snapshot_dir=_path(env, SNAPSHOT_DIR),
            verified_checkpoint=_path(env, VERIFIED_CHECKPOINT),
            failure_file=_path(env, FAILURE_FILE),
            preempt_grace_s=_seconds(env, PREEMPT_GRACE_S),
            error_dir=_path(env, ERROR_DIR),
            node_name=_text(env, NODE_NAME),
            cache_dir=_path(env, CACHE_DIR),
            faults=_text(env, FAULTS),
            faults_always=_text(env, FAULTS_ALWAYS),
        )

    def to_env(self) -> dict[str, str]:
        return _emit([
            (SUPERVISED, "1" if self.supervised else None),
            (ATTEMPT, self.attempt if self.supervised or self.attempt else None),  # a supervised attempt 0 says so
            (ATTEMPT_TOKEN, self.attempt_token),
            (SNAPSHOT_OWNER, self.snapshot_owner),
            (SNAPSHOT_DIR, self.snapshot_dir),
            (VERIFIED_CHECKPOINT, self.verified_checkpoint),
            (FAILURE_FILE, self.failure_file),
            (PREEMPT_GRACE_S, f"{self.preempt_grace_s:g}" if self.preempt_grace_s is not None else None),
            (ERROR_DIR, self.error_dir),
            (NODE_NAME, self.node_name),
            (CACHE_DIR, self.cache_dir),
            (FAULTS, self.faults),
            (FAULTS_ALWAYS, self.faults_always),
        ])  # fmt: skip

    def for_attempt(self, number: int, **fields) -> WorkerEnv:
        """This environment as the supervisor hands it to attempt `number`: supervised, with that number and
        the given fields; `$LIANDAN_FAULTS` only to the first attempt (injected faults are transient)."""
        return dataclasses.replace(
            self, supervised=True, attempt=number, faults=self.faults if number == 0 else None, **fields
        )


def end_with_launcher(environ: MutableMapping[str, str] = os.environ) -> None:
    """In a worker that `launch_local` started, have the kernel end this process with SIGKILL when its launcher
    ends. torchrun's agent ends the workers it knows when it is stopped, but a launcher stopped while it was
    still starting them (or killed outright) knows none, and they would train on alone. The variable is taken
    out of the environment, so that no process this one starts takes the launcher for its own. Linux only."""
    launcher = environ.pop(LAUNCHER_PID, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    import ctypes

    set_parent_death_signal = 1  # PR_SET_PDEATHSIG, <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(set_parent_death_signal, signal.SIGKILL) != 0:
        return
    if os.getppid() != int(launcher):  # it ended before this worker asked
        os._exit(1)


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node's name: $LIANDAN_NODE_NAME, else Slurm's name for it, else the host name."""
    env = os.environ if environ is None else environ
    return WorkerEnv.from_env(env).node_name or env.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass(frozen=True)
class NodeEnv:
    """What a node's supervisor reads from its environment, set by the user or the job script."""

    nnodes: tuple[int, int] | None = None  # (min, max) nodes of an elastic multi-node run; None: one node
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_last_call_s: float | None = None
    node_failure_limit: int = 2
    standby: bool = True
    node_addr: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NodeEnv:
        env = os.environ if environ is None else environ
        nnodes = None
        spec = env.get(NNODES, "").strip()
        if spec:
            try:
                low, _, high = spec.partition(":")
                nnodes = (int(low), int(high or low))
                ok = 1 <= nnodes[0] <= nnodes[1]
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(f"${NNODES} = '{spec}' must be a node count N or a range MIN:MAX, e.g. 2:4")
        endpoint = _text(env, RDZV_ENDPOINT)
        if nnodes and (not endpoint or ":" not in endpoint):
            raise ConfigError(f"${NNODES} is set, so ${RDZV_ENDPOINT} must name the rendezvous as host:port")
        last_call = env.get(RDZV_LAST_CALL_S)
        try:
            last_call_s = float(last_call) if last_call else None
        except ValueError:
            raise ConfigError(f"${RDZV_LAST_CALL_S} = '{last_call}' must be a number of seconds") from None
        return cls(
            nnodes=nnodes,
            rdzv_endpoint=endpoint,
            rdzv_id=_text(env, RDZV_ID),
            rdzv_last_call_s=last_call_s,
            node_failure_limit=_whole(env, NODE_FAILURE_LIMIT, 2, 1, "failures"),
            standby=_switch(env, STANDBY, True),
            node_addr=_text(env, NODE_ADDR),
        )

    def to_env(self) -> dict[str, str]:
        nnodes = None
        if self.nnodes is not None:
            low, high = self.nnodes
            nnodes = str(low) if low == high else f"{low}:{high}"
        return _emit([
            (NNODES, nnodes),
            (RDZV_ENDPOINT, self.rdzv_endpoint),
            (RDZV_ID, self.rdzv_id),
            (RDZV_LAST_CALL_S, f"{self.rdzv_last_call_s:g}" if self.rdzv_last_call_s is not None else None),
            (NODE_FAILURE_LIMIT, self.node_failure_limit if self.node_failure_limit != 2 else None),
            (STANDBY, None if self.standby else "0"),
            (NODE_ADDR, self.node_addr),
        ])  # fmt: skip
