"""`liandan runs [DIR]`: the runs of a project directory from its run store, listed or compared side by side."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import tomllib

from liandan.config import ConfigError


def add_commands(sub) -> None:
    p = sub.add_parser(
        "runs",
        description=(
            "Bring the project's run store (DIR/liandan.db) up to date with its run directories and list their"
            " runs, newest first; --compare sets chosen runs side by side with the config keys that differ."
        ),
    )
    p.add_argument("dir", nargs="?", default="runs", metavar="DIR", help="project directory (default: runs)")
    p.add_argument("--compare", nargs="+", metavar="RUN", help="two or more run names to set side by side")
    p.add_argument("--rebuild", action="store_true", help="make the store anew from the run directories' files")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(command=cmd_runs)


def cmd_runs(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.run.layout import project_store
    from liandan.track.store import RunStore, StoreError, is_run_dir

    if overrides:
        raise ConfigError(f"runs takes no config overrides (got {overrides[0]})")
    project = Path(args.dir)
    if project.exists() and not project.is_dir():
        raise ConfigError(f"{project} is a file, not a project directory (the parent of run directories)")
    if not project.is_dir():
        raise ConfigError(f"project directory not found: {project} (the parent of run directories, run.output_dir)")
    holds_runs = any(is_run_dir(p) for p in project.iterdir() if p.is_dir())
    if is_run_dir(project) and not holds_runs:
        raise ConfigError(f"{project} is a run directory; its project directory is {project.resolve().parent}")
    if args.compare is not None and len(args.compare) < 2:
        raise ConfigError("--compare takes two or more run names")
    if not holds_runs and not project_store(project).exists():  # no store is made where there is nothing to keep
        if args.compare:
            raise ConfigError(f"no runs in {project}, so none named {args.compare[0]!r}")
        print("[]" if args.json else f"no runs in {project}")
        return 0
    try:
        with RunStore(project) as store:
            store.rebuild() if args.rebuild else store.sync()
            if args.compare:
                return _compare(store, args.compare, args.json)
            runs = store.runs()
    except StoreError as err:
        raise ConfigError(str(err)) from None
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "config"} for r in runs], indent=1, default=str))
    elif not runs:
        print(f"no runs in {project}")
    else:
        _print_table(_runs_table(runs))
    return 0


# -- the list ----------------------------------------------------------------------------------------------
COLUMNS = ("run", "status", "steps", "tokens", "loss", "val loss", "goodput", "restarts", "incidents", "forecast")


def _runs_table(runs: list[dict]) -> tuple[tuple[str, ...], list[list[str]]]:
    rows = []
    for r in runs:
        loss = r["final_loss"] if r["status"] == "finished" and r["final_loss"] is not None else r["loss"]
        rows.append([r["name"], r["status"], _int(r["step"]), _count(r["tokens"]), _loss(loss), _loss(r["val_loss"]),
                     _share(r["goodput"]), _int(r["restarts"]), str(r["incidents"]), _forecast(r["forecast"])])  # fmt: skip
    return COLUMNS, rows


def _forecast(event: dict | None) -> str:
    if not event or not isinstance(event.get("final_loss"), (int, float)):
        return "-"
    low, high = event.get("low"), event.get("high")
    spread = f" [{low:.3f}-{high:.3f}]" if isinstance(low, (int, float)) and isinstance(high, (int, float)) else ""
    return f"{event['final_loss']:.3f}{spread} @{event.get('step', '?')}"


# -- comparing ---------------------------------------------------------------------------------------------
def _compare(store, names: list[str], as_json: bool) -> int:
    known = {r["name"] for r in store.runs()}
    missing = [n for n in names if n not in known]
    if missing:
        shown = ", ".join(sorted(known)[:8]) + (", ..." if len(known) > 8 else "")
        raise ConfigError(f"no run named {missing[0]!r} in {store.project} (runs: {shown or 'none'})")
    metrics = {name: key_metrics(store, name) for name in names}
    configs = {name: _flat(store.run(name)["config"]) for name in names}
    keys = sorted(set().union(*configs.values()))
    differ = {k: [configs[n].get(k) for n in names] for k in keys if len({_key(configs[n].get(k)) for n in names}) > 1}
    if as_json:
        print(json.dumps({"runs": names, "metrics": metrics, "config_differs": differ}, indent=1, default=str))
        return 0
    formats = {"final_loss": _loss, "best_val_loss": _loss, "tokens_per_s": _count, "mfu": _share,
               "goodput": _share, "steps": _int, "tokens": _count, "status": str}  # fmt: skip
    rows = [[label, *(formats[label](metrics[n][label]) for n in names)] for label in formats]
    _print_table((("", *names), rows), title="key metrics", left=1)
    if differ:
        _print_table((("config key", *names), [[k, *(_value(v) for v in vs)] for k, vs in differ.items()]),
                     title="config keys that differ", left=1)  # fmt: skip
    else:
        print("their configs are the same")
    return 0


def key_metrics(store, name: str) -> dict[str, Any]:
    """What tells two runs apart at a glance: final loss, best validation loss, throughput, MFU, goodput."""
    run = store.run(name)
    summary = run["summary"]
    evals = [e["loss"] for e in store.evaluations(name) if isinstance(e.get("loss"), (int, float))]
    best_val = min([*evals, *([summary["val_loss"]] if isinstance(summary.get("val_loss"), (int, float)) else [])],
                   default=None)  # fmt: skip
    return {
        "status": run["status"],
        "steps": run["step"],
        "tokens": run["tokens"],
        "final_loss": run["final_loss"] if run["final_loss"] is not None else run["loss"],
        "best_val_loss": best_val,
        # The median step, not the mean: the first steps (compilation, warm-up) are no measure of the run.
        "tokens_per_s": _median(store.curve(name, "tokens_per_s")["y"]) or summary.get("tokens_per_s"),
        "mfu": _median(store.curve(name, "mfu")["y"]),
        "goodput": run["goodput"],
    }


def _median(values: list) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def _flat(toml_text: str) -> dict[str, Any]:
    try:
        tables = tomllib.loads(toml_text) if toml_text else {}
    except tomllib.TOMLDecodeError:
        return {}
    return {f"{section}.{key}": value for section, table in tables.items() if isinstance(table, dict)
            for key, value in table.items()}  # fmt: skip


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# -- printing ----------------------------------------------------------------------------------------------
def _print_table(table: tuple[tuple[str, ...], list[list[str]]], title: str | None = None, left: int = 2) -> None:
    """Names and words (the first `left` columns) to the left, numbers to the right."""
    from rich.console import Console
    from rich.table import Table

    header, rows = table
    shown = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for i, column in enumerate(header):
        shown.add_column(column, justify="left" if i < left else "right", no_wrap=i == 0, overflow="fold")
    for row in rows:
        shown.add_row(*row)
    # A pipe or a file gets the whole table, not one folded to 80 columns.
    Console(width=None if sys.stdout.isatty() else 200, highlight=False).print(shown)


def _int(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _count(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else "-"


def _share(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


def _value(value: Any) -> str:
    return "(unset)" if value is None else json.dumps(value, default=str) if not isinstance(value, str) else value
