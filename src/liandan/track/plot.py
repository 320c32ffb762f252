"""A picture of a run: loss (train and validation), learning rate and throughput against step."""

from __future__ import annotations

from pathlib import Path

from liandan.run import RunDir


def plot_run(run_dir: Path, out: Path | None = None) -> Path | None:
    """Write `run_dir/training.png`; returns its path, or None when there is nothing to plot."""
    run = RunDir(Path(run_dir))
    records = [r for r in run.read_metrics() if isinstance(r.get("loss"), (int, float))]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [e for e in run.read_events() if e.get("kind") == "eval"]
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_lr, ax_tps) = plt.subplots(1, 3, figsize=(13, 3.6))
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1, label="train")
    if evals:
        ax_loss.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", ms=3, label="validation")
    ax_loss.set(title="loss", xlabel="step")
    ax_loss.legend()
    ax_lr.plot(steps, [r.get("lr", 0) for r in records], lw=1)
    ax_lr.set(title="learning rate", xlabel="step")
    ax_tps.plot(steps, [r.get("tokens_per_s", 0) for r in records], lw=1)
    ax_tps.set(title="tokens / s", xlabel="step")
    for ax in (ax_loss, ax_lr, ax_tps):
        ax.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = out or run.plot()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
