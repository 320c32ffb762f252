"""Process-group setup from the environment (torchrun, Slurm, or a single process) and launching torchrun."""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.config import ConfigError
from liandan.run import atomic_write, rank_file, rank_files
from liandan.run.errors import DEVICE_FAULT_EXIT
from liandan.run.worker_env import ERROR_DIR, LAUNCHER_PID, NODE_ADDR, NodeEnv, WorkerEnv
from liandan.train.stores import (
    LOOPBACK,
    RENDEZVOUS_BACKEND,
    bound_store,
    is_loopback,
    register_rendezvous,
    single_node_env,
)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _adopt_slurm_env(env: dict[str, str]) -> bool:
    """Under `srun` (one task per process) without torchrun, translate Slurm's variables into the ones
    `init_process_group(init_method="env://")` reads. Returns whether it did."""
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = _first_slurm_host(env)
    # A port derived from the job id lets several jobs share a node without colliding.
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    # every task on this node: the process group's sockets on loopback too
    if is_loopback(env["MASTER_ADDR"], resolve=True):
        for key, value in single_node_env().items():
            env.setdefault(key, value)
    return True


def _slurm_store(env: dict[str, str], timeout: datetime.timedelta):
    """The process group's store for tasks that srun started without torchrun. c10d's env:// store would
    listen on every interface; rank 0 hosts it on this node's address only ($LIANDAN_NODE_ADDR, else
    MASTER_ADDR's, which is rank 0's node), and the others connect to MASTER_ADDR."""
    host, port, rank = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"])
    if rank != 0:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    where = NodeEnv.from_env(env).node_addr or host
    if is_loopback(where, resolve=True) and int(env.get("SLURM_NNODES", "1")) > 1:
        raise ConfigError(f"MASTER_ADDR = {host} is a loopback address on rank 0's node, which the other"
                          f" {int(env['SLURM_NNODES']) - 1} node(s) of the job cannot reach: set MASTER_ADDR (or"
                          f" {NODE_ADDR}) to its address on the cluster's network")  # fmt: skip
    try:
        return bound_store(where, port, timeout=timeout)
    except OSError as err:
        if err.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"MASTER_ADDR = {host} ({where}) is no address of rank 0's node {socket.gethostname()}:"
                              f" set MASTER_ADDR (or {NODE_ADDR}) to an address of the node of Slurm task 0") from None  # fmt: skip
        raise


def _first_slurm_host(env: dict[str, str]) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        # Without scontrol, take the simplest nodelist forms: "host1,host2" or "prefix[1-4,7]".
        first = nodelist.split(",")[0]
        if "[" in first:
            prefix, rest = first.split("[", 1)
            first = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
        return first or "127.0.0.1"


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float | None = None) -> DistInfo:
    """Join the process group described by the environment; a lone process runs without one. `timeout_s`:
    how long a collective may wait for a peer before it fails (c10d's and NCCL's watchdog timeout)."""
    from_slurm = _adopt_slurm_env(os.environ)  # type: ignore[arg-type]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("run.device = 'cuda' but no CUDA device is available; use --run.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if dev.type == "cuda" else "gloo"
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        if timeout_s:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if from_slurm:
            timeout = kwargs.get("timeout", dist.constants.default_pg_timeout)
            store = _slurm_store(os.environ, timeout)  # type: ignore[arg-type]
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kwargs)
        else:  # torchrun's store: bound by the liandan-c10d rendezvous (liandan.train.stores)
            dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    return DistInfo(rank, world, local_rank, dev)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_local(
    nproc: int, module: str, args: list[str], rendezvous: list[str] | None = None
) -> tuple[int, str | None]:
    """Run `python -m module args...` in `nproc` local processes under torchrun (in this process, so its
    failure report can be turned into one line). Returns (exit code, the workers' own error message).
    `rendezvous`: torchrun's options for a multi-node elastic rendezvous instead of a single node.

    Workers report user-facing errors into a file under $LIANDAN_ERROR_DIR instead of printing them, so
    the message survives whichever rank torchrun stops first."""
    import logging
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun would give each process one thread; share the cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    register_rendezvous()
    if rendezvous is None:  # one node: torchrun's stores and the process group listen on loopback only
        for key, value in single_node_env().items():
            os.environ.setdefault(key, value)
        rendezvous = [f"--rdzv-backend={RENDEZVOUS_BACKEND}", f"--rdzv-endpoint={LOOPBACK}:0",
                      f"--rdzv-id={uuid.uuid4()}", f"--local-addr={LOOPBACK}", "--nnodes=1"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="liandan-errors-") as errors:
        os.environ.update(WorkerEnv(error_dir=Path(errors)).to_env())  # the workers inherit it
        os.environ[LAUNCHER_PID] = str(os.getpid())  # and end when this process does (`end_with_launcher`)
        where = rendezvous
        parser = get_args_parser()
        parser.allow_abbrev = False  # the worker's own options (--nproc=...) are not torchrun's abbreviated
        parsed = parser.parse_args([*where, f"--nproc_per_node={nproc}", "-m", module, *args])
        try:
            run(parsed)
            return 0, None
        except ChildFailedError as failure:
            rank, info = failure.get_first_failure()
            failure_file = WorkerEnv.from_env().failure_file
            if failure_file is not None:  # for the supervisor's incident record
                atomic_write(failure_file, json.dumps({"rank": rank, "exitcode": info.exitcode, "time": time.time()}))
            reports = rank_files(Path(errors), ".txt")
            message = reports[0].read_text().strip() if reports else ""
            if message:  # a user error: exit 2 whichever rank torchrun saw end first (4: a faulty device)
                return (DEVICE_FAULT_EXIT if info.exitcode == DEVICE_FAULT_EXIT else 2), message
            return 1, f"worker rank {rank} failed with exit code {info.exitcode}; its output is above"
        finally:
            os.environ.pop(ERROR_DIR, None)
            os.environ.pop(LAUNCHER_PID, None)


def report_worker_error(message: str) -> bool:
    """In a worker started by `launch_local` or the supervisor, leave `message` for the launcher; False elsewhere,
    and False when it cannot be left (a full disk): then the caller prints it."""
    errors = WorkerEnv.from_env().error_dir
    if errors is None:
        return False
    path = rank_file(errors, int(os.environ.get("RANK", "0")), ".txt")
    try:
        path.write_text(message + "\n")
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)  # half a message would stand for the whole
        return False
    return True
