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

The factory gets the run's config and returns the callback, or None when the config leaves it off.
`build_callbacks(cfg)` calls every registered factory. The registering module must have been imported: the
trainer attaches liandan's built-in callbacks itself (`liandan.train.builtin_callbacks` and the preemption
guard, registered with `builtin=True`); `liandan train` (and so every supervised or torchrun worker, which
start through the same command) imports the modules of the others, liandan's own and those the config names
in `[train] callbacks`, and attaches what `build_callbacks` gives; see `liandan.cli.main`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from liandan.config import Config, ConfigError

if TYPE_CHECKING:
    from liandan.train.trainer import Trainer, TrainResult


class Callback:
    """Hooks into the loop; every method is optional. `step` is the number of steps completed: 0 before the
    first, `train.steps` after the last."""

    name: str = ""  # the key of its state in checkpoints; the registered name by default
    order: int = 50  # lower runs first

    def on_train_start(self, trainer: Trainer) -> None:
        """After set-up and any resume, before the first step of this process."""

    def before_step(self, trainer: Trainer, step: int) -> None:
        """Before the data of the next step is drawn."""

    def on_phase(self, trainer: Trainer, step: int, phase: str, micro: int) -> None:
        """Where the step has got to: data, forward, backward (per micro-batch), optimizer, collective,
        step_end, eval, checkpoint, done."""

    def before_optimizer_step(self, trainer: Trainer, step: int, loss: Any, grad_norm: float) -> bool:
        """After backward and clipping, before the update: return False to skip the update. Every rank calls
        it and the ranks agree (the update is skipped everywhere if any rank says so), so no rank ever applies
        an update the others do not. `loss` is this rank's mean loss of the step, a tensor."""
        return True

    def after_step(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        """After every step. `metrics` holds the logged metrics on the steps that log them (every
        `train.log_every`), and is empty on the others."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        """After every callback's `after_step`: where a callback may move the run to another step (the
        loss-spike guard rolls back here). While `trainer.rolling_back` is set, the step is about to be undone
        and `after_step` should not save, evaluate or stop on it."""

    def on_eval(self, trainer: Trainer, step: int, loss: float) -> None:
        """After an evaluation on the validation data."""

    def on_checkpoint_saved(self, trainer: Trainer, step: int) -> None:
        """After a checkpoint save started (asynchronous saves complete later; see the checkpoint events)."""

    def on_checkpoint_loaded(self, trainer: Trainer, step: int, source: str) -> None:
        """After the run resumed from a checkpoint or memory snapshot, callback states included."""

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        """The loop is ending with `error`; it is raised again afterwards."""

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        """After the last step, before the summary is written."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @classmethod
    def overrides(cls, hook: str) -> bool:
        return getattr(cls, hook) is not getattr(Callback, hook)


CallbackFactory = Callable[[Config], Callback | None]

_FACTORIES: dict[str, CallbackFactory] = {}
_BUILTIN: dict[str, CallbackFactory] = {}


def register_callback(name: str, *, builtin: bool = False) -> Callable[[CallbackFactory], CallbackFactory]:
    """Register the decorated factory `(cfg) -> Callback | None` under `name`. `builtin`: one of liandan's own,
    which every trainer attaches itself (`builtin_callbacks`); the others are what callers attach
    (`build_callbacks`)."""

    def decorate(factory: CallbackFactory) -> CallbackFactory:
        known = _FACTORIES.get(name) or _BUILTIN.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (factory.__module__, factory.__qualname__):
            raise ValueError(f"callback '{name}' is registered twice ({known.__module__} and {factory.__module__})")
        (_BUILTIN if builtin else _FACTORIES)[name] = factory
        return factory

    return decorate


def registered_callbacks() -> list[str]:
    """The names of the registered callbacks (liandan's built-in ones aside), in registration order."""
    return list(_FACTORIES)


def build_callbacks(cfg: Config) -> list[Callback]:
    """The registered callbacks (built-in ones aside) that the config asks for, in `order`, then registration
    order: what `liandan train` attaches to its trainer."""
    return _build(_FACTORIES, cfg)


def builtin_callbacks(cfg: Config) -> list[Callback]:
    """liandan's own callbacks that the config asks for (metrics, heartbeats, evaluation, snapshots,
    checkpoints): every trainer attaches these itself."""
    return _build(_BUILTIN, cfg)


def _build(factories: dict[str, CallbackFactory], cfg: Config) -> list[Callback]:
    built = []
    for name, factory in factories.items():
        callback = factory(cfg)
        if callback is not None:
            callback.name = callback.name or name
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
