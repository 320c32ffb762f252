"""Sharded, asynchronous, verified checkpoints with torch.distributed.checkpoint (DCP).

Layout of `<root>/step-00000100/`:
    .metadata, __*_*.distcp   model and optimizer shards, written by DCP from every rank
    rank-00000.pt ...         each rank's RNG states (tensors and numbers only: loads with weights_only)
    meta.json                 step, tokens, layout, scheduler and loader state, config, tokenizer, version
    manifest.json             written last: size and xxh64 of every file; its presence means complete

A save goes to `step-XXXXXXXX.tmp/`, is fsync'd, gets its manifest and is renamed into place, so a crash
at any moment leaves either a complete checkpoint or a `.tmp` directory that loading ignores. In a store
(`checkpoint.dir = "s3://bucket/prefix"`, through fsspec) there is no rename: a save first removes any
manifest of its step, writes straight into the step directory and puts the manifest last, so a step
directory without its manifest is a partial save, ignored by loading and removed like a `.tmp` one. With
`async_save`, DCP copies the state to host memory and writes it in a background thread while training
goes on; rank 0 then writes the manifest and renames. The next save waits for the previous one. Model
and optimizer state are saved under layout-independent names (get_state_dict), so a checkpoint loads
into any other parallel layout and world size: DCP reshards on load.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from liandan.checkpoint.info import (  # noqa: F401 - their callers' old address
    describe_checkpoint,
    read_meta,
    resolve_checkpoint,
    run_checkpoint_root,
)
from liandan.checkpoint.restricted import load_state, read_metadata, reason
from liandan.checkpoint.verify import (
    MANIFEST,
    CheckpointError,
    complete_checkpoints,
    fsync_path,
    step_dir_name,
    step_directories,
    step_of,
    verify,
    write_manifest,
)
from liandan.faults import maybe_inject
from liandan.run import (
    META,
    dumps_json,
    parse_partial_step_dir,
    partial_of,
    partial_step_dirs,
    rank_file,
    step_dirs,
)
from liandan.run.remote import RemotePath, locate, remove_tree

# DCP notes on every single-process save and load that it runs without a process group, which is intended.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# Optimizer settings that choose how the update is computed, not what it is: each layout keeps its own.
KERNEL_CHOICES = ("foreach", "fused")


class SaveError(CheckpointError):
    """Checkpoints were not saved, so the run stops: training on, or reporting success, would risk work that
    could not be resumed. The message names the checkpoint and the error."""


@dataclass
class SaveOutcome:
    step: int
    path: Path
    ok: bool
    seconds: float = 0.0
    blocking_seconds: float = 0.0
    error: str | None = None
    # Start to complete: on rank 0 (which finalizes) until the checkpoint was whole, on the other ranks until
    # their part was handed over. A preemption's estimate of a save takes the largest over the ranks.
    write_seconds: float = 0.0


class CheckpointManager:
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
        self._stager = None
        self.outcomes: list[SaveOutcome] = []
        self.failures_in_a_row = 0  # the same on every rank: ranks agree on each save's outcome

    # -- saving -------------------------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer, meta: dict[str, Any]) -> float:
        """Start saving; returns the seconds training was blocked (waiting for the previous save included).
        Errors are reported, never raised."""
        started = time.perf_counter()
        self.wait()
        final = self.root / step_dir_name(step)
        tmp = final if self.remote else partial_of(final)  # a store has no rename: see the module's doc
        # Local preparation may fail on one rank only (a full disk, say); all ranks agree before DCP's
        # collectives start, so a failure never leaves a peer waiting in one of them.
        error: BaseException | None = None
        try:
            if self.rank == 0:
                if self.remote:  # the manifest first: from here on the step is partial, never half-replaced
                    (tmp / MANIFEST).unlink(missing_ok=True)
                remove_tree(tmp)
                tmp.mkdir(parents=True)
        except Exception as err:  # noqa: BLE001 - a failed save is reported on every rank, never raised
            error = err
        if self._all_ok(error is None):  # also the barrier: the directory exists for every rank after it
            try:
                with rank_file(tmp, self.rank, ".pt").open("wb") as f:
                    torch.save(rng_state(), f)
                if self.rank == 0:
                    meta = {**meta, "step": step, "world_size": self.world_size, "saved_at": time.time()}
                    (tmp / META).write_text(dumps_json(meta, indent=1))  # never a NaN: strict JSON
            except Exception as err:  # noqa: BLE001 - a failed save is reported on every rank, never raised
                error = err
        if not self._all_ok(error is None):
            return self._report_failure(step, tmp, error or RuntimeError("another rank failed"), started).seconds
        try:
            if optimizer is None:  # weights only (an imported model)
                state = {"model": get_model_state_dict(model)}
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
            where = {"storage_writer": FsspecWriter(str(tmp))} if self.remote else {"checkpoint_id": str(tmp)}
            if self.async_save:
                future = dcp.async_save(state, **where, process_group=self.group, async_stager=self._staging_buffers())
            else:
                dcp.save(state, **where, process_group=self.group)
                future = None
        # A failed save must not end the run: report it, keep training. DCP's CheckpointException (a failed write
        # on some rank) is a BaseException, not an Exception.
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - a failed save is reported, never raised
            return self._report_failure(step, tmp, err, started).seconds
        blocking = time.perf_counter() - started
        self.started_step = step
        thread = None
        if self.rank == 0:
            thread = threading.Thread(target=self._finalize, args=(step, tmp, final, future), daemon=True)
            thread.start()
        self._pending = (step, tmp, future, thread, started, blocking)
        if not self.async_save:
            self.wait()
            return time.perf_counter() - started
        return blocking

    def _staging_buffers(self):
        """One stager for the manager's life: its host copy of the state is allocated once and reused,
        instead of a fresh copy per save (the bulk of the time a save blocks). Pinned on CUDA for fast
        device-to-host copies. Reuse is safe because a save waits for the previous one first."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(cuda, False, False, cuda))
        return self._stager

    def _finalize(self, step: int, tmp: Path, final: Path, future) -> None:
        try:
            if future is not None:
                future.result()  # all ranks' shards and DCP's metadata are on disk once rank 0's save is done
            maybe_inject("save", step)
            write_manifest(tmp)
            if not self.remote:
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
                fsync_path(self.root)
            self._finalized_at = time.perf_counter()
            maybe_inject("saved", step, final)
        except BaseException as err:  # noqa: BLE001 - handed to wait(), which reports it
            self._finalize_error = err

    def wait(self) -> SaveOutcome | None:
        """Block until the pending save is complete (or failed); apply retention after a success."""
        if self._pending is None:
            return None
        step, tmp, future, thread, started, blocking = self._pending
        self._pending = None
        error: BaseException | None = None
        if thread is not None:
            thread.join()
            error, self._finalize_error = self._finalize_error, None
        elif future is not None:
            try:
                future.result()
            except BaseException as err:  # noqa: BLE001 - reported as the save's failure
                error = err
        # Only rank 0 finalizes: the others learn of a failure there (a full disk, say) here.
        if not self._all_ok(error is None) and error is None:
            error = RuntimeError("the save failed on another rank")
        if error is not None:
            return self._report_failure(step, tmp, error, started)
        done = time.perf_counter()
        finalized, self._finalized_at = self._finalized_at, None
        written = (finalized or done) - started if thread is not None or future is None else blocking
        outcome = SaveOutcome(step, self.root / step_dir_name(step), True, done - started, blocking, None, written)
        self.outcomes.append(outcome)
        self.failures_in_a_row = 0
        if self.rank == 0:
            self.apply_retention()
            self.on_event("checkpoint_saved", step=step, path=str(outcome.path), seconds=round(outcome.seconds, 3),
                          blocking_seconds=round(blocking, 3))  # fmt: skip
        return outcome

    def _report_failure(self, step: int, tmp: Path, err: BaseException, started: float) -> SaveOutcome:
        """One line for the failure (the event keeps the whole traceback), the space given back, and the count
        of failures in a row that the trainer stops at."""
        message = describe_save_error(err)
        try:  # a full disk often surfaces as a writer error deep inside DCP: say how much room there was
            if not self.remote:
                message += f" (free space on {self.root}: {shutil.disk_usage(self.root).free / 2**20:,.1f} MiB)"
        except OSError:
            pass
        if self.rank == 0:
            try:  # give back the space a partial save took
                remove_tree(tmp)
            except OSError:  # an unreachable store: the next start removes it (`remove_stale_saves`)
                pass
        final = self.root / step_dir_name(step)
        outcome = SaveOutcome(step, final, False, time.perf_counter() - started, error=message)
        self.outcomes.append(outcome)
        if self.started_step == step:
            self.started_step = None
        self.failures_in_a_row += 1
        if self.rank == 0:
            self.on_event("checkpoint_failed", step=step, path=str(final), error=message,
                          traceback="".join(traceback.format_exception(err)).strip())  # fmt: skip
        return outcome

    def unsaved_reason(self, step: int, max_failures: int, final: bool) -> str | None:
        """Why a run must stop, in one line, or None: `max_failures` saves in a row failed, or (`final`) the
        save of `step`, the last step, failed. Waits for the save in flight when that could decide it. Every
        rank gets the same answer: ranks agree on each save's outcome."""
        if not final and self.failures_in_a_row < max_failures:
            return None
        self.wait()
        last = self.outcomes[-1] if self.outcomes else None
        if last is None or last.ok:
            return None
        if self.failures_in_a_row >= max_failures:
            what = f"{self.failures_in_a_row} checkpoint saves in a row failed, the last"
        elif final and last.step == step:
            what = f"the checkpoint of the last step ({step})"
        else:
            return None
        newest = self.complete_checkpoints()
        return f"{what} was not saved to {last.path}: {last.error}; " + (
            f"the newest saved checkpoint, where a resumed run continues, is {newest[-1]}" if newest
            else "there is no saved checkpoint to resume from")  # fmt: skip

    def save_seconds(self) -> float | None:
        """How long the newest successful save took to complete here (see `SaveOutcome.write_seconds`)."""
        return next((o.write_seconds for o in reversed(self.outcomes) if o.ok), None)

    def remove_stale_saves(self) -> list[Path]:
        """Remove the `step-*.tmp` directories of saves that an earlier process left half-done (killed, or out
        of space): no one finishes them, and they hold space the next save may need. Call once at start,
        before any save, on one rank."""
        stale = partial_step_dirs(self.root)
        if self.remote:  # a step directory without its manifest is a save that never finished
            self._check_store()
            stale = [p for p in step_dirs(self.root) if not (p / MANIFEST).is_file()]
        for path in stale:
            remove_tree(path)
        return stale

    def _check_store(self) -> None:
        """Put and remove one small object, so that a store that cannot be written (no such bucket, no
        credentials, no route) stops the run at its start in one line, not at its first save."""
        probe = self.root / f".liandan-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink(missing_ok=True)
        except Exception as err:  # noqa: BLE001 - a store's client fails in many ways, each said in one line
            raise CheckpointError(
                f"checkpoint.dir = {self.root} cannot be written: {describe_save_error(err)}"
            ) from None

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _all_ok(self, ok: bool) -> bool:
        if not self.distributed:
            return ok
        flag = torch.tensor([1 if ok else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # -- finding and loading ------------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[Path]:
        """Directories with a manifest, oldest first (not yet verified)."""
        return complete_checkpoints(self.root)

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

    def load(self, path: Path, model: torch.nn.Module, optimizer=None, verified: bool = False) -> dict[str, Any]:
        """Load model (and optimizer) state into whatever layout they have now; returns meta.json, with
        this rank's RNG states restored where the world size is unchanged. A checkpoint that cannot be
        loaded raises the same CheckpointError, naming the checkpoint and file, on every rank."""
        path = locate(path)
        error = None
        try:  # refused before DCP's collectives start, so that no rank is left waiting in one of them
            if not verified and self.rank == 0:
                verify(path, checksums=self.verify_on_load)
            read_metadata(path)
        except CheckpointError as err:
            error = str(err)
        self._raise_agreed(error)
        meta: dict[str, Any] = {}
        try:
            if optimizer is None:
                state = {"model": get_model_state_dict(model)}
                load_state(state, path, process_group=self.group)
                set_model_state_dict(model, state["model"])
            else:
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optim": optim_sd}
                load_state(state, path, process_group=self.group)
                kernels = [{k: g[k] for k in KERNEL_CHOICES if k in g} for g in optimizer.param_groups]
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
                # The saved groups carry the saving layout's kernel choice: a fused or multi-tensor update
                # that this layout's mix of DTensors and plain tensors cannot take (tensor parallelism).
                for group, kernel in zip(optimizer.param_groups, kernels, strict=True):
                    group.update(kernel)
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

    def load_newest(self, newest: Path, model: torch.nn.Module, optimizer=None) -> tuple[Path, dict[str, Any]]:
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

    # -- retention ----------------------------------------------------------------------------------------
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


def describe_save_error(err: BaseException) -> str:
    """A failed save in one line. DCP wraps each rank's exception, with its traceback, in a CheckpointException:
    this names the first failing rank's exception, or the OS error beneath it where there is one."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        if isinstance(inner, BaseException):
            return f"rank {rank}: {describe_save_error(inner)}"
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    err = cause or err
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1].strip() if lines else '(no message)'}"


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


# ---------------------------------------------------------------------------------------------------------
# RNG states as tensors and plain numbers, so they load with torch.load(weights_only=True)


def rng_state() -> dict[str, Any]:
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    load_state(state, path, no_dist=True)
    set_model_state_dict(model, state["model"])
    return model, meta
