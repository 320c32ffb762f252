"""Finding, verifying and loading checkpoints: CheckpointManager's half that reads them into the live model
and optimizer (`liandan.checkpoint.manager`), the newest checkpoint that verifies, and a checkpoint's model
in one process. Model and optimizer state were saved under layout-independent names (get_state_dict), so a
checkpoint loads into any other parallel layout and world size: DCP reshards on load. What a checkpoint says
about itself, read without torch, is in `liandan.checkpoint.info`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from liandan.checkpoint.info import read_meta
from liandan.checkpoint.restricted import load_state, read_metadata, reason
from liandan.checkpoint.rng import set_rng_state
from liandan.checkpoint.train_state import TrainState, flat_optimizer
from liandan.checkpoint.verify import MANIFEST, CheckpointError, step_directories, step_of, verify
from liandan.run import META, partial_of, rank_file
from liandan.run.remote import RemotePath, locate

# DCP notes on every single-process save and load that it runs without a process group, which is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# Optimizer settings that choose how the update is computed, not what it is: each layout keeps its own.


class CheckpointLoading:
    """Finding the newest checkpoint that verifies and loading one into the model and optimizer as they are
    laid out now: the part of CheckpointManager that reads. The manager's constructor sets the attributes
    below."""

    root: Path
    rank: int
    world_size: int
    distributed: bool
    group: Any
    verify_on_load: bool
    on_event: Callable[..., None]

    def latest_verified(self, before: Path | None = None) -> Path | None:
        """The newest checkpoint (older than `before`, if given) that verifies; failures are reported as
        events. Rank 0 decides for all."""
        box: list[Any] = [None]
        if self.rank == 0:
            found = newest_verified(self.root, self.verify_on_load, self.on_event, before)
            box[0] = str(found) if found else None
        if self.distributed:
            dist.broadcast_object_list(box, src=0, group=self.group)
        return locate(box[0]) if box[0] else None

    def load(self, path: Path, model: Any, optimizer: Any = None, verified: bool = False) -> dict[str, Any]:
        """Load model (and optimizer) state into whatever layout they have now; returns meta.json, with
        this rank's RNG states restored where the world size is unchanged. A checkpoint that cannot be
        loaded raises the same CheckpointError, naming the checkpoint and file, on every rank."""
        path = locate(path)
        error = None
        try:  # refused before DCP's collectives start, so that no rank is left waiting in one of them
            if not verified and self.rank == 0:
                verify(path, checksums=self.verify_on_load)
            saved = read_metadata(path)
        except CheckpointError as err:
            error = str(err)
        self._raise_agreed(error)
        meta: dict[str, Any] = {}
        try:
            into = TrainState.of(model, optimizer)  # model parts and their optimizers
            saved_flat = flat_optimizer(saved)  # the form it was saved in: a pipeline's, or a whole model's
            if saved_flat is False and into.flattened:
                into.own_groups = True  # a whole model's into pipeline stages: its tensors, this run's groups
            elif saved_flat is not None:
                into.flat = saved_flat
            state = into.state_dict()
            load_state(state, path, process_group=self.group)
            into.load_state_dict(state)
            meta = read_meta(path)
            rng_file = rank_file(path, self.rank, ".pt")
            if meta.get("world_size") == self.world_size and rng_file.is_file():
                try:
                    with rng_file.open("rb") as f:
                        set_rng_state(torch.load(f, weights_only=True))
                except Exception as err:  # noqa: BLE001 - any failure to load names the checkpoint
                    raise CheckpointError(f"{path}: file {rng_file.name} cannot be loaded: {reason(err)}") from None
        except CheckpointError as err:
            error = str(err)
        except Exception as err:  # noqa: BLE001 - any failure to load names the checkpoint
            error = f"{path}: cannot be loaded: {reason(err)}"
        self._raise_agreed(error)
        return meta

    def load_newest(self, newest: Path, model: Any, optimizer: Any = None) -> tuple[Path, dict[str, Any]]:
        """Load `newest`, or where it cannot be loaded (verified as it is, it may still be refused or fail
        inside DCP) the newest older checkpoint that verifies and loads; each one that fails is reported.
        Returns (the checkpoint loaded, its meta.json). When none loads this raises instead of starting over:
        a failed load may have left part of its state in the model."""
        path: Path | None = locate(newest)
        failure = None
        while path is not None:
            try:
                return path, self.load(path, model, optimizer, verified=True)
            except CheckpointError as err:
                failure = err
                if self.rank == 0:
                    self.on_event("checkpoint_rejected", step=step_of(path), path=str(path), error=str(err))
            path = self.latest_verified(before=path)
        raise CheckpointError(
            f"{failure}; no older checkpoint under {self.root} loads either, and the run does not start over "
            "from a partly loaded model: move the checkpoints aside to start over"
        )

    def _raise_agreed(self, error: str | None) -> None:
        """Raise CheckpointError on every rank if any rank had one (the first rank's message)."""
        if self.distributed:
            errors: list[str | None] = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self.group)
            error = next((e for e in errors if e), None)
        if error:
            raise CheckpointError(error)


# ---------------------------------------------------------------------------------------------------------
# outside a training run too


def newest_verified(root: Path, checksums: bool = True, on_event=None, before: Path | None = None) -> Path | None:
    """The newest complete checkpoint under `root` (older than `before`, if given) that verifies; each one
    that fails is reported, and so is a step directory that lost its manifest."""
    for path in reversed(step_directories(root)):
        if before is not None and path.name >= locate(before).name:
            continue
        if not (path / MANIFEST).is_file() and (isinstance(path, RemotePath) or partial_of(path).exists()):
            continue  # a save that never finished (in a store), or one of the same step replacing it right now
        try:
            verify(path, checksums=checksums)
        except CheckpointError as err:
            if on_event:
                on_event("checkpoint_rejected", step=step_of(path), path=str(path), error=str(err))
            continue
        return path
    return None


def load_model(path: Path, verify_checksums: bool = True):
    """A checkpoint's model on the CPU in one process, whatever layout saved it: (model, meta)."""
    from liandan.model.spec import get as get_model_spec

    path = locate(path)
    verify(path, checksums=verify_checksums)
    meta = read_meta(path)
    if "model_args" not in meta:
        raise CheckpointError(f"{path / META} does not describe the model (model_args missing)")
    spec = get_model_spec(meta.get("model_family", "llama"))  # checkpoints from before families are Llama's
    model = spec.build(spec.args_type(**meta["model_args"]))
    state = {"model": get_model_state_dict(model)}
    # A model smaller than the tensors saved would load them in part (fewer layers: the rest dropped unseen)
    saved = {k.removeprefix("model.") for k in read_metadata(path).state_dict_metadata if k.startswith("model.")}
    unused = sorted(saved - set(state["model"]))
    if unused:
        raise CheckpointError(f"{path}: holds {len(unused)} model tensor(s) that its model_args do not describe"
                              f" ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}): {META} does not"
                              " match the tensors")  # fmt: skip
    load_state(state, path, no_dist=True)
    set_model_state_dict(model, state["model"])
    return model, meta
