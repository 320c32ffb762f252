"""The building blocks of typed configs: the one-line error, a documented field with bounds, and the tables
that plug-ins (`liandan.plugins`) own inside a section (`[model.llama]`, `[optim.adamw]`, `[track.wandb]`)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from liandan import plugins


class ConfigError(ValueError):
    """A user-facing configuration mistake; the CLI prints it as one line."""


def _f(default: Any, help: str, *, min: float | None = None, max: float | None = None) -> Any:
    meta = {"help": help, "min": min, "max": max}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


option = _f  # the public name, for other typed configs (data pipelines, sweeps) built the same way


def plugin_options(kind: str, chosen_by: str = "") -> Any:
    """A field holding the config table that a plug-in (`liandan.plugins`) owns: of the one plug-in of `kind`
    that the section's key `chosen_by` names (`[model.<family>]`, `[optim.<name>]`), or, without `chosen_by`,
    of every plug-in of `kind` that has one (`[track.<exporter>]`). Filled in when the section is made."""
    meta = {"help": "", "min": None, "max": None, "plugin": kind, "chosen_by": chosen_by}
    if chosen_by:
        return field(default=None, metadata=meta)
    return field(default_factory=dict, metadata=meta)


class PluginTables:
    """A section some of whose keys belong to plug-ins: `section.options` (or `section.<plug-in name>`) holds
    the chosen plug-in's typed table; the section itself holds only the keys every plug-in shares."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            kind = f.metadata.get("plugin")
            if kind is None:
                continue
            chosen_by = f.metadata["chosen_by"]
            if chosen_by and getattr(self, f.name) is None:
                options = _plugin_options_type(kind, getattr(self, chosen_by), f"{type(self).KEY}.{chosen_by}")
                setattr(self, f.name, options() if options else None)
            elif not chosen_by:
                tables = getattr(self, f.name)
                for name, options in _all_plugin_options(kind).items():
                    if name not in tables:
                        tables[name] = options()

    def __getattr__(self, name: str) -> Any:
        # only for names that are not attributes: a plug-in's table by the plug-in's name
        if name.startswith("_") or name == "options":
            raise AttributeError(name)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if "plugin" not in f.metadata:
                continue
            value = self.__dict__.get(f.name)
            chosen_by = f.metadata["chosen_by"]
            if chosen_by and self.__dict__.get(chosen_by) == name and value is not None:
                return value
            if not chosen_by and isinstance(value, dict) and name in value:
                return value[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def _plugin_options_type(kind: str, name: str, key: str) -> type | None:
    try:
        return plugins.find(kind, name, what=key).options_type()
    except plugins.PluginError as err:
        raise ConfigError(str(err)) from None


def _all_plugin_options(kind: str) -> dict[str, type]:
    found = {}
    for plugin in plugins.plugins(kind):
        try:
            options = plugin.options_type()
        except plugins.PluginError as err:
            raise ConfigError(str(err)) from None
        if options is not None:
            found[plugin.name] = options
    return found


def section_dict(section: Any) -> dict[str, Any]:
    """A section as a table: plug-in tables under their plug-in's name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "plugin" not in f.metadata:
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else _plain(value)
        elif f.metadata["chosen_by"]:
            if value is not None:
                out[getattr(section, f.metadata["chosen_by"])] = dataclasses.asdict(value)
        else:
            for name, table in value.items():
                out[name] = dataclasses.asdict(table)
    return out


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
