"""What a checkpoint says about itself, read without torch: its meta.json, where a run's checkpoints are, the
newest one, and what `liandan ckpt info` shows. The manager (`manager.py`) saves and loads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from liandan.checkpoint.verify import (
    MANIFEST,
    CheckpointError,
    complete_checkpoints,
    read_meta,
    total_bytes,
    verify,
)
from liandan.run import META, RunDir, step_dirs
from liandan.run.remote import RemotePath, locate

# What to do when a command needs a checkpoint that is not there, said once for all of them.
HOW_TO_GET_ONE = (
    "a run saves one at its end and every 30 minutes unless [checkpoint] turns it off (enabled = false, or"
    " at_end = false and every = every_minutes = 0): train again with those settings, or name a run that has one"
)


def describe_checkpoint(path: Path, checksums: bool = True) -> dict[str, Any]:
    """What `liandan ckpt info` shows: step, tokens, layout, size and whether it verifies."""
    path = locate(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    info: dict[str, Any] = {"path": str(path), "bytes": total_bytes(path), "checksums": checksums}
    if (path / META).is_file():
        try:
            meta = read_meta(path)
        except CheckpointError:  # verification below names what is wrong with it
            meta = {}
        for key in ("step", "tokens", "world_size", "layout", "liandan_version", "tokenizer", "saved_at"):
            info[key] = meta.get(key)
    try:
        verify(path, checksums=checksums)
        info["verified"] = True
    except CheckpointError as err:
        info["verified"] = False
        info["error"] = str(err)
    return info


def run_checkpoint_root(run_dir: Path) -> Path:
    """Where a run directory's checkpoints are: `checkpoint.dir` of the config the run saved, else
    `<run>/checkpoints`, just as training chose."""
    return RunDir.from_saved_config(run_dir).checkpoints


def resolve_checkpoint(path: Path) -> Path:
    """A step directory, or the newest complete one under a checkpoints directory or a run directory."""
    path = locate(path)
    if (path / MANIFEST).is_file() or (path / META).is_file():
        return path
    remote = isinstance(path, RemotePath)
    if not remote and not path.exists():
        raise CheckpointError(f"no such run or checkpoint: {path}")
    for root in (path,) if remote else (path, run_checkpoint_root(path)):  # a store holds no run directory
        steps = complete_checkpoints(root) if remote else step_dirs(root)  # in a store, one being saved has none
        if steps:
            return steps[-1]
    raise CheckpointError(f"no checkpoint at {path}; {HOW_TO_GET_ONE}")
