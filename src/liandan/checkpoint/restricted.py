"""Loading DCP checkpoints without running code from them.

DCP's own reader unpickles `.metadata` with plain `pickle.load`, and its default planner reads non-tensor
state (the optimizer's hyperparameters) with `torch.load(weights_only=False)`: a crafted file runs whatever
it names. The manifest cannot prevent that. It is unsigned, so whoever can write a checkpoint can make its
checksums agree (and with `checkpoint.verify = false` a file of the same size is enough). So every load in
liandan goes through the reader and planner here: `.metadata` through an unpickler that admits only the
classes DCP's metadata is made of, and every other object through `torch.load(weights_only=True)`, as DCP
already reads tensors. A refusal is a `CheckpointError` naming the checkpoint and the file; nothing runs.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from liandan.checkpoint.verify import CheckpointError
from liandan.run.remote import RemotePath, locate

METADATA = ".metadata"

# What the `.metadata` of liandan's checkpoints holds, traced with a recording `find_class` over checkpoints
# saved by one process, FSDP2, TP and DDP: DCP's metadata dataclasses, the enum that encodes memory formats,
# tensor sizes, dtypes and layouts, and the checkpoint's path. Building any of these runs no code of the
# file's choosing. Every torch dtype is admitted besides, for checkpoints of other precisions.
_ALLOWED_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
       ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath")]
)  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _ALLOWED_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata never holds")


def read_metadata(directory: Path, rank: int | None = None) -> Metadata:
    """A checkpoint's DCP metadata (`.metadata`, or a rank's own `__R.metadata`), unpickled with nothing
    admitted but DCP's metadata classes. Raises CheckpointError naming the checkpoint and file otherwise."""
    name = METADATA if rank is None else f"__{rank}{METADATA}"
    path = locate(directory) / name
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: file {name} is missing") from None
    except Exception as err:  # noqa: BLE001 - a crafted or damaged pickle fails in many ways, all refused
        why = str(err) if isinstance(err, pickle.UnpicklingError) else reason(err)
        raise CheckpointError(f"{directory}: file {name} refused: {why}; nothing in it was run") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{directory}: file {name} holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        where = getattr(info, "relative_path", None)
        if not _inside(where):
            raise CheckpointError(f"{directory}: file {name} refused: it places data in {where!r}, outside the"
                                  " checkpoint's directory; nothing was read from there")  # fmt: skip
    return metadata


def _inside(relative_path: object) -> bool:
    """Whether a shard's name in `.metadata` stays within the checkpoint's directory: a plain relative path
    with no `..` component (DCP joins it to the directory, and an absolute path would replace the directory)."""
    if not isinstance(relative_path, str) or not relative_path or "\0" in relative_path:
        return False
    parts = PurePosixPath(relative_path)
    return not parts.is_absolute() and ".." not in parts.parts and "\\" not in relative_path


def load_state(state: dict[str, Any], path: Path, process_group=None, no_dist: bool = False) -> None:
    """`dcp.load` of `state` from the checkpoint at `path` through the restricted reader and planner. Any
    failure (a refused object, a truncated or inconsistent shard) is a one-line CheckpointError naming the
    checkpoint and, where known, the file; DCP raises it on every rank alike."""
    reader = RestrictedFsspecReader(path) if isinstance(path, RemotePath) else RestrictedFileSystemReader(path)
    try:
        dcp.load(state, storage_reader=reader, planner=RestrictedLoadPlanner(reader), process_group=process_group,
                 no_dist=no_dist)  # fmt: skip
    except CheckpointException as err:  # DCP gathers every rank's failure; the first one says what happened
        failures = [exc for exc, _ in err.failures.values()]
        first = next((f for f in failures if isinstance(f, CheckpointError)), failures[0] if failures else err)
        if isinstance(first, CheckpointError):
            raise CheckpointError(str(first)) from None
        raise CheckpointError(f"{path}: cannot be loaded: {reason(first)}") from None


class _Restricted:
    """What both readers below change in DCP's: `.metadata` read by `read_metadata` above, and the shard a
    read fails in named."""

    location: Any
    path: Any
    load_id: Any
    storage_data: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.location, kwargs.get("rank"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path  # every read of a stored item starts here
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as err:
            where = f"file {self._reading}" if self._reading else "its shards"
            raise CheckpointError(f"{self.path}: {where} cannot be loaded: {reason(err)}") from err

    def file_of(self, storage_index) -> str:
        return self.storage_data[storage_index].relative_path


class RestrictedFileSystemReader(_Restricted, FileSystemReader):
    """DCP's file reader, restricted."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.location, self._reading = Path(path), None


class RestrictedFsspecReader(_Restricted, FsspecReader):
    """DCP's fsspec reader (checkpoints in a store: `s3://...`), restricted."""

    def __init__(self, path: RemotePath) -> None:
        super().__init__(str(path))
        self.location, self._reading = path, None


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor objects with `weights_only=True` (plain numbers, strings, tuples and
    the like, which is all liandan stores besides tensors) instead of unrestricted unpickling."""

    def __init__(self, reader: RestrictedFileSystemReader) -> None:
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:  # noqa: BLE001 - whatever torch raises, the entry is refused
            file = self.reader.file_of(read_item.storage_index)
            raise CheckpointError(
                f"{self.reader.path}: file {file} refused: its entry {fqn}: {reason(err)}; nothing in it was run"
            ) from None
        # what DefaultLoadPlanner.load_bytes does with the object once read
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def reason(err: BaseException) -> str:
    """One line on why a load failed, without torch's multi-line advice to load unsafely instead."""
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:
        return f"not plain data (it names {found.group(1)})"
    if "WeightsUnpickler error" in text:
        return "not plain data"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "").split(". ")[0][:200]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
