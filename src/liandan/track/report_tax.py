"""The report's section "Before and after fine-tuning": the newest "eval_tax" event of a run (written by
`liandan eval TUNED --against BASE --record`) as tables and a chart.

Per task and metric: the mean over the prompt formats before and after, the change, the spread of each side
and the verdict (a drop beyond the larger spread is a tax), then each format's scores; per held-out source of
the base run: bits per byte before and after on the same windows. A tax stands out in red, a gain in green.
The chart (plotly in the page, a PNG beside it) draws the task means with bars from the lowest to the highest
format's score, and the held-out bits per byte, before and after.
"""

from __future__ import annotations

import html
import math
from typing import Any

from liandan.track.plot import _pyplot

BEFORE_COLOUR, AFTER_COLOUR, TAX_COLOUR = "#7f7f7f", "#1f77b4", "#d62728"  # a taxed "after" bar is red
TITLE = "Before and after fine-tuning"


def newest(events: list[dict]) -> dict | None:
    """The comparison to show: the newest event (of the newest checkpoint compared, when several were)."""
    return events[-1] if events else None


def section(events: list[dict], chart_id: str, figures: dict, interactive: bool, png_tag: str | None) -> str:
    """The section's HTML; its plotly figure goes into `figures` under `chart_id` when `interactive`, else the
    PNG's <img> (`png_tag`) shows the chart."""
    tax = newest(events)
    if tax is None:
        return ""
    intro = (f"<p>base {_e(str(tax.get('baseline')))} (step {_e(str(tax.get('baseline_step')))}) &rarr; "
             f"{_e(str(tax.get('checkpoint')))} (step {_e(str(tax.get('step')))}); a change counts beyond the"
             " prompt-format spread (the larger of the two): a drop beyond it is a <span class='tax'>tax</span>,"
             " a rise a <span class='gain'>gain</span>. Held-out: the base run's documents, the same windows"
             " on both sides; any rise in bits per byte is a tax.</p>")  # fmt: skip
    parts = [f"<h3>{TITLE}</h3>", intro]
    taxed = [f"{r['task']} {r['metric']}" for r in tax.get("tasks", []) if r.get("verdict") == "tax"]
    taxed += [f"held-out {r['source']}" for r in tax.get("heldout", []) if r.get("verdict") == "tax"]
    if taxed:
        parts.append(f"<p class='tax'>tax: {_e(', '.join(taxed))}</p>")
    if tax.get("tasks"):
        parts.append(_task_table(tax["tasks"]))
    if tax.get("heldout"):
        parts.append(_heldout_table(tax["heldout"]))
    parts += [f"<p class='note'>note: {_e(str(note))}</p>" for note in tax.get("notes", [])]
    if len(events) > 1:
        steps = ", ".join(str(e.get("step")) for e in events[:-1])
        parts.append(f"<p class='note'>{len(events) - 1} earlier comparison(s) in events.jsonl (step {steps})</p>")
    if interactive:
        figures[chart_id] = figure(tax)
        parts.append(f'<div class="chart" id="{chart_id}"></div>')
    elif png_tag:
        parts.append(png_tag)
    return "\n".join(parts)


def _task_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("task", "metric", "format", "before", "after", "change",
                                             "spread before &rarr; after", "verdict"))  # fmt: skip
    body = []
    for r in rows:
        verdict = r.get("verdict", "")
        css = f" class='{verdict}'" if verdict in ("tax", "gain") else ""
        formats = r.get("formats") or {}
        body.append(f"<tr{css}><td>{_e(r['task'])}</td><td>{_e(r['metric'])}</td><td>mean of {len(formats)}</td>"
                    f"<td>{_f(r['before'])}</td><td>{_f(r['after'])}</td><td>{_f(r['change'], sign=True)}</td>"
                    f"<td>{_f(r['spread_before'])} &rarr; {_f(r['spread_after'])}</td><td>{_e(verdict)}</td></tr>")  # fmt: skip
        for fmt, (then, now) in formats.items():
            body.append(f"<tr class='format'><td></td><td></td><td>{_e(fmt)}</td><td>{_f(then)}</td><td>{_f(now)}"
                        f"</td><td>{_f(now - then, sign=True)}</td><td></td><td></td></tr>")  # fmt: skip
    return f"<table class='events before-after'><tr>{head}</tr>{''.join(body)}</table>"


def _heldout_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("held-out source", "bits/byte before", "after", "change", "relative",
                                             "loss before", "loss after", "tokens", "verdict"))  # fmt: skip
    body = "".join(
        f"<tr{' class=tax' if r.get('verdict') == 'tax' else ''}><td>{_e(r['source'])}</td><td>{_f(r['before'], 4)}"
        f"</td><td>{_f(r['after'], 4)}</td><td>{_f(r['change'], 4, sign=True)}</td><td>{r['relative']:+.1%}</td>"
        f"<td>{_f(r['loss_before'], 4)}</td><td>{_f(r['loss_after'], 4)}</td><td>{r['tokens']:,}</td>"
        f"<td>{_e(r.get('verdict', ''))}</td></tr>"
        for r in rows
    )
    return f"<table class='events before-after'><tr>{head}</tr>{body}</table>"


def _colours(rows: list[dict], side: str) -> list[str]:
    if side == "before":
        return [BEFORE_COLOUR] * len(rows)
    return [TAX_COLOUR if r.get("verdict") == "tax" else AFTER_COLOUR for r in rows]


def _bars(tax: dict) -> tuple[list[str], list[tuple[float, float, float]], list[tuple[float, float, float]]]:
    """Task labels, and per label (mean, lowest, highest format) before and after."""
    labels, before, after = [], [], []
    for r in tax.get("tasks", []):
        formats = list((r.get("formats") or {}).values()) or [[r["before"], r["after"]]]
        labels.append(f"{r['task']} {r['metric']}")
        before.append((r["before"], min(f[0] for f in formats), max(f[0] for f in formats)))
        after.append((r["after"], min(f[1] for f in formats), max(f[1] for f in formats)))
    return labels, before, after


def figure(tax: dict) -> dict:
    """The plotly figure: task means (bars from the lowest to the highest format) and held-out bits per byte
    (on a second axis), before and after."""
    labels, before, after = _bars(tax)
    sources = [f"held-out {r['source']} (bits/byte)" for r in tax.get("heldout", [])]
    data = []
    rows, heldout = tax.get("tasks", []), tax.get("heldout", [])
    for name, side in (("before", before), ("after", after)):
        data.append({"type": "bar", "name": f"{name}: task mean (bars: lowest to highest format)", "x": labels,
                     "y": [m for m, _, _ in side], "marker": {"color": _colours(rows, name)}, "offsetgroup": name,
                     "error_y": {"type": "data", "symmetric": False, "array": [hi - m for m, _, hi in side],
                                 "arrayminus": [m - lo for m, lo, _ in side]}})  # fmt: skip
        if sources:
            data.append({"type": "bar", "name": f"{name}: held-out bits/byte", "x": sources, "xaxis": "x2",
                         "yaxis": "y2", "y": [r[name] for r in heldout], "offsetgroup": name,
                         "marker": {"color": _colours(heldout, name), "pattern": {"shape": "/"}}})  # fmt: skip
    split = 0.62 if sources and labels else (1.0 if labels else 0.0)
    layout = {
        "title": {"text": TITLE.lower(), "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "height": 360, "barmode": "group", "margin": {"l": 60, "r": 60, "t": 48, "b": 80},
        "xaxis": {"domain": [0, max(split - 0.06, 0.01)]}, "yaxis": {"title": {"text": "score"}},
        "xaxis2": {"domain": [min(split + 0.04, 0.99), 1], "anchor": "y2"},
        "yaxis2": {"title": {"text": "bits / byte"}, "anchor": "x2"},
        "legend": {"orientation": "h", "y": -0.25, "font": {"size": 11}},
        "template": {"layout": {"plot_bgcolor": "#fff", "yaxis": {"gridcolor": "#eee"}}},
    }  # fmt: skip
    return {"data": data, "layout": layout}


def draw(tax: dict):
    """The same chart with matplotlib (the PNG beside the report)."""
    plt = _pyplot()
    labels, before, after = _bars(tax)
    heldout = tax.get("heldout", [])
    panels = [p for p in ("tasks", "heldout") if (labels if p == "tasks" else heldout)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        rows = tax["tasks"] if panel == "tasks" else heldout
        if panel == "tasks":
            names, sides, ylabel = labels, (before, after), "score (bars: lowest to highest format)"
        else:
            names = [r["source"] for r in heldout]
            sides = ([(r["before"],) * 3 for r in heldout], [(r["after"],) * 3 for r in heldout])
            ylabel = "held-out bits / byte"
        xs = range(len(names))
        for offset, side, name in ((-0.2, sides[0], "before"), (0.2, sides[1], "after")):
            means = [m for m, _, _ in side]
            errors = [[m - lo for m, lo, _ in side], [hi - m for m, _, hi in side]] if panel == "tasks" else None
            ax.bar([x + offset for x in xs], means, 0.4, color=_colours(rows, name), label=name, yerr=errors,
                   capsize=3)  # fmt: skip
        ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        taxed = TAX_COLOUR in _colours(rows, "after")
        ax.legend(fontsize=8, title="red: a tax" if taxed else None, title_fontsize=8)
    fig.suptitle(f"{TITLE.lower()}: step {tax.get('baseline_step')} of the base -> step {tax.get('step')}")
    fig.tight_layout()
    return fig


def _f(value: Any, digits: int = 3, sign: bool = False) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _e(text: str) -> str:
    return html.escape(text, quote=True)


STYLE = """
tr.tax td, .tax { background: #fde2e1; color: #a01010; font-weight: 600; }
tr.gain td, .gain { background: #e3f5e1; color: #1d6b1d; }
tr.format td { color: #666; font-size: 12px; }
p.note { color: #666; font-size: 12px; }
"""
