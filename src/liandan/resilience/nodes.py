"""Nodes of a multi-node run: the elastic rendezvous the nodes meet in, which node a failure is attributed
to, and the run's list of excluded nodes. Which node this is (`node_name`) is part of the supervisor-worker
contract, in `liandan.run.worker_env`, since every worker's heartbeat names its node too.

Every node runs its own supervisor (`liandan train` on each host, or `srun --ntasks-per-node=1 liandan
train`) with $LIANDAN_NNODES and $LIANDAN_RDZV_ENDPOINT set; its workers join torchrun's elastic c10d
rendezvous. When a failure strikes, each supervisor reports what it saw to `<run>/nodes/<node>.json` and
all of them attribute the failure the same way: to the node where it began first (the oldest heartbeat of a
hang, the first worker death of a crash). A node with `LIANDAN_NODE_FAILURE_LIMIT` failures attributed to it
is excluded: `<run>/excluded_nodes.json` says so, its supervisor leaves, and the others carry on with
fewer nodes. The list lives with the run, so a restarted job honours it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import time
from dataclasses import dataclass
from pathlib import Path

from liandan.config import ConfigError
from liandan.run import RunDir, atomic_write, dumps_json, read_json
from liandan.run.worker_env import NODE_ADDR, NodeEnv


def failure_limit() -> int:
    """$LIANDAN_NODE_FAILURE_LIMIT: failures attributed to a node before it is excluded (default 2)."""
    return NodeEnv.from_env().node_failure_limit


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's elastic rendezvous: between min_nodes and max_nodes nodes meet at `endpoint`."""

    min_nodes: int
    max_nodes: int
    endpoint: str
    run_id: str
    last_call_s: float | None = None

    def torchrun_args(self) -> list[str]:
        from liandan.train.stores import RENDEZVOUS_BACKEND, is_loopback, parse_endpoint, route_address

        # torchrun's c10d rendezvous, with its stores bound to the address the other nodes reach this one at
        host, port = parse_endpoint(self.endpoint)
        local = NodeEnv.from_env().node_addr or ""
        try:
            local = local or route_address(host, port)
            loopback = ipaddress.ip_address(local.split("%")[0]).is_loopback
        except (OSError, ValueError) as err:
            raise ConfigError(f"$LIANDAN_RDZV_ENDPOINT = '{self.endpoint}' / ${NODE_ADDR} = '{local}': "
                              f"no address of this node to listen on ({err})") from None  # fmt: skip
        if loopback and not is_loopback(host):
            raise ConfigError(f"$LIANDAN_RDZV_ENDPOINT = '{self.endpoint}': {host} resolves to the loopback address "
                              f"{local} here, which other nodes cannot reach; fix its entry in /etc/hosts or set "
                              f"${NODE_ADDR} to this node's address on the cluster network")  # fmt: skip
        args = [f"--nnodes={self.min_nodes}:{self.max_nodes}", f"--rdzv-backend={RENDEZVOUS_BACKEND}",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
                f"--local-addr={local}"]  # fmt: skip
        if self.last_call_s is not None:
            args.append(f"--rdzv-conf=last_call_timeout={self.last_call_s:g}")
        return args


def rendezvous_from_env(default_id: str) -> Rendezvous | None:
    """The rendezvous described by $LIANDAN_NNODES ("N" or "MIN:MAX"), $LIANDAN_RDZV_ENDPOINT ("host:port"),
    $LIANDAN_RDZV_ID (default: the run name) and $LIANDAN_RDZV_LAST_CALL_S; None on a single node."""
    env = NodeEnv.from_env()
    if env.nnodes is None:
        return None
    min_nodes, max_nodes = env.nnodes
    return Rendezvous(min_nodes, max_nodes, env.rdzv_endpoint, env.rdzv_id or default_id, env.rdzv_last_call_s)


# -- the exclusion list ----------------------------------------------------------------------------------
class ExclusionList:
    """`<run>/excluded_nodes.json`: {"limit": N, "nodes": {name: {"failures": [...], "excluded": bool}}}.

    Each supervisor updates only the entry of the node a failure is attributed to, under a file lock, so
    concurrent supervisors never lose each other's updates. `excluded_nodes.txt` lists the excluded names,
    comma-separated, for Slurm's --exclude."""

    def __init__(self, run_dir: Path, limit: int = 2):
        room = RunDir(Path(run_dir))
        self.path = room.excluded_nodes
        self.hostlist = room.excluded_hostlist  # for `srun --exclude=$(cat ...)` / `sbatch --exclude=...`
        self.limit = limit

    def read(self) -> dict:
        data = read_json(self.path, {})
        data.setdefault("nodes", {})
        return data

    def excluded(self) -> dict[str, dict]:
        return {name: entry for name, entry in self.read()["nodes"].items() if entry.get("excluded")}

    def record_failure(self, node: str, failure: dict) -> tuple[int, bool]:
        """Count one failure against `node`; returns (its failures, whether it is excluded now)."""
        with self._locked():
            data = self.read()
            data["limit"] = self.limit
            entry = data["nodes"].setdefault(node, {"failures": [], "excluded": False})
            entry["failures"].append(failure)
            if len(entry["failures"]) >= self.limit and not entry["excluded"]:
                entry.update(excluded=True, excluded_at=time.time(),
                             reason=f"{len(entry['failures'])} failures attributed to it (limit {self.limit})")  # fmt: skip
            self._write(data)
            return len(entry["failures"]), entry["excluded"]

    def mark(self, node: str, record: dict, exclude: bool) -> None:
        """Record hardware found wanting on `node` (a device that computes wrong, a straggler; `record`'s
        "reason" says which): with `exclude`, the node is excluded at once; else it stays a suspect, listed
        under "suspect", for a person to act on (one node: there is nowhere else to run)."""
        with self._locked():
            data = self.read()
            data["limit"] = self.limit
            entry = data["nodes"].setdefault(node, {"failures": [], "excluded": False})
            entry.setdefault("suspect", []).append({"time": time.time(), **record})
            if exclude and not entry["excluded"]:
                entry.update(excluded=True, excluded_at=time.time(), reason=record["reason"])
            self._write(data)

    def include_again(self, node: str) -> None:
        """Forget a node's failures (after it was repaired)."""
        with self._locked():
            data = self.read()
            data["nodes"].pop(node, None)
            self._write(data)

    def _write(self, data: dict) -> None:
        atomic_write(self.path, dumps_json(data, indent=1) + "\n")
        names = sorted(n for n, e in data["nodes"].items() if e.get("excluded"))
        atomic_write(self.hostlist, ",".join(names) + "\n")

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


# -- attributing a failure to a node ---------------------------------------------------------------------
# A worker that fails because a peer (or the rendezvous store) went away says so: its failure began elsewhere.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "Broken pipe",
             "DistNetworkError", "NCCL communicator was aborted", "RendezvousConnectionError")  # fmt: skip


def lost_a_peer(output: str) -> bool:
    return any(marker in output for marker in PEER_LOST)


def write_report(run_dir: Path, node: str, report: dict) -> None:
    """What this node saw of a failure: when it began here (`since`) and where it thinks it began
    (`origin`: this node for a crash of its own workers, the stalled rank's node for a hang)."""
    directory = RunDir(Path(run_dir)).nodes
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / f"{node}.json", dumps_json({"node": node, "time": time.time(), **report}), durable=False)


def read_reports(run_dir: Path, newer_than: float) -> dict[str, dict]:
    out = {}
    for path in sorted(RunDir(Path(run_dir)).nodes.glob("*.json")):
        report = read_json(path)
        if not isinstance(report, dict):
            continue
        if report.get("time", 0) >= newer_than:
            out[report["node"]] = report
    return out


def attribute(run_dir: Path, newer_than: float, participants: dict[str, float], grace_s: float) -> tuple[str, dict]:
    """The node a failure is attributed to, from the reports written after `newer_than` (this round's).

    `participants` maps each node seen in the round to its newest heartbeat time. Waits up to `grace_s` for
    every participant's report. The failure began, in this order of trust:
      - where the earliest report of a failure of its own says (a crash of that node's workers, or the node
        of a hang's stalled rank);
      - else on a node that sent no report (its supervisor or the machine is gone), the one that beat last
        the earliest;
      - else where the earliest report of a secondary failure (a worker that lost its peers) says.
    Ties go by name, so that every supervisor decides alike."""
    deadline = time.time() + grace_s
    while True:
        reports = read_reports(run_dir, newer_than)
        if set(participants) <= set(reports) or time.time() >= deadline:
            break
        time.sleep(0.1)
    silent = sorted(n for n in participants if n not in reports)
    primary = [(r["since"], r.get("origin", n)) for n, r in reports.items() if not r.get("secondary")]
    secondary = [(r["since"], r.get("origin", n)) for n, r in reports.items() if r.get("secondary")]
    since, origin = min(primary or [(participants[n], n) for n in silent] or secondary)
    return origin, {"reports": reports, "silent": silent, "since": since}
