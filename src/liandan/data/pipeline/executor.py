"""Run a pipeline stage's tasks in parallel: local processes, or Ray tasks on a cluster.

A task is a top-level function called with picklable arguments; it writes its own output files and returns
a small JSON-able result. Tasks are deterministic functions of their arguments, so where they run never
changes the bytes they write: the local and Ray executors produce identical output.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from liandan.data.documents.corpus import DataError


class Executor:
    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], description: str) -> list[Any]:
        """fn(*args) for every args in `calls`; results in the order of `calls`."""
        raise NotImplementedError

    def close(self) -> None: ...


def _progress(description: str, total: int, shown: bool = True):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=False,
        disable=not shown,
    )  # fmt: skip
    return progress, progress.add_task(description, total=total)


class LocalExecutor(Executor):
    """Up to `workers` processes (spawned, so no state leaks from the parent); one worker runs in-process."""

    def __init__(self, workers: int, progress: bool = True):
        self.workers = workers
        self.progress = progress

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], description: str) -> list[Any]:
        results: list[Any] = [None] * len(calls)
        if not calls:
            return results
        progress, bar = _progress(description, len(calls), self.progress)
        with progress:
            if self.workers == 1 or len(calls) == 1:
                for i, args in enumerate(calls):
                    results[i] = fn(*args)
                    progress.advance(bar)
                return results
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(min(self.workers, len(calls)), mp_context=context) as pool:
                futures = {pool.submit(fn, *args): i for i, args in enumerate(calls)}
                for future in as_completed(futures):
                    results[futures[future]] = future.result()
                    progress.advance(bar)
        return results


class RayExecutor(Executor):
    """Tasks on a Ray cluster (`address`), or on a Ray started here when no address is given."""

    def __init__(self, workers: int, address: str = "", progress: bool = True):
        self.progress = progress
        try:
            import ray
        except ImportError:
            raise DataError("the ray executor needs Ray: pip install 'ray>=2.9'") from None
        self._ray = ray
        self._started_here = not ray.is_initialized()
        if self._started_here:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], description: str) -> list[Any]:
        ray = self._ray
        remote = ray.remote(num_cpus=1, max_retries=3)(fn)
        refs = [remote.remote(*args) for args in calls]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(calls)
        progress, bar = _progress(description + " (ray)", len(calls), self.progress)
        pending = list(refs)
        with progress:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    results[index[ref]] = ray.get(ref)
                    progress.advance(bar)
        return results

    def close(self) -> None:
        if self._started_here:
            self._ray.shutdown()


def make_executor(kind: str, workers: int, address: str = "", progress: bool = True) -> Executor:
    """`progress`: show a progress bar per stage on the console."""
    if kind == "ray":
        return RayExecutor(workers, address, progress)
    return LocalExecutor(workers, progress)
