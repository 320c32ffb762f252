"""In-memory snapshots: every rank's training state in host shared memory every few steps, so that a
restart after a process crash resumes from the last step rather than from the last durable checkpoint.

A durable checkpoint every N steps costs, on average, N/2 steps of redone work per failure. Most failures
of a large run end processes, not machines (an exception, a killed or hung rank, a NCCL error), and memory
outside the processes survives those. So each rank copies its own shards (model parameters and buffers,
optimizer state, RNG states) into a file in `/dev/shm` after a step, with the scheduler and loader state
beside it, and a restarted rank on the same node reads them back. Machines that die take their snapshots
with them; the ranks then agree on no snapshot and the run resumes from the durable checkpoint as before.

Layout of `<base>/liandan-<hash of the run directory>-<random>/`:
    rank-00000.slot-0.bin    the tensors, each at a 64-byte aligned offset (preallocated, reused)
    rank-00000.slot-0.json   step, owner, world size, layout, tensor table, state, xxh3 of the .bin;
                             written after the data, so a header always describes complete data

Two slots per rank, written alternately, so the newest complete snapshot survives a crash during a write.
Ranks step in lockstep (every step has collectives), so with two slots some step is always held by all
ranks; `agree` finds the newest. A snapshot belongs to one supervisor (its `owner`): a new invocation never
picks up state left in memory by an earlier one, and the supervisor removes the directory when it ends.

The directory is the supervisor's: it creates it under a name no one can guess beforehand (mkdtemp: mode
0700, never an existing path or a symlink) and hands it to its workers in $LIANDAN_SNAPSHOT_DIR. Workers
refuse a directory that is a symlink, is not theirs or that others may enter, and open every file with
O_NOFOLLOW, so a planted link never redirects a snapshot into another file.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from liandan.checkpoint.snapshot_dirs import (  # noqa: F401 (the directory functions, as they were named here)
    ALIGN,
    FORMAT,
    SLOTS,
    VERSION,
    _held,
    _open_existing,
    _prefix,
    _read_header,
    _slot_paths,
    check_dir,
    create_dir,
    default_base,
    handed_dir,
    newest_common_step,
    newest_held_step,
    remove_dir,
    remove_stale,
    snapshot_dirs,
)
from liandan.checkpoint.train_state import TrainState
from liandan.run import dumps_json
from liandan.run.files import atomic_write


def _open_new(path: Path) -> int:
    """A file descriptor of a new, empty file at `path`: whatever was there is unlinked (never followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def set_rng(torch_state: torch.Tensor, cuda_state: torch.Tensor | None, python_state: dict[str, Any]) -> None:
    """Every random-number state a rank uses: torch's, CUDA's (when there is one), Python's and numpy's."""
    torch.set_rng_state(torch_state)
    if cuda_state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_state)
    set_python_rng(python_state)


def python_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "numpy": [kind, key.tolist(), pos, has_gauss, cached]}


def set_python_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))


def _checksum(buffer: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(buffer.numpy().data)


class MemorySnapshots:
    """One rank's snapshots of its training state, in `directory` (see the module docstring)."""

    def __init__(self, directory: Path, rank: int, world_size: int, owner: str, layout: str = ""):
        self.directory = Path(directory)
        self.rank, self.world_size, self.owner, self.layout = rank, world_size, owner, layout
        if not os.path.lexists(self.directory):
            self.directory.mkdir(mode=0o700, parents=True)
        check_dir(self.directory)
        self._buffers: dict[int, torch.Tensor] = {}  # slot -> shared-memory bytes, kept mapped between saves
        self._maps: dict[int, mmap.mmap] = {}
        self._next_slot = 0
        self.newest: int | None = None  # the step of the newest snapshot this process wrote
        self.save_seconds: float | None = None  # how long writing it took: about what reading it back takes

    def _paths(self, slot: int) -> tuple[Path, Path]:
        return _slot_paths(self.directory, self.rank, slot)

    # -- saving -------------------------------------------------------------------------------------------
    def save(self, step: int, model: Any, optimizer: Any, state: dict) -> None:
        """Copy this rank's state at `step` into the older slot (`model`, `optimizer`: see `TrainState.of`).
        `state` (JSON) rides along in the header."""
        held = TrainState.of(model, optimizer)
        started = time.perf_counter()
        slot = self._next_slot
        self._next_slot = (slot + 1) % SLOTS
        data_path, header_path = self._paths(slot)
        header_path.unlink(missing_ok=True)  # from here until the new header, this slot holds nothing valid
        tensors = held.tensors()
        table, offset = [], 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            table.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                          "offset": offset, "nbytes": nbytes})  # fmt: skip
            offset += -(-nbytes // ALIGN) * ALIGN
        buffer = self._buffer(slot, data_path, max(offset, ALIGN))
        for entry, (_, t) in zip(table, tensors, strict=True):
            view = buffer[entry["offset"] : entry["offset"] + entry["nbytes"]]
            view.view(t.dtype).view(t.shape).copy_(t.detach())
        header = {
            "format": FORMAT, "version": VERSION, "step": step, "owner": self.owner, "rank": self.rank,
            "world_size": self.world_size, "layout": self.layout, "bytes": offset, "tensors": table,
            "optimizer_groups": held.hyperparameters(), "rng": python_rng(), "state": state,
            "checksum": _checksum(buffer[:offset]),
        }  # fmt: skip
        # Host memory, gone with the machine anyway: not flushed to disk. Private: the state is this user's.
        atomic_write(header_path, dumps_json(header), durable=False, private=True)
        self.newest, self.save_seconds = step, time.perf_counter() - started

    def _buffer(self, slot: int, path: Path, nbytes: int) -> torch.Tensor:
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            fd = _open_new(path)
            try:
                os.ftruncate(fd, nbytes)  # sparse: pages are taken as they are written
                self._maps[slot] = mmap.mmap(fd, nbytes)  # shared: the bytes are the file's
            finally:
                os.close(fd)
            buffer = torch.frombuffer(self._maps[slot], dtype=torch.uint8)
            self._buffers[slot] = buffer
        return buffer

    # -- finding ------------------------------------------------------------------------------------------
    def _header(self, slot: int) -> dict | None:
        return _read_header(self._paths(slot)[1], self.owner, self.world_size, self.layout)

    def steps(self) -> dict[int, int]:
        """step -> slot of this rank's snapshots whose headers belong to this run (data not checked)."""
        return _held(self.directory, self.rank, self.owner, self.world_size, self.layout)

    def state_of(self, step: int) -> dict:
        """The `state` saved with this rank's snapshot of `step`, from its header alone (no data read)."""
        slot = self.steps().get(step)
        header = self._header(slot) if slot is not None else None
        return header["state"] if header is not None else {}

    def _read(self, slot: int) -> tuple[dict, np.ndarray] | None:
        """A slot's header and data if the data matches its checksum."""
        header = self._header(slot)
        if header is None:
            return None
        try:
            with _open_existing(self._paths(slot)[0]) as f:
                data = np.fromfile(f, dtype=np.uint8, count=header["bytes"])
        except (OSError, ValueError):
            return None
        if data.size != header["bytes"] or xxhash.xxh3_64_hexdigest(data.data) != header["checksum"]:
            return None
        return header, data

    def agree(self, group: dist.ProcessGroup | None = None) -> int | None:
        """The newest step that every rank holds a sound snapshot of (None if there is none). Collective."""
        mine = sorted(step for step, slot in self.steps().items() if self._read(slot) is not None)
        everyone = [mine]
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine, group=group)
        common = set(everyone[0]).intersection(*map(set, everyone[1:]))
        return max(common) if common else None

    # -- loading ------------------------------------------------------------------------------------------
    def load(self, step: int, model: Any, optimizer: Any) -> dict:
        """Put this rank's snapshot of `step` back into `model` and `optimizer`; returns its `state`."""
        into = TrainState.of(model, optimizer)
        slot = self.steps().get(step)
        found = self._read(slot) if slot is not None else None
        if found is None:
            raise RuntimeError(f"rank {self.rank} has no sound memory snapshot of step {step} in {self.directory}")
        header, data = found
        into.ensure_optimizer_state()
        tensors = dict(into.tensors())
        source = torch.from_numpy(data)
        names = {entry["name"] for entry in header["tensors"]}
        missing = sorted(set(tensors) - names - {"rng.cuda"})
        if missing:
            raise RuntimeError(f"memory snapshot of step {step} lacks {', '.join(missing[:3])}")
        with torch.no_grad():
            for entry in header["tensors"]:
                target = tensors.get(entry["name"])
                if target is None:
                    continue
                raw = source[entry["offset"] : entry["offset"] + entry["nbytes"]]
                target.copy_(raw.view(target.dtype).view(target.shape))
        rng_cuda = tensors["rng.cuda"] if "rng.cuda" in tensors and "rng.cuda" in names else None
        set_rng(tensors["rng.torch"], rng_cuda, header["rng"])  # the tensors were filled above like every other
        into.set_hyperparameters(header["optimizer_groups"])
        return header["state"]
