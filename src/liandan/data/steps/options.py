"""A step's options from a pipeline file, checked against the annotations of the step's constructor before the
step is built, so that `html = "false"` (a string, which is truthy) or `languages = "en"` (a string, which
iterates as its letters) is refused in one line instead of quietly changing what the step does.

The annotations understood are bool, int, float (an int is accepted; a bool is not a number), str, Literal,
list / tuple / set / frozenset of them (a TOML array), dict (a TOML table, its values checked), unions and
Optional. TOML has no null: where an option may be None, `false` stands for None, which is how a quality rule
is switched off. An annotation outside these is left to the constructor.

Ranges are the step's own business: `check_range` words them as config errors are.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any, Literal, Union

from liandan.config import ConfigError

_NONE = type(None)
_SEQUENCES = (list, tuple, set, frozenset)
_PLURALS = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}


def check_options(step: str, cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """`options` as the constructor of `cls` is to take them: each checked against its annotation, `false`
    turned into None where None is allowed. A value that does not fit is a ConfigError naming the step, the
    option, the value and what it must be."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):  # a plug-in's annotation that does not resolve: its constructor judges
        hints = {}
    checked = {}
    for key, value in options.items():
        hint = hints.get(key, Any)
        if not fits(value, hint):
            if isinstance(value, float) and not math.isfinite(value) and fits(1.0, hint):
                what = "a finite number (no nan or inf)"
            else:
                what = describe(hint)
            raise ConfigError(f"step '{step}': {key} = {_toml(value)} must be {what}")
        if value is False and _optional(hint) and not fits(False, _without_none(hint)):
            value = None
        checked[key] = value
    return checked


def fits(value: Any, hint: Any) -> bool:
    """Whether `value`, as TOML gives it, is of the annotated type."""
    if hint is Any or hint is object:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args) or (value is False and _NONE in args)
    if hint is _NONE or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin in _SEQUENCES:
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args))
        item = args[0] if args else Any
        return all(fits(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(fits(v, args[1] if args else Any) for v in value.values())
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def describe(hint: Any) -> str:
    """What a value of the annotated type is, for an error message: "a list of strings"."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        kinds = " or ".join(describe(a) for a in args if a is not _NONE)
        return f"{kinds} or false" if _NONE in args and bool not in args else kinds
    if hint in (bool, int, float, str):
        return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
    if origin is Literal:
        return "one of " + ", ".join(_toml(a) for a in args)
    if origin in _SEQUENCES:
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list of {len(args)} values ({', '.join(describe(a) for a in args)})"
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict:
        return f"a table of {_plural(args[1])}" if args else "a table"
    return f"a {getattr(hint, '__name__', str(hint))}"


def check_range(option: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    """Raise ValueError, worded as config errors are, when the number `value` lies outside [lo, hi]; None and
    False (an option switched off) pass."""
    if value is None or value is False:
        return
    if lo is not None and value < lo:
        raise ValueError(f"{option} = {_toml(value)} is too small; it must be >= {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{option} = {_toml(value)} is too large; it must be <= {hi}")


def _plural(hint: Any) -> str:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = typing.get_args(hint)
        kinds = " or ".join(_plural(a) for a in args if a is not _NONE)
        return f"{kinds} (each may be false)" if _NONE in args and bool not in args else kinds
    return _PLURALS.get(hint) or f"values that are each {describe(hint)}"


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType) and _NONE in typing.get_args(hint)


def _without_none(hint: Any) -> Any:
    rest = tuple(a for a in typing.get_args(hint) if a is not _NONE)
    return Union[rest] if rest else _NONE  # noqa: UP007 - built from a tuple


def _toml(value: Any) -> str:
    """A value as the pipeline file spells it: true/false for booleans, Python's repr otherwise."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
