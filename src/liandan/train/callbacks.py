"""The callbacks a run's config asks for, by name: a registry that the trainer's callers fill and read.

A callback lives in its own module, in whatever layer it belongs to (the live loss forecast is in `plan`),
and registers a factory under a name:

    @register_callback("forecast")
    def forecast_callback(cfg: Config) -> Callback | None:
        return ForecastCallback(...) if cfg.forecast.every else None

The factory gets the run's config and returns the callback, or None when the config leaves it off.
`build_callbacks(cfg)` calls every registered factory, in the order they were registered. The registering
module must be imported before: `liandan train` (and so every supervised or torchrun worker, which start
through the same command) imports the modules of liandan's own callbacks; see `liandan.cli.main`.
"""

from __future__ import annotations

from collections.abc import Callable

from liandan.config import Config
from liandan.train.trainer import Callback

CallbackFactory = Callable[[Config], Callback | None]

_FACTORIES: dict[str, CallbackFactory] = {}


def register_callback(name: str) -> Callable[[CallbackFactory], CallbackFactory]:
    """Register the decorated factory `(cfg) -> Callback | None` under `name`."""

    def decorate(factory: CallbackFactory) -> CallbackFactory:
        known = _FACTORIES.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (factory.__module__, factory.__qualname__):
            raise ValueError(f"callback '{name}' is registered twice ({known.__module__} and {factory.__module__})")
        _FACTORIES[name] = factory
        return factory

    return decorate


def registered_callbacks() -> list[str]:
    """The names of the registered callbacks, in registration order."""
    return list(_FACTORIES)


def build_callbacks(cfg: Config) -> list[Callback]:
    """The callbacks the config asks for: every registered factory's, in registration order."""
    callbacks = (factory(cfg) for factory in _FACTORIES.values())
    return [c for c in callbacks if c is not None]


def default_callbacks(cfg: Config) -> list[Callback]:
    """The callbacks a run's config asks for (`build_callbacks`), as `liandan train` attaches them."""
    return build_callbacks(cfg)
