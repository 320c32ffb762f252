"""Sharded, asynchronous, verified checkpoints with torch.distributed.checkpoint (DCP).

Layout of `<root>/step-00000100/`:
    .metadata, __*_*.distcp   model and optimizer shards, written by DCP from every rank
    rank-00000.pt ...         each rank's RNG states (tensors and numbers only: loads with weights_only)
    meta.json                 step, tokens, layout, scheduler and loader state, config, tokenizer, version
    manifest.json             written last: size and xxh64 of every file; its presence means complete

CheckpointManager saves checkpoints (`liandan.checkpoint.saving`: atomic saves, locally and in a store,
asynchronous from staging buffers, failures reported and agreed on by every rank), loads them
(`liandan.checkpoint.loading`: the newest that verifies, into any parallel layout and world size) and keeps
the newest of them (retention, here).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from liandan.checkpoint.loading import CheckpointLoading
from liandan.checkpoint.saving import CheckpointSaving, SaveOutcome
from liandan.checkpoint.verify import complete_checkpoints, step_of
from liandan.run import parse_partial_step_dir, partial_step_dirs, step_dirs
from liandan.run.remote import RemotePath, locate, remove_tree


class CheckpointManager(CheckpointSaving, CheckpointLoading):
    def __init__(
        self,
        root: Path,
        *,
        keep_last: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
        verify_on_load: bool = True,
        on_event=None,
    ):
        self.root = locate(root)
        self.remote = isinstance(self.root, RemotePath)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save, self.verify_on_load = async_save, verify_on_load
        self.on_event = on_event or (lambda kind, **fields: None)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # Checkpoint collectives run in DCP's background thread: give them their own process group so
        # they never interleave with the training step's collectives.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self._pending: tuple[int, Path, Any, threading.Thread | None, float, float] | None = None
        self._finalize_error: BaseException | None = None
        self._finalized_at: float | None = None
        self.started_step: int | None = None  # of the newest save under way or done that did not fail to start
        self.requested_step: int | None = None  # of the newest save asked for, whether it started or not
        self._stager = None
        self.outcomes: list[SaveOutcome] = []
        self.failures_in_a_row = 0  # the same on every rank: ranks agree on each save's outcome

    # -- listing and retention ----------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        """Directories with a manifest, oldest first (not yet verified)."""
        return complete_checkpoints(self.root)

    def apply_retention(self) -> list[Path]:
        """Keep the newest `keep_last` complete checkpoints and every `keep_every`-th step; never the newest
        one. Removes stale `.tmp` directories of interrupted saves. Returns what was deleted."""
        complete = self.complete_checkpoints()
        if not complete:
            return []
        keep = set(complete[-self.keep_last :]) if self.keep_last else set(complete)
        keep.add(complete[-1])
        if self.keep_every:
            keep |= {p for p in complete if step_of(p) % self.keep_every == 0}
        deleted = [p for p in complete if p not in keep]
        newest = step_of(complete[-1])
        deleted += [p for p in partial_step_dirs(self.root) if parse_partial_step_dir(p.name) < newest]
        if self.remote:  # saves that never finished, in a store: step directories without their manifest
            deleted += [p for p in step_dirs(self.root) if step_of(p) < newest and p not in complete]
        for path in deleted:
            remove_tree(path)
        return deleted
