"""Callbacks: everything around the training loop (metrics, heartbeats, evaluation, memory snapshots,
checkpoints, forecasts, and what comes next) hooks into it here, so the loop itself stays short.

A callback subclasses `Callback`, overrides the hooks it needs, and may keep state across a resume
(`state_dict` / `load_state_dict`: saved in every checkpoint and memory snapshot under the callback's name).
Callbacks run in `order` (lower first; liandan's own leave room between them) and, within an order, in
registration order. Each lives in its own module, in whatever layer it belongs to (the live loss forecast is
in `plan`), and registers a factory under a name:

    @register_callback("forecast")
    def forecast_callback(cfg: Config) -> Callback | None:
        return ForecastCallback(...) if cfg.forecast.every else None

The factory gets the run's config and returns the callback, or None when the config leaves it off. liandan's
own callbacks are listed in `liandan.plugins.BUILTIN` and imported when a trainer is built; others register
with `register_callback` from a module that `[train] callbacks` names (imported in every process that
trains), or through an entry point of their package (group `liandan.callback`). Every trainer attaches what
`build_callbacks(cfg)` gives, however it was started.

Hooks get a `TrainContext` (`liandan.train.context`): the run's settings, its step, the train module and the
loader, and the services a callback may use (events, checkpoints, the rollback service), never the trainer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from liandan import plugins
from liandan.config import Config, ConfigError

if TYPE_CHECKING:
    from liandan.train.context import TrainContext, TrainResult


class Callback:
    """Hooks into the loop; every method is optional. `step` is the number of steps completed: 0 before the
    first, `train.steps` after the last."""

    name: str = ""  # the key of its state in checkpoints; the registered name by default
    order: int = 50  # lower runs first

    def on_train_start(self, ctx: TrainContext) -> None:
        """After set-up and any resume, before the first step of this process."""

    def before_step(self, ctx: TrainContext, step: int) -> None:
        """Before the data of the next step is drawn."""

    def on_phase(self, ctx: TrainContext, step: int, phase: str, micro: int) -> None:
        """Where the step has got to: data, forward, backward (per micro-batch), optimizer, collective,
        step_end, eval, checkpoint, done."""

    def before_optimizer_step(self, ctx: TrainContext, step: int, loss: Any, grad_norm: float) -> bool:
        """After backward and clipping, before the update: return False to skip the update. Every rank calls
        it and the ranks agree (the update is skipped everywhere if any rank says so), so no rank ever applies
        an update the others do not. `loss` is this rank's mean loss of the step, a tensor."""
        return True

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        """After every step. `metrics` holds the logged metrics on the steps that log them (every
        `train.log_every`), and is empty on the others."""

    def on_step_end(self, ctx: TrainContext, step: int) -> None:
        """After every callback's `after_step`: where a callback may move the run to another step (the
        loss-spike guard rolls back here). While `ctx.rollback.pending` is set, the step is about to be undone
        and `after_step` should not save, evaluate or stop on it."""

    def on_eval(self, ctx: TrainContext, step: int, loss: float) -> None:
        """After an evaluation on the validation data."""

    def on_checkpoint_saved(self, ctx: TrainContext, step: int) -> None:
        """After a checkpoint save started (asynchronous saves complete later; see the checkpoint events)."""

    def on_checkpoint_loaded(self, ctx: TrainContext, step: int, source: str) -> None:
        """After the run resumed from a checkpoint or memory snapshot, callback states included."""

    def on_error(self, ctx: TrainContext, error: BaseException) -> None:
        """The loop is ending with `error`; it is raised again afterwards."""

    def on_train_end(self, ctx: TrainContext, result: TrainResult) -> None:
        """After the last step, before the summary is written."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(Callback, hook)


CallbackFactory = Callable[[Config], Callback | None]


def register_callback(name: str) -> Callable[[CallbackFactory], CallbackFactory]:
    """Register the decorated factory `(cfg) -> Callback | None` as the callback plug-in `name`
    (`liandan.plugins`): every trainer calls it and attaches what it returns. The same factory registered
    again (a module imported twice) is fine; another under a taken name is an error."""

    def decorate(factory: CallbackFactory) -> CallbackFactory:
        try:
            plugins.register_object("callback", name, factory)
        except plugins.PluginError as err:
            raise ValueError(str(err)) from None
        return factory

    return decorate


def registered_callbacks() -> list[str]:
    """The names of the registered callbacks, liandan's own first."""
    return plugins.names("callback")


def build_callbacks(cfg: Config) -> list[Callback]:
    """Every registered callback that the config asks for (its factory returns one), in `order`, then
    registration order: what every trainer attaches."""
    built = []
    for plugin in plugins.plugins("callback"):
        try:
            factory = plugin.load()
        except plugins.PluginError as err:
            raise ConfigError(str(err)) from None
        callback = factory(cfg)
        if callback is not None:
            callback.name = callback.name or plugin.name
            built.append(callback)
    return in_order(built)


def in_order(callbacks: list[Callback]) -> list[Callback]:
    """By `order`; a stable sort keeps registration order within one."""
    return sorted(callbacks, key=lambda c: c.order)


def import_callback_modules(modules: Sequence[str]) -> None:
    """Import the modules that `train.callbacks` names, so that their `register_callback` factories run. One
    that cannot be imported is a ConfigError naming it; an error inside one that imports keeps its traceback."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"train.callbacks: cannot import {module!r}: {err}") from None
