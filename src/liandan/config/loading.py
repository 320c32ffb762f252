"""Reading a config: TOML, `--section.key=value` overrides (`--model.llama.dim=...` into a plug-in's table),
every value checked against its field's type and bounds, checks across keys, and the list of every key.
Mistakes are one line that names the key, the value and what is allowed (with a did-you-mean)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from liandan import plugins
from liandan.config.fields import ConfigError, _all_plugin_options, _plugin_options_type
from liandan.config.sections import Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read `path` (or defaults), apply `--section.key=value` overrides, check every value."""
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    for item in overrides:
        section, key, value = parse_override(item)
        _set_dotted(raw, section, key, value)
    cfg = from_dict(raw)
    check_config(cfg)
    return cfg


def _set_dotted(raw: dict[str, Any], section: str, key: str, value: Any) -> None:
    """`section.key = value`, where `key` may name a plug-in's table: `model.llama.dim`. An override wins over
    the file whichever spelling either uses: `--model.dim` replaces `[model.llama] dim`, and
    `--model.llama.dim` replaces `[model] dim`."""
    table = raw.setdefault(section, {})
    *tables, last = key.split(".")
    if isinstance(table, dict) and len(tables) <= 1:  # the other spelling of the same key goes
        if tables:
            table.pop(last, None)
        else:
            for sub in table.values():
                if isinstance(sub, dict):
                    sub.pop(last, None)
    where = section
    for name in tables:
        if not isinstance(table, dict):
            raise ConfigError(f"'{where}' must be a [section] table")
        table = table.setdefault(name, {})
        where += f".{name}"
    if not isinstance(table, dict):
        raise ConfigError(f"'{where}' must be a [section] table")
    table[last] = value


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None


def parse_override(item: str) -> tuple[str, str, Any]:
    text = item.removeprefix("--")
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override '{item}' must look like --section.key=value")
    dotted, value_text = text.split("=", 1)
    section, key = dotted.split(".", 1)
    return section, key, _parse_value(dotted, value_text)


def _parse_value(dotted: str, text: str) -> Any:
    """A TOML literal (1e-3, true, [\"a\", \"b\"], \"quoted\") or else the bare string. A list or table that
    does not parse is a mistake (an unclosed bracket, a missing quote), never the string it was typed as."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as err:
        if text.lstrip().startswith(("[", "{")):
            # TOML counts columns from the start of "v = ": count them from the start of the value instead
            where = re.sub(r"at line 1, column (\d+)", lambda m: f"at character {int(m[1]) - 4}", str(err))
            raise ConfigError(f"--{dotted}={text}: not a valid TOML list or table: {where}") from None
        return text


def from_dict(raw: dict[str, Any]) -> Config:
    sections = {f.name: f for f in dataclasses.fields(Config)}
    built: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in sections:
            raise ConfigError(_unknown("section", name, list(sections)))
        if not isinstance(value, dict):
            raise ConfigError(f"'{name}' must be a [section] table, got {value!r}")
        built[name] = build_section(name, sections[name].default_factory, value)  # type: ignore[misc]
    return Config(**built)


def build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    tables = {name: f for name, f in fields.items() if "plugin" in f.metadata}
    kwargs, rest = {}, {}
    for key, value in values.items():
        if key in fields and key not in tables:
            kwargs[key] = _coerce(f"{section}.{key}", value, hints[key], fields[key].metadata)
        else:
            rest[key] = value
    if not tables:
        if rest:
            key = next(iter(rest))
            raise ConfigError(_unknown("key", f"{section}.{key}", [f"{section}.{k}" for k in fields]))
        return cls(**kwargs)
    core = [f"{section}.{k}" for k in fields if k not in tables]
    for name, f in tables.items():
        kind, chosen_by = f.metadata["plugin"], f.metadata["chosen_by"]
        if chosen_by:
            chosen = kwargs.get(chosen_by, fields[chosen_by].default)
            options = _plugin_options_type(kind, chosen, f"{section}.{chosen_by}")
            kwargs[name] = _plugin_table(section, chosen, options, rest, kind, core)
        else:
            kwargs[name] = {
                plugin: _plugin_table(section, plugin, options, rest, kind, core, flat=False)
                for plugin, options in _all_plugin_options(kind).items()
            }
    if rest:  # keys no table took
        key = next(iter(rest))
        allowed = core + [f"{section}.{p}.{k}" for p, opts in _section_plugin_types(cls) for k in _field_names(opts)]
        raise ConfigError(_moved(section, key, cls) or _unknown("key", f"{section}.{key}", allowed))
    return cls(**kwargs)


def _plugin_table(section: str, plugin: str, options: type | None, rest: dict[str, Any], kind: str,
                  core: list[str], flat: bool = True) -> Any:  # fmt: skip
    """The typed table of `plugin` from `[section.<plugin>]` and, with `flat`, from the section's own keys that
    are the plug-in's (as written before plug-ins had tables); what it takes leaves `rest`."""
    own = rest.pop(plugin, {}) if isinstance(rest.get(plugin), dict) else {}
    if options is None:
        if own:
            raise ConfigError(f"[{section}.{plugin}]: {kind.replace('_', ' ')} '{plugin}' has no keys of its own")
        return None
    names = _field_names(options)
    if flat:
        for key in [k for k in rest if k in names]:
            if key in own:
                raise ConfigError(f"{section}.{key} is given twice: in [{section}] and in [{section}.{plugin}]")
            own[key] = rest.pop(key)
    for key in own:
        if key not in names:
            allowed = core + [f"{section}.{plugin}.{k}" for k in names]
            raise ConfigError(_unknown("key", f"{section}.{plugin}.{key}", allowed))
    return build_section(f"{section}" if flat else f"{section}.{plugin}", options, own)


def _section_plugin_types(cls: type) -> list[tuple[str, type]]:
    out = []
    for f in dataclasses.fields(cls):
        if "plugin" in f.metadata:
            kind = f.metadata["plugin"]
            out += [(p.name, t) for p in plugins.plugins(kind) if (t := _safe_options(p)) is not None]
    return out


def _safe_options(plugin: plugins.Plugin) -> type | None:
    try:
        return plugin.options_type()
    except plugins.PluginError:
        return None


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _moved(section: str, key: str, cls: type) -> str:
    """A key of an older config that now lives in a plug-in's table (`track.wandb_project`): where to write it."""
    for plugin, options in _section_plugin_types(cls):
        rest = key.removeprefix(f"{plugin}_")
        if rest != key and rest in _field_names(options):
            return (f"{section}.{key} is now {section}.{plugin}.{rest}: write `{rest} = ...` under [{section}.{plugin}]"
                    f" or --{section}.{plugin}.{rest}=...")  # fmt: skip
    return ""


def _unknown(what: str, name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown {what} '{name}'{hint}; allowed: {', '.join(allowed)}"


def _coerce(key: str, value: Any, hint: Any, meta: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        (item,) = typing.get_args(hint)
        if item is float:
            numbers = isinstance(value, list) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
            )
            if not numbers:
                raise ConfigError(f"{key} = {value!r} must be a list of numbers")
            if not all(math.isfinite(v) for v in value):
                raise ConfigError(f"{key} = {value!r} must hold finite numbers (no nan or inf)")
            return [float(v) for v in value]
        if item is int:  # from TOML a list of integers; from the command line "4,4" or "[4, 4]"
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                value = [int(v) if v.strip(" []").isdigit() else v for v in (v.strip(" []") for v in value)]
            if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{key} = {value!r} must be a list of integers")
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} = {value!r} must be a list of strings")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r} must be an integer")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r} must be a number")
        if not math.isfinite(value):  # nan passes every bound check, inf passes a lower bound
            raise ConfigError(f"{key} = {value!r} must be a finite number (no nan or inf)")
        value = float(value)
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} must be a string")
        return value
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise ConfigError(f"{key} = {value!r} is too small; it must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} = {value!r} is too large; it must be <= {hi}")
    return value


def check_config(cfg: Config) -> None:
    """Checks that involve more than one key."""
    check_run_name(cfg.run.name)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for section in (cfg.model, cfg.optim, *cfg.track.options.values()):  # what the plug-ins check themselves
        options = getattr(section, "options", section)
        if hasattr(options, "check"):
            options.check()
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}")
    if p.dp_shard == 0:
        raise ConfigError("parallel.dp_shard = 0 is not allowed; use a positive size or -1")
    if p.tp > 1 and p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError(
            f"train.seq_len = {t.seq_len} must be divisible by parallel.tp = {p.tp} with parallel.sequence_parallel"
        )
    if p.tp > 1 and t.ce_chunks > 1:
        raise ConfigError("train.ce_chunks > 1 is for tp = 1; with parallel.tp > 1 use parallel.loss_parallel")
    if p.tp > 1 and t.ce_fused:
        raise ConfigError("train.ce_fused is for tp = 1; with parallel.tp > 1 use parallel.loss_parallel")
    if t.fp8 != "none" and p.tp > 1:
        raise ConfigError("train.fp8 with parallel.tp > 1 is not supported yet; use data parallelism (FSDP) only")
    # Whether parallel.tp can split the model is the family's to say (liandan.model.spec.check_model_config).
    if t.micro_batch and t.global_batch % t.micro_batch:
        raise ConfigError(
            f"train.global_batch = {t.global_batch} must be a multiple of train.micro_batch = {t.micro_batch}"
        )
    for module in t.callbacks:
        if not _MODULE_NAME.match(module):
            raise ConfigError(f"train.callbacks: {module!r} is not a module name (package.module)")
    check_exporters_named(cfg.track.exporters)
    if t.preference_loss != "dpo" and t.objective != "dpo":
        raise ConfigError(f'train.preference_loss = "{t.preference_loss}" is for train.objective = "dpo", not'
                          f' "{t.objective}"')  # fmt: skip
    if t.preference_loss == "orpo" and t.dpo_label_smoothing:
        raise ConfigError('train.dpo_label_smoothing does not apply to train.preference_loss = "orpo": set it to 0')
    if cfg.schedule.warmup_steps > t.steps:
        raise ConfigError(f"schedule.warmup_steps = {cfg.schedule.warmup_steps} exceeds train.steps = {t.steps}")


def check_exporters_named(names: list[str]) -> None:
    known = plugins.names("exporter")
    for name in names:
        if name not in known:
            raise ConfigError("track.exporters: " + _unknown("exporter", name, known))
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ConfigError(f"track.exporters names {', '.join(repeated)} more than once")


def check_run_name(name: str) -> None:
    """A run's directory is `<output_dir>/<name>`: a name that is a path, or `.`/`..`, would put it elsewhere or
    share it with other runs. Empty is allowed: it stands for `<config name>-<timestamp>`."""
    if name == "":
        return
    path_like = any(c in name for c in "/\\") or name in (".", "..") or not name.strip()
    # a newline or an escape in a directory name breaks every listing, log line and terminal that shows it
    control = any(ord(c) < 32 or 127 <= ord(c) < 160 for c in name)
    if path_like or control:
        raise ConfigError(
            f"run.name = {name!r} must be one directory name: not blank, not '.' or '..', without '/', '\\' or"
            " control characters (newline, tab, NUL...) (the run directory goes under run.output_dir)"
        )


def describe(cls: type = Config) -> list[tuple[str, Any, str]]:
    """(key, default, help) for every key, plug-ins' tables included (`model.llama.dim`): the source of
    `liandan config --keys`."""
    rows = []
    for section in dataclasses.fields(cls):
        table = section.default_factory  # type: ignore[misc]
        for f in dataclasses.fields(table):  # type: ignore[arg-type]
            if "plugin" in f.metadata:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((f"{section.name}.{f.name}", default, f.metadata.get("help", "")))
        for plugin, options in _section_plugin_types(table):  # type: ignore[arg-type]
            for f in dataclasses.fields(options):
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                rows.append((f"{section.name}.{plugin}.{f.name}", default, f.metadata.get("help", "")))
    return rows
