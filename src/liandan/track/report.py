"""`liandan report`: one HTML file that shows one or several runs to someone without liandan, offline.

For each run: its summary (status, steps, tokens, losses, goodput, restarts), its loss, learning-rate,
throughput and MFU curves with its incidents marked (the same marks as training.png), its incident timeline,
evaluations and forecasts, its scores before and after fine-tuning (`liandan eval --against --record`), and
its resolved config; with several runs, their losses on one chart. Everything
is in the file: the charts are plotly.js figures with plotly.js itself inlined from the installed `plotly`
package (without it, the PNGs, inlined as data URIs), the styles inline, no request leaves the page. The PNGs
are written beside the HTML file too, for slides and messages.

The numbers come from the project's run store, brought up to date with the run's files first; where the store
cannot be written (a run directory on a read-only share), from a store made for the report in a temporary
directory. The incident timeline is handed in by the caller (the CLI has it from the resilience layer, which
this layer does not import).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
import sqlite3
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liandan.config import ConfigError
from liandan.run import RunDir, atomic_write, check_output
from liandan.track import report_tax
from liandan.track.marks import CATEGORIES, Mark, incident_marks
from liandan.track.plot import VALIDATION_COLOUR, draw_comparison, draw_run, png_bytes
from liandan.track.store import RunStore, StoreError, is_run_dir

MAX_POINTS = 4000  # per curve: a longer run's curve is thinned by the store, spikes kept (its low/high)
CHARTS = (  # metric key, chart title, y-axis title
    ("loss", "loss", "loss"),
    ("lr", "learning rate", "lr"),
    ("tokens_per_s", "throughput", "tokens / s"),
    ("mfu", "MFU", "model FLOPs utilisation"),
    ("moe/load_max", "expert load (the most loaded expert of any MoE block)", "max / mean"),  # MoE runs only
)


@dataclass
class RunData:
    """What the report shows of one run."""

    name: str
    path: Path
    row: dict[str, Any]  # the store's `run(name)`
    curves: dict[str, dict[str, list]]
    marks: list[Mark]
    evaluations: list[dict]
    forecasts: list[dict]
    timeline: list[str]
    loss_by_tokens: dict[str, list] | None = None
    png: bytes | None = field(default=None, repr=False)
    tax: list[dict] = field(default_factory=list)  # "eval_tax" events: before and after fine-tuning
    tax_png: bytes | None = field(default=None, repr=False)


def check_runs(paths: Sequence[Path | str]) -> list[Path]:
    """The run directories given, or ConfigError naming the first that is not one."""
    if not paths:
        raise ConfigError("name at least one run directory")
    found = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise ConfigError(f"{given}: no such run directory")
        if not is_run_dir(path):
            raise ConfigError(f"{given}: not a run directory (no config.toml, metrics.jsonl or events.jsonl)")
        found.append(path)
    return found


def default_output(paths: Sequence[Path]) -> Path:
    """One run's report goes in its run directory; several runs' in the current directory."""
    return RunDir(Path(paths[0])).report if len(paths) == 1 else Path("report.html")


def write_report(runs: Sequence[tuple[Path, list[str]]], out: Path) -> list[Path]:
    """Write the report of `runs` ((run directory, incident timeline lines) each) to `out` and its PNGs beside
    it (`<stem>-<run>.png`, `<stem>-compare.png`); returns the files written, the HTML first."""
    paths = check_runs([path for path, _ in runs])
    out = Path(out)
    if out.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"{out}: the report is an HTML file; name it with .html")
    check_output(out)
    data = [gather(path, lines) for path, (_, lines) in zip(paths, runs, strict=True)]
    written = [out]
    for run in data:
        for picture, suffix in ((run.png, ""), (run.tax_png, "-tax")):
            if picture is None:
                continue
            png = out.with_name(f"{out.stem}-{_file_safe(run.name)}{suffix}.png")
            if png in written:  # runs of one name from two projects
                png = png.with_name(f"{png.stem}-{len(written)}.png")
            atomic_write(png, picture)
            written.append(png)
    compare = _comparison(data)
    compare_png = None
    if compare is not None:
        curves, xlabel = compare
        compare_png = png_bytes(draw_comparison(curves, xlabel, "training loss"))
        written.append(out.with_name(f"{out.stem}-compare.png"))
        atomic_write(written[-1], compare_png)
    atomic_write(out, render(data, compare, compare_png))
    return written


def gather(path: Path, timeline: list[str]) -> RunData:
    room = RunDir(Path(path))
    with _store_of(room) as store:
        name = room.name
        row = store.run(name)
        curves = {key: store.curve(name, key, max_points=MAX_POINTS) for key, _, _ in CHARTS}
        incidents = store.incidents(name)
        times = {"y": [], "step": []}
        if any(not isinstance(e.get("step"), int) for e in incidents):  # placed by time, at a logged step
            times = store.curve(name, "time")
        marks = incident_marks(incidents, zip(times["y"], times["step"], strict=True))
        try:
            by_tokens = store.curve(name, "loss", x="tokens", max_points=MAX_POINTS)
        except ValueError:  # a run whose config does not say its batch
            by_tokens = None
        data = RunData(name, room.path, row, curves, marks, store.evaluations(name), store.forecasts(name),
                       list(timeline), by_tokens)  # fmt: skip
    drawn = draw_run(room)
    if drawn is not None:
        data.png = png_bytes(drawn[0])
    data.tax = [e for e in data.evaluations if e.get("kind") == "eval_tax"]
    tax = report_tax.newest(data.tax)
    drawn_tax = report_tax.draw(tax) if tax is not None else None
    if drawn_tax is not None:
        data.tax_png = png_bytes(drawn_tax)
    return data


@contextmanager
def _store_of(room: RunDir) -> Iterator[RunStore]:
    """The project's store, up to date with the run; a store of its own when that one cannot be written."""
    store = None
    try:
        store = RunStore.of_run(room)
        store.ingest(room)
    except (StoreError, sqlite3.Error, OSError):
        if store is not None:
            store.close()
        store = None
    if store is not None:
        with store:
            yield store
        return
    with (
        tempfile.TemporaryDirectory(prefix="liandan-report-") as scratch,
        RunStore(room.project, database=Path(scratch) / "liandan.db") as store,
    ):
        store.ingest(room)
        yield store


# -- the page ------------------------------------------------------------------------------------------------
def render(data: Sequence[RunData], compare: tuple[dict, str] | None, compare_png: bytes | None = None) -> str:
    plotly_js = _plotly_js()
    figures: dict[str, dict] = {}
    sections = []
    if len(data) > 1:
        sections.append(_comparison_section(data, compare, figures, plotly_js is not None, compare_png))
    for index, run in enumerate(data):
        sections.append(_run_section(index, run, figures, plotly_js is not None))
    names = ", ".join(run.name for run in data)
    scripts = ""
    if plotly_js is not None and figures:
        scripts = (f"<script>{plotly_js}</script>\n<script>\nconst FIGURES = {_script_json(figures)};\n"
                   f"{_DRAW}</script>")  # fmt: skip
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return _PAGE.format(title=_e(f"liandan report: {names}"), style=_STYLE + report_tax.STYLE, generated=generated,
                        body="\n".join(sections), scripts=scripts)  # fmt: skip


def _run_section(index: int, run: RunData, figures: dict, interactive: bool) -> str:
    parts = [f'<section class="run" id="run-{index}">', f"<h2>{_e(run.name)}</h2>",
             f'<p class="path">{_e(str(run.path.resolve()))}</p>', _summary_table(run)]  # fmt: skip
    if interactive:
        charts = []
        for key, title, y_title in CHARTS:
            curve = run.curves[key]
            if not curve["step"]:
                continue
            traces = [_line(curve, "train" if key == "loss" else title, "#1f77b4")]
            if key == "loss":
                traces += _validation_and_forecast(run)
            chart_id = f"run{index}-{key}"
            figures[chart_id] = _figure(title, y_title, "step", traces, run.marks)
            if key == "mfu":  # a percentage, as the console and the dashboard show it
                figures[chart_id]["layout"]["yaxis"]["tickformat"] = ".3~%"
            charts.append(f'<div class="chart" id="{chart_id}"></div>')
        parts.append(f'<div class="charts">{"".join(charts)}</div>' if charts else "<p>no metrics logged yet</p>")
    elif run.png is not None:
        parts.append(_img(run.png, f"curves of {run.name}"))
    parts.append("<h3>Incidents</h3>")
    if run.timeline:
        lines = "".join(f"<div>{_e(line)}</div>" for line in run.timeline)
        parts.append(f'<div class="timeline">{lines}</div>')
    else:
        parts.append("<p>no incidents</p>")
    evaluations = [e for e in run.evaluations if e.get("kind") != "eval_tax"]  # shown in a section of its own
    if evaluations:
        parts += ["<h3>Evaluations</h3>", _table(evaluations)]
    if run.tax:
        png = _img(run.tax_png, f"before and after fine-tuning of {run.name}") if run.tax_png else None
        parts.append(report_tax.section(run.tax, f"run{index}-tax", figures, interactive, png))
    if run.forecasts:
        parts += ["<h3>Forecasts of the final loss</h3>", _forecast_table(run.forecasts)]
    config = run.row.get("config") or ""
    parts.append(f"<details><summary>resolved config</summary><pre>{_e(config or '(none saved)')}</pre></details>")
    parts.append("</section>")
    return "\n".join(parts)


HEADINGS = ("run", "status", "steps", "tokens", "loss", "val loss", "goodput", "restarts", "incidents")


def _comparison_section(data, compare, figures: dict, interactive: bool, png: bytes | None) -> str:
    rows = "".join(
        f"<tr><td><a href='#run-{i}'>{_e(r.name)}</a></td><td>{_e(r.row['status'])}</td>"
        f"<td>{_n(r.row.get('step'))}</td><td>{_n(r.row.get('tokens'))}</td><td>{_n(_loss(r))}</td>"
        f"<td>{_n(_val_loss(r))}</td><td>{_pct(r.row.get('goodput'))}</td><td>{_n(r.row.get('restarts'))}</td>"
        f"<td>{len(r.marks)}</td></tr>"
        for i, r in enumerate(data)
    )
    head = "".join(f"<th>{h}</th>" for h in HEADINGS)
    parts = ['<section class="compare"><h2>Runs compared</h2>', f"<table><tr>{head}</tr>{rows}</table>"]
    if compare is not None and interactive:
        curves, xlabel = compare
        palette = ["#1f77b4", "#2ca02c", "#d62728", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
        traces = [_line({"x": x, "y": y}, _e(name), palette[i % len(palette)])
                  for i, (name, (x, y)) in enumerate(curves.items())]  # fmt: skip
        figures["compare"] = _figure("training loss", "loss", xlabel, traces, [], height=420, log_y=True)
        parts.append('<div class="chart wide" id="compare"></div>')
    elif png is not None:
        parts.append(_img(png, "training loss of the runs compared"))
    parts.append("</section>")
    return "\n".join(parts)


def _comparison(data: Sequence[RunData]) -> tuple[dict[str, tuple[list, list]], str] | None:
    """The runs' losses on one x axis: tokens when every run says its batch (runs of different batches
    compare fairly), else steps."""
    logged = [r for r in data if r.curves["loss"]["step"]]
    if len(data) < 2 or not logged:
        return None
    if all(r.loss_by_tokens and r.loss_by_tokens["x"] for r in logged):
        return {r.name: (r.loss_by_tokens["x"], r.loss_by_tokens["y"]) for r in logged}, "tokens"
    return {r.name: (r.curves["loss"]["step"], r.curves["loss"]["y"]) for r in logged}, "step"


def _summary_table(run: RunData) -> str:
    row, summary = run.row, run.row.get("summary") or {}
    config = _config_tables(row.get("config") or "")
    planned = config.get("train", {}).get("steps")
    steps = _n(row.get("step")) + (
        f" of {planned:,}" if isinstance(planned, int) and row.get("step") is not None else ""
    )
    items = [
        ("status", row.get("status")),
        ("steps", steps),
        ("mixture", _mixture(config.get("data", {}))),
        ("tokens", _n(row.get("tokens"))),
        ("loss (last)", _n(_loss(run))),
        ("validation loss", _n(_val_loss(run))),
        ("goodput", _pct(row.get("goodput"))),
        ("restarts", _n(row.get("restarts"))),
        ("incidents", f"{len(run.marks)} marked"),
        ("parameters", _n(summary.get("parameters"))),
        ("layout", summary.get("layout")),
        ("dtype", summary.get("dtype")),
        ("tokens / s", _n(summary.get("tokens_per_s"))),
        ("started", _when(row.get("started"))),
    ]
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(str(v))}</td></tr>" for k, v in items if v not in (None, "", "-"))
    return f'<table class="summary">{cells}</table>'


def _loss(run: RunData) -> Any:
    final = run.row.get("final_loss")
    return final if final is not None else run.row.get("loss")


def _val_loss(run: RunData) -> Any:
    if run.row.get("val_loss") is not None:
        return run.row["val_loss"]
    losses = [e["loss"] for e in run.evaluations if e.get("kind") == "eval" and isinstance(e.get("loss"), float)]
    return losses[-1] if losses else None


def _config_tables(config: str) -> dict[str, Any]:
    import tomllib

    try:
        return {k: v for k, v in tomllib.loads(config).items() if isinstance(v, dict)}
    except tomllib.TOMLDecodeError:
        return {}


def _mixture(data: dict[str, Any]) -> str | None:
    """The sources a run trained on and their weights: "web 75%, code 25%" (by size when none were given)."""
    sources = data.get("stores") or data.get("paths") or []
    names = [str(s).rstrip("/").rsplit("/", 1)[-1] for s in sources if isinstance(s, str)]
    weights = data.get("weights") or []
    if not names:
        return None
    if len(weights) != len(names) or not all(isinstance(w, (int, float)) for w in weights) or not sum(weights):
        return ", ".join(names) + (" (weighted by size)" if len(names) > 1 else "")
    return ", ".join(f"{n} {w / sum(weights):.0%}" for n, w in zip(names, weights, strict=True))


def _table(events: list[dict]) -> str:
    rows = [_flatten({k: v for k, v in e.items() if k not in ("time", "seq")}) for e in events]
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if k not in columns and not isinstance(v, (list, dict))]
    columns = [c for c in ("step", "kind") if c in columns] + [c for c in columns if c not in ("step", "kind")]
    columns = columns[:12]
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_e(_n(row.get(c)))}</td>" for c in columns) + "</tr>" for row in rows)
    return f'<table class="events"><tr>{head}</tr>{body}</table>'


def _forecast_table(forecasts: list[dict]) -> str:
    rows = "".join(
        f"<tr><td>{_n(f.get('step'))}</td><td>{_n(f.get('final_loss'))}</td>"
        f"<td>[{_n(f.get('low'))}, {_n(f.get('high'))}]</td><td>{_pct(f.get('confidence'))}</td>"
        f"<td>{_n(f.get('total_steps'))}</td></tr>"
        for f in forecasts[-20:]
    )
    return ("<table class='events'><tr><th>made at step</th><th>final loss</th><th>interval</th><th>confidence</th>"
            f"<th>for step</th></tr>{rows}</table>")  # fmt: skip


def _flatten(record: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in record.items():
        if isinstance(value, dict) and not prefix:
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# -- plotly figures ------------------------------------------------------------------------------------------
def _line(curve: dict, name: str, colour: str) -> dict:
    return {"type": "scatter", "mode": "lines", "name": name, "x": curve["x"], "y": _finite(curve["y"]),
            "line": {"color": colour, "width": 1.4}}  # fmt: skip


def _validation_and_forecast(run: RunData) -> list[dict]:
    traces = []
    evals = [e for e in run.evaluations if e.get("kind") == "eval" and isinstance(e.get("loss"), (int, float))]
    if evals:
        traces.append({"type": "scatter", "mode": "lines+markers", "name": "validation",
                       "x": [e.get("step") for e in evals], "y": _finite([e["loss"] for e in evals]),
                       "line": {"color": VALIDATION_COLOUR, "width": 1.4}, "marker": {"size": 6}})  # fmt: skip
    if run.forecasts:
        f = run.forecasts[-1]
        if all(isinstance(f.get(k), (int, float)) for k in ("final_loss", "low", "high", "total_steps")):
            confidence = f"{100 * f.get('confidence', 0):.0f}%"
            traces.append({"type": "scatter", "mode": "markers", "name": f"forecast at step {f.get('step')}",
                           "x": [f["total_steps"]], "y": [f["final_loss"]],
                           "error_y": {"type": "data", "symmetric": False, "array": [f["high"] - f["final_loss"]],
                                       "arrayminus": [f["final_loss"] - f["low"]], "color": "#17becf"},
                           "marker": {"color": "#17becf", "size": 8, "symbol": "diamond"},
                           "hovertemplate": f"forecast %{{y:.4f}} ({confidence} interval)<extra></extra>"})  # fmt: skip
    return traces


def _figure(title: str, y_title: str, x_title: str, traces: list[dict], marks: Sequence[Mark], height: int = 320,
            log_y: bool = False) -> dict:  # fmt: skip
    data = list(traces) + _mark_traces(marks)
    shapes = [{"type": "rect", "xref": "x", "yref": "paper", "x0": m.back_to, "x1": m.step, "y0": 0, "y1": 1,
               "fillcolor": CATEGORIES[m.category][1], "opacity": 0.1, "line": {"width": 0}, "layer": "below"}
              for m in marks if m.back_to is not None and m.back_to < m.step]  # fmt: skip
    layout = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "height": height,
        "margin": {"l": 60, "r": 40, "t": 48, "b": 44},
        "modebar": {"orientation": "v"},  # upright in the right margin: across the top it covered the legend
        "xaxis": {"title": {"text": x_title}},
        "yaxis": {"title": {"text": y_title}, "type": "log" if log_y else "linear"},
        "yaxis2": {"overlaying": "y", "range": [0, 1], "visible": False, "fixedrange": True},
        "shapes": shapes,
        "showlegend": True,
        "legend": {
            "orientation": "h",
            "x": 1,
            "xanchor": "right",
            "y": 1.02,
            "yanchor": "bottom",
            "font": {"size": 11},
        },
        "hovermode": "closest",
        "template": {
            "layout": {"plot_bgcolor": "#fff", "xaxis": {"gridcolor": "#eee"}, "yaxis": {"gridcolor": "#eee"}}
        },
    }
    xs = {x for trace in traces for x in trace.get("x", []) if isinstance(x, (int, float))}
    if len(xs) == 1:  # one point: plotly would span x-1..x+1 (99..101); from 0 reads as a step count
        (x,) = xs
        layout["xaxis"]["range"] = [min(0, 2 * x), max(1, 2 * x)]
    return {"data": data, "layout": layout}


def _mark_traces(marks: Sequence[Mark]) -> list[dict]:
    """One trace per category: a dashed vertical line per mark on an invisible 0..1 axis, a point at its top
    whose hover says what happened; toggling the category in the legend hides its marks."""
    traces = []
    for category, (name, colour) in CATEGORIES.items():
        chosen = [m for m in marks if m.category == category]
        if not chosen:
            continue
        x, y, size, text = [], [], [], []
        for m in chosen:
            label = _e(f"step {m.step}: {m.label}")  # plotly reads tags in text: a traceback's <module> too
            x += [m.step, m.step, None]
            y += [0, 1, None]
            size += [0, 9, 0]
            text += [label, label, ""]
        traces.append({"type": "scatter", "mode": "lines+markers", "name": name, "legendgroup": category,
                       "yaxis": "y2", "x": x, "y": y, "text": text, "hovertemplate": "%{text}<extra></extra>",
                       "line": {"color": colour, "width": 1.2, "dash": "dash"},
                       "marker": {"color": colour, "size": size, "symbol": "triangle-down"},
                       "meta": "incident"})  # fmt: skip
    return traces


def _finite(values: list) -> list:
    return [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]


def _plotly_js() -> str | None:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        return None
    return get_plotlyjs()


# -- small pieces --------------------------------------------------------------------------------------------
def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _n(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isfinite(value) and 1e3 <= abs(value) < 1e15:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)


def _pct(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


def _when(stamp: Any) -> str | None:
    if not isinstance(stamp, (int, float)):
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))


def _img(png: bytes, alt: str) -> str:
    return f'<img class="png" alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _file_safe(name: str) -> str:
    return re.sub(r"[^\w.-]", "_", name)


def _script_json(value: Any) -> str:
    """JSON for inside a <script> element: no `<` that could end it or open a comment."""
    return json.dumps(value, allow_nan=False, default=str).replace("<", "\\u003c")


_DRAW = """for (const [id, fig] of Object.entries(FIGURES)) {
  Plotly.newPlot(id, fig.data, fig.layout, {displaylogo: false, responsive: true});
}
"""

_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1280px;
       padding: 0 24px 40px; color: #222; }
header { margin-bottom: 12px; }
h1 { font-size: 22px; margin: 18px 0 4px; } h2 { font-size: 18px; margin: 28px 0 2px; } h3 { font-size: 15px; }
.path, .generated { color: #777; font-size: 12px; margin: 0 0 8px; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 13px; }
th, td { border: 1px solid #e3e3e3; padding: 3px 8px; text-align: left; vertical-align: top; }
table.summary th { background: #f6f6f6; font-weight: 600; }
table.events th, .compare th { background: #f6f6f6; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr)); gap: 8px; }
.chart { border: 1px solid #eee; min-height: 320px; }
.chart.wide { min-height: 420px; }
pre { background: #f8f8f8; border: 1px solid #e6e6e6; padding: 8px; overflow-x: auto; font-size: 12px; }
.timeline { background: #f8f8f8; border: 1px solid #e6e6e6; padding: 8px; font: 12px/1.5 ui-monospace, monospace; }
.timeline div { white-space: pre-wrap; padding-left: 2em; text-indent: -2em; }
img.png { max-width: 100%; border: 1px solid #eee; }
section.run { border-top: 2px solid #ccc; margin-top: 24px; }
"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<header><h1>{title}</h1><p class="generated">written by liandan report at {generated}</p></header>
{body}
{scripts}
</body>
</html>
"""
