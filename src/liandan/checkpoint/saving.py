"""Saving checkpoints: CheckpointManager's half that writes them (`liandan.checkpoint.manager`).

A save goes to `step-XXXXXXXX.tmp/`, is fsync'd, gets its manifest and is renamed into place, so a crash
at any moment leaves either a complete checkpoint or a `.tmp` directory that loading ignores. In a store
(`checkpoint.dir = "s3://bucket/prefix"`, through fsspec) there is no rename: a save first removes any
manifest of its step, writes straight into the step directory and puts the manifest last, so a step
directory without its manifest is a partial save, ignored by loading and removed like a `.tmp` one. With
`async_save`, DCP copies the state to host memory (into staging buffers allocated once) and writes it in a
background thread while training goes on; rank 0 then writes the manifest and renames. The next save waits
for the previous one. A failed save is reported, never raised; ranks agree on each save's outcome.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from liandan.checkpoint.rng import rng_state
from liandan.checkpoint.train_state import TrainState
from liandan.checkpoint.verify import MANIFEST, CheckpointError, fsync_path, step_dir_name, write_manifest
from liandan.faults import maybe_inject
from liandan.run import META, dumps_json, partial_of, partial_step_dirs, rank_file, step_dirs
from liandan.run.remote import remove_tree

# How long a run ending on an error waits for its save's background write before removing the partial directory.
ABANDON_WAIT_S = 30.0


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


class CheckpointSaving:
    """Saving, waiting for a save and accounting for failed ones: the part of CheckpointManager that writes.
    The manager's constructor sets the attributes below; after a successful save it applies the manager's
    retention."""

    root: Path
    remote: bool
    rank: int
    world_size: int
    distributed: bool
    group: Any
    async_save: bool
    on_event: Callable[..., None]
    _pending: tuple[int, Path, Any, threading.Thread | None, float, float] | None
    _finalize_error: BaseException | None
    _finalized_at: float | None
    started_step: int | None
    requested_step: int | None
    _stager: Any
    outcomes: list[SaveOutcome]
    failures_in_a_row: int

    def save(self, step: int, model: Any, optimizer: Any, meta: dict[str, Any]) -> float:
        """Start saving; returns the seconds training was blocked (waiting for the previous save included).
        Errors are reported, never raised."""
        started = time.perf_counter()
        self.requested_step = step  # on every rank, whatever the outcome
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
            # the model parts and their optimizers (`TrainState.of`); weights only without optimizers (an import)
            state = TrainState.of(model, optimizer).state_dict()
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

    def abandon(self) -> None:
        """The run ends on an error with a save in flight: not waited for (a peer may be gone, and its half of
        the save with it), and its partial directory removed on rank 0, so that a run that ends leaves nothing
        half-written (a full disk fails the run this way as often as the save). A store's partial step, which
        is its final name, is left to the next start (`remove_stale_saves`): it may have completed meanwhile."""
        if self._pending is None:
            return
        tmp, future = self._pending[1], self._pending[2]
        self._pending = None
        if self.rank == 0 and not self.remote:
            # A background write still going on would make the directory again after its removal (and a process
            # killed before that write ends leaves it behind): give it a bounded time to end first. Not longer:
            # a write waiting on a peer that is gone never ends.
            if future is not None and hasattr(future, "result"):
                with contextlib.suppress(Exception, dcp.CheckpointException):  # failed or slow: removed anyway
                    future.result(timeout=ABANDON_WAIT_S)
            remove_tree(tmp)  # renamed already, the save complete: nothing there to remove
            # Still writing: removed once more when it ends (the process waits for DCP's writer threads at exit).
            when_done = getattr(future, "add_done_callback", None)
            if when_done is not None and not future.done():
                when_done(lambda _: remove_tree(tmp))

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
