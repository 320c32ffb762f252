"""Pictures of runs: training.png (loss, train and validation, learning rate and throughput against step, with
the run's incidents marked on every panel) and a comparison of several runs' losses."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

from liandan.run import RunDir, atomic_write
from liandan.track.marks import CATEGORIES, Mark, incident_marks

MARKS_KEY = "liandan-marks"  # the PNG text chunk that lists the marks drawn, for readers of the picture
VALIDATION_COLOUR = "#2ca02c"  # the validation curve, in training.png, the report and the dashboard alike


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    """Write `run_dir/training.png` (or `out`); returns its path, or None when there is nothing to plot. The
    PNG's text chunk `liandan-marks` lists the incidents marked on it (step, category, label)."""
    run = RunDir(Path(run_dir))
    drawn = draw_run(run)
    if drawn is None:
        return None
    fig, marks = drawn
    out = Path(out or run.plot())
    atomic_write(out, png_bytes(fig, {MARKS_KEY: json.dumps([m.to_dict() for m in marks])}))
    return out


def run_marks(run: RunDir, records: Sequence[dict] | None = None) -> list[Mark]:
    """The incident marks of a run, from its events."""
    records = run.read_metrics() if records is None else records
    times = [(r["time"], r["step"]) for r in records if isinstance(r.get("time"), (int, float)) and "step" in r]
    return incident_marks(run.read_events(), times)


def draw_run(run: RunDir):
    """(figure, marks drawn) for a run, or None when it has no loss yet. Each mark's artists carry the gid
    `incident:<category>:<step>`."""
    records = [r for r in run.read_metrics() if isinstance(r.get("loss"), (int, float))]
    if not records:
        return None
    plt = _pyplot()
    evals = [e for e in run.read_events() if e.get("kind") == "eval" and isinstance(e.get("loss"), (int, float))]
    marks = run_marks(run, records)
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_lr, ax_tps) = plt.subplots(1, 3, figsize=(13, 3.9))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1, label="train")
    if evals:
        ax_loss.plot(
            [e["step"] for e in evals],
            [e["loss"] for e in evals],
            "o-",
            ms=3,
            label="validation",
            color=VALIDATION_COLOUR,
        )
    ax_loss.set(title="loss", xlabel="step")
    ax_loss.legend(fontsize=8, loc="upper right")
    ax_lr.plot(steps, [r.get("lr", 0) for r in records], lw=1)
    ax_lr.set(title="learning rate", xlabel="step")
    ax_tps.plot(steps, [r.get("tokens_per_s", 0) for r in records], lw=1)
    ax_tps.set(title="tokens / s", xlabel="step")
    for ax in (ax_loss, ax_lr, ax_tps):
        ax.grid(alpha=0.3)
        mark_axes(ax, marks)
    fig.suptitle(run.name)
    legend = marks_legend(fig, marks)
    fig.tight_layout(rect=(0, 0.07 if legend else 0, 1, 1))
    return fig, marks


def mark_axes(ax, marks: Sequence[Mark]) -> None:
    """Vertical lines at the marks' steps, a shaded band over the steps a rollback trained again."""
    for mark in marks:
        colour = CATEGORIES[mark.category][1]
        gid = f"incident:{mark.category}:{mark.step}"
        ax.axvline(mark.step, color=colour, lw=1.1, ls="--", alpha=0.85, gid=gid, zorder=1)
        if mark.back_to is not None and mark.back_to < mark.step:
            ax.axvspan(mark.back_to, mark.step, color=colour, alpha=0.08, lw=0, gid=gid, zorder=0)


def marks_legend(fig, marks: Sequence[Mark]):
    """One legend entry per category marked, under the panels; None when there are no marks."""
    from matplotlib.lines import Line2D

    shown = [c for c in CATEGORIES if any(m.category == c for m in marks)]
    if not shown:
        return None
    handles = [
        Line2D([], [], color=CATEGORIES[c][1], ls="--", lw=1.1, label=f"{CATEGORIES[c][0]} ({_steps_of(marks, c)})")
        for c in shown
    ]
    return fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)


def _steps_of(marks: Sequence[Mark], category: str) -> str:
    steps = [str(m.step) for m in marks if m.category == category]
    shown = ", ".join(steps[:4]) + (", ..." if len(steps) > 4 else "")
    return f"step {shown}" if len(steps) == 1 else f"steps {shown}"


def draw_comparison(curves: dict[str, tuple[list, list]], xlabel: str, title: str = "loss"):
    """Several runs' curves on one chart: `curves` maps a run's name to (x, y)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for name, (x, y) in curves.items():
        ax.plot(x, y, lw=1, label=name)
    ax.set(title=title, xlabel=xlabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def png_bytes(fig, metadata: dict[str, str] | None = None) -> bytes:
    """The figure as PNG bytes (the figure is closed)."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110, metadata=metadata or {})
    finally:
        _pyplot().close(fig)
    return buffer.getvalue()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
