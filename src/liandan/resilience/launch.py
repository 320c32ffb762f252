"""Starting a run on several nodes with its supervisors, and knowing how `liandan train` was started.

`liandan launch CONFIG --nodes N --gpus-per-node G` writes what starts one liandan supervisor per node, each
of which starts its node's G ranks and restarts them after a crash or hang (the multi-node supervision of
`nodes.py`, configured through $LIANDAN_NNODES and $LIANDAN_RDZV_ENDPOINT): a Slurm batch script from the
shipped template (`liandan.sbatch`, beside this module), or one shell command per node for machines without
Slurm. No torchrun command is written: each supervisor runs torchrun's elastic agent itself.

`how_started` tells `liandan train` who started it, so that a run that will not be supervised says so, and
so that `--nproc` inside a Slurm allocation never silently starts a single process.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from liandan.config import ConfigError
from liandan.run.worker_env import NNODES, NODE_NAME, RDZV_ENDPOINT, RDZV_ID, NodeEnv, WorkerEnv

# a host name (dot-separated labels) or IPv4 address, or a bracketed IPv6 address
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\]")

DEFAULT_PORT = 29400  # torchrun's customary rendezvous port
TEMPLATE = "liandan.sbatch"

Started = Literal["here", "worker", "torchrun", "srun"]


@dataclass(frozen=True)
class Start:
    """Who started this `liandan train`: `here` (a person or a script on one node: the supervisor starts the
    ranks), `worker` (the supervisor), `torchrun` or `srun` (one process per rank, nothing supervises them)."""

    how: Started
    note: str | None = None  # one line for rank 0 to print, when the run is unsupervised


def how_started(nproc: int, env: Mapping[str, str]) -> Start:
    """Who started this process, from its environment. Raises ConfigError, in one line, where `--nproc` would
    otherwise be ignored: inside a Slurm job step of several tasks, or in a batch script of an allocation of
    several nodes (which runs on the first node only)."""
    if WorkerEnv.from_env(env).supervised:
        return Start("worker")
    hint = ("for restarts after crashes and hangs, run `liandan train CONFIG --nproc=N` on one node, or one "
            "supervisor per node as `liandan launch CONFIG --nodes N --gpus-per-node G` writes")  # fmt: skip
    if "WORLD_SIZE" in env:
        if WorkerEnv.from_env(env).error_dir is not None:  # liandan's own launcher: `supervise = false` was chosen
            return Start("torchrun")
        return Start("torchrun", f"liandan: note: started by torchrun (or another launcher): this run is "
                                 f"unsupervised; {hint}")  # fmt: skip
    nnodes = NodeEnv.from_env(env).nnodes
    in_step = "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env  # a task srun started (not the batch script)
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1")
    if in_step and nnodes is None and tasks > 1:
        if nproc > 1:
            raise ConfigError(f"--nproc = {nproc} inside a Slurm job step of {tasks} tasks: srun already starts one "
                              f"process per rank; drop --nproc, or for supervision set ${NNODES} and "
                              f"${RDZV_ENDPOINT} and start one task per node (`liandan launch` writes the script)")  # fmt: skip
        return Start("srun", f"liandan: note: started by srun as {tasks} ranks: this run is unsupervised; {hint}")
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    if "SLURM_JOB_ID" in env and not in_step and nnodes is None and nodes > 1:
        raise ConfigError(f"this Slurm allocation has {nodes} nodes, but `liandan train` outside srun runs on "
                          f"this node only: start one supervisor per node with `srun --ntasks-per-node=1` and "
                          f"${NNODES}, ${RDZV_ENDPOINT} set (`liandan launch CONFIG --nodes {nodes} "
                          f"--gpus-per-node G` writes the script)")  # fmt: skip
    return Start("here")  # on one node (a batch script or one task included): the supervisor starts `--nproc`


# -- liandan launch -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchPlan:
    config: str
    run_name: str
    nodes: int
    gpus_per_node: int
    overrides: tuple[str, ...] = ()
    port: int = DEFAULT_PORT
    min_nodes: int | None = None  # elastic: carry on with as few as this after a node is excluded

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"--nodes = {self.nodes} and --gpus-per-node = {self.gpus_per_node} must be at least 1")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise ConfigError(f"--min-nodes = {self.min_nodes} must be between 1 and --nodes = {self.nodes}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port = {self.port} is no TCP port")

    @property
    def nnodes(self) -> str:
        low = self.min_nodes or self.nodes
        return str(self.nodes) if low == self.nodes else f"{low}:{self.nodes}"

    def train_command(self) -> list[str]:
        """What each node runs: its supervisor, which starts that node's ranks. The run name is fixed here so
        that every node joins the same run directory."""
        return [sys.executable, "-m", "liandan.cli", "train", self.config, f"--nproc={self.gpus_per_node}",
                f"--run.name={self.run_name}", *self.overrides]  # fmt: skip

    def node_commands(self, hosts: list[str]) -> list[str]:
        """One shell command per node, for machines without Slurm: run line K on host K (the first host serves
        the rendezvous). Nodes are named by their host, or node0, node1... where hosts repeat."""
        if len(hosts) != self.nodes:
            raise ConfigError(f"--hosts names {len(hosts)} host(s) for --nodes = {self.nodes}")
        for host in hosts:  # the first becomes host:port for every node; a mistake would show only on the cluster
            if not _HOST.fullmatch(host):
                raise ConfigError(f"--hosts: {host!r} is not a host name or address (the port goes to --port)")
        names = hosts if len(set(hosts)) == len(hosts) else [f"node{k}" for k in range(self.nodes)]
        endpoint = f"{hosts[0]}:{self.port}"
        lines = []
        for name in names:
            variables = {NNODES: self.nnodes, RDZV_ENDPOINT: endpoint, RDZV_ID: self.run_name, NODE_NAME: name}
            lines.append(" ".join([*(f"{k}={shlex.quote(v)}" for k, v in variables.items()),
                                   shlex.join(self.train_command())]))  # fmt: skip
        return lines

    def sbatch_script(self, output_dir: str, exclude: str = "") -> str:
        """The shipped Slurm template, filled in."""
        text = resources.files("liandan.resilience").joinpath(TEMPLATE).read_text()
        fields = {"NAME": self.run_name, "NODES": str(self.nodes), "GPUS": str(self.gpus_per_node),
                  "NNODES": self.nnodes, "PORT": str(self.port), "OUTPUT": output_dir,
                  "TRAIN": shlex.join(self.train_command()),
                  "EXCLUDE": f"#SBATCH --exclude={exclude}" if exclude else "# (no node excluded)"}  # fmt: skip
        for key, value in fields.items():
            text = text.replace(f"@{key}@", value)
        return text
