"""Live forecasts fitted off the training loop: one thread per run (on the main rank) that takes the curve
as it was when a forecast fell due, fits it, and leaves the result for the loop to pick up between steps.

Why a thread and not a process: the fit is numpy and scipy on a few hundred numbers and touches no torch
state, so it cannot change the training's numbers, and a thread needs no second interpreter (a process would
re-import numpy and scipy, and a forked one would inherit the trainer's process groups and threads). The
loop never waits for it: `submit` and `poll` only take a lock around a few list operations. A forecast that
falls due while another is being fitted waits its turn, so every forecast that falls due is written, in
order; should fits fall behind by more than `MAX_WAITING` (a fit slower than `every` steps), the oldest
waiting request is dropped and counted in `superseded`, so the backlog never grows.

Writing the results (events, metrics, console) stays with the training thread, which owns the loggers: the
callback publishes whatever `poll` returns after a step, and at the end of the run `close(drain=True)` waits
for what is still waiting, so the last forecasts are written too. After a failure `close(drain=False)` drops
the waiting requests and waits only for a fit in progress (half a second), whose result is not written. The
thread is a daemon, so a fit that hangs never keeps the process alive.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from liandan.plan.live_forecast import LiveForecast

log = logging.getLogger(__name__)

Compute = Callable[[Sequence[int], Sequence[float]], "LiveForecast | None"]
MAX_WAITING = 4  # requests waiting for the thread; the first fit also loads scipy (over a second)


class ForecastWorker:
    """Fits forecasts in a background thread; `compute(steps, losses)` is the fit (LiveForecaster.compute)."""

    def __init__(self, compute: Compute, name: str = "liandan-forecast"):
        self._compute = compute
        self._cond = threading.Condition()
        self._pending: deque[tuple[list[int], list[float]]] = deque()
        self._busy = False
        self._closing = False
        self._ready: list[LiveForecast] = []
        self.superseded = 0  # requests dropped, oldest first, while more than MAX_WAITING waited
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, steps: list[int], losses: list[float]) -> None:
        """Ask for a forecast from these records (the caller's copies); returns at once."""
        with self._cond:
            if self._closing:
                return
            self._pending.append((steps, losses))
            if len(self._pending) > MAX_WAITING:
                self._pending.popleft()
                self.superseded += 1
            self._cond.notify_all()

    def poll(self) -> list[LiveForecast]:
        """The forecasts finished since the last poll, oldest first; never waits for one in progress."""
        with self._cond:
            ready, self._ready = self._ready, []
        return ready

    @property
    def in_flight(self) -> bool:
        """Whether a forecast is being fitted or waits to be."""
        with self._cond:
            return self._busy or bool(self._pending)

    def close(self, *, drain: bool, timeout: float | None = 30.0) -> list[LiveForecast]:
        """Stop the thread and wait up to `timeout` seconds for it to end (None: as long as it takes).
        drain: fit what is waiting first and return every result not yet polled. Otherwise drop the waiting
        requests, let a fit in progress end, and return nothing."""
        with self._cond:
            self._closing = True
            if not drain:
                self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():  # a daemon: it cannot keep the process alive
            log.debug("the forecast thread was still fitting %s s after the run ended; its result is dropped", timeout)
        return self.poll() if drain else []

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:  # closing, nothing left to fit
                    return
                steps, losses = self._pending.popleft()
                self._busy = True
            try:
                result = self._compute(steps, losses)
            except Exception as err:  # noqa: BLE001 - compute never raises; if it did, the run must not notice
                log.debug("forecast at step %d failed in the forecast thread: %s", steps[-1], err)
                result = None
            with self._cond:
                self._busy = False
                if result is not None:
                    self._ready.append(result)
