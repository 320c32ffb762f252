"""What a user gets wrong about a machine before a run: versions, bf16, host shared memory for memory
snapshots, free disk and write speed where checkpoints go. Facts are gathered per rank and judged per host."""

from __future__ import annotations

import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from liandan.checkpoint.snapshots import SLOTS, default_base
from liandan.common.layout import resolve_layout
from liandan.config import Config
from liandan.train.hardware import cpu_model_name, cpu_supports_bf16

# fp32 parameters and AdamW's two fp32 moments: what a checkpoint and a memory snapshot hold per parameter
STATE_BYTES_PER_PARAMETER = 12
GIB = 1 << 30


@dataclass(frozen=True)
class StateSize:
    """The bytes of training state a run keeps, from its parameter count and layout."""

    parameters: int
    checkpoint_bytes: int  # one checkpoint, every rank's shards together
    snapshot_bytes_per_host: int  # memory snapshots of one host's ranks, both slots

    def as_dict(self) -> dict:
        return {"parameters": self.parameters, "checkpoint_bytes": self.checkpoint_bytes,
                "snapshot_bytes_per_host": self.snapshot_bytes_per_host}  # fmt: skip


def state_size(cfg: Config, parameters: int, world_size: int, local_world_size: int) -> StateSize:
    """A checkpoint holds the whole state once; each rank's snapshot holds its shard (a data-parallel replica
    holds a whole copy), twice (two slots), in the shared memory of its host."""
    checkpoint = parameters * STATE_BYTES_PER_PARAMETER
    try:
        layout = resolve_layout(cfg.parallel, world_size)
        per_rank = checkpoint // (layout.dp_shard * layout.tp)
    except ValueError:  # the trainer refuses that layout in its own words; assume no sharding here
        per_rank = checkpoint
    return StateSize(parameters, checkpoint, per_rank * local_world_size * SLOTS)


def planned_parameters(cfg: Config) -> int | None:
    """The parameter count of the model a config trains, from its family's spec; None where the vocabulary
    comes from a tokenizer file this check does not read (the trainer then knows the exact count)."""
    from liandan.model.spec import count_params, model_args

    m, d = cfg.model, cfg.data
    vocab = m.vocab_size or {"byte": 257, "bpe": d.bpe_vocab_size}.get(d.tokenizer, 0)
    if not vocab or d.stores:
        return None
    return count_params(model_args(m, vocab)).total


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_supports_bf16()


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()


def _space(path: Path) -> tuple[int, int] | None:
    """(total, free) bytes of the file system holding `path` (or its nearest existing parent)."""
    try:
        stat = os.statvfs(existing(path))
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def facts(device: torch.device, checkpoint_dir: Path, memory_dir: str) -> dict:
    """This rank's view of its machine."""
    nccl = None
    if device.type == "cuda" and hasattr(torch.cuda, "nccl"):
        version = torch.cuda.nccl.version()  # a tuple; an int (2.18.1 as 21801) in older torch
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    shm = Path(memory_dir) if memory_dir else default_base()
    shm_space, disk_space = _space(shm), _space(checkpoint_dir)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "device_name": device_name(device),
        "bf16": bf16_supported(device),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "shm_path": str(shm),
        "shm_total_bytes": shm_space[0] if shm_space else None,
        "shm_free_bytes": shm_space[1] if shm_space else None,
        "checkpoint_dir": str(checkpoint_dir),
        "disk_free_bytes": disk_space[1] if disk_space else None,
        "platform": sys.platform,
    }


def environment_warnings(cfg: Config, facts: dict, size: StateSize | None, device_type: str) -> list[str]:
    """What in a host's facts will hurt the run this config describes."""
    said = []
    if cfg.train.dtype == "bf16" and not facts["bf16"]:
        said.append(f"train.dtype = 'bf16' but {facts['device_name']} has no native bf16")
    if device_type == "cuda" and cfg.parallel.backend in ("auto", "nccl") and not facts["nccl"]:
        said.append("this torch has no NCCL: collectives on GPUs will fail")
    if size is None:
        return said
    c = cfg.checkpoint
    shm = facts["shm_total_bytes"]
    if c.memory_every and shm is not None and shm < size.snapshot_bytes_per_host:
        said.append(f"{facts['shm_path']} holds {shm / GIB:.2f} GiB; memory snapshots of this host's ranks need"
                    f" {size.snapshot_bytes_per_host / GIB:.2f} GiB (checkpoint.memory_every)")  # fmt: skip
    free, each = facts["disk_free_bytes"], size.checkpoint_bytes
    kept = (c.keep_last or 1) + 1  # the ones kept and the one being written
    if c.saves and free is not None and free < kept * each:
        said.append(f"{facts['checkpoint_dir']} has {free / GIB:.2f} GiB free; {kept} checkpoints of"
                    f" {each / GIB:.2f} GiB each need {kept * each / GIB:.2f} GiB")  # fmt: skip
    return said


def existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists: where a directory not made yet would be made."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_throughput(directory: Path, nbytes: int, rank: int) -> dict:
    """Write and fsync a file of `nbytes` (at most a tenth of the free space: the check must not fill the disk
    it checks) in `directory`, or the nearest parent that exists, then remove it: bytes/s, or the error a
    checkpoint save would meet there."""
    where = existing(directory)
    space = _space(where)
    if space is not None:
        nbytes = min(nbytes, space[1] // 10)
    path = where / f".doctor-rank-{rank:05d}-{uuid.uuid4().hex[:8]}.tmp"
    block = os.urandom(min(nbytes, 1 << 20))
    result: dict = {"path": str(where), "bytes": nbytes, "bytes_per_s": None, "error": None}
    try:
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = 0
            while written < nbytes:
                written += os.write(fd, block[: nbytes - written])
            os.fsync(fd)
        finally:
            os.close(fd)
        if nbytes:
            result["bytes_per_s"] = nbytes / max(time.perf_counter() - start, 1e-9)
    except OSError as err:
        result["error"] = f"{type(err).__name__}: {err.strerror or err}"
    finally:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    return result
