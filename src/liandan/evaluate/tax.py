"""The alignment tax: a fine-tuned checkpoint against the model it started from.

`liandan eval TUNED --against [BASE]` scores both checkpoints on the same tasks, prompt formats and items, and
both on the held-out windows of the **base** run's data sources (the pretraining documents training left out:
a chat fine-tune's own data says nothing of what it cost the base model), then compares them here:

- per task and metric, the mean over the formats before and after, the change, and the prompt-format spread
  (max - min over the formats) of each side. A change counts only beyond the larger of the two spreads (a
  difference that rewording the prompt produces is not a difference): a drop beyond it is a **tax**, a rise
  beyond it a **gain**, anything else is within the spread;
- per held-out source, bits per byte before and after on the same windows and bytes: any rise is a tax (the
  windows and their bytes are the same on both sides, so the difference is the models' alone), given with its
  relative size.

The comparison is the "eval_tax" event's fields: what `--record` appends to the tuned run and what `liandan
report` shows in its section "Before and after fine-tuning".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from liandan.config import ConfigError

TAX, GAIN, WITHIN = "tax", "gain", "within spread"


def baseline_checkpoint(given: str, tuned: Path, tuned_cfg: Any) -> Path:
    """The checkpoint to compare `tuned` with: `given` (a run, a checkpoints directory or a step directory), or,
    when empty, the `checkpoint.init_from` the tuned run started from. ConfigError in one line when there is
    none, it is not there, or it is not a liandan checkpoint."""
    from liandan.checkpoint.info import resolve_checkpoint
    from liandan.checkpoint.streaming import is_weight_source
    from liandan.checkpoint.verify import CheckpointError

    if given:
        path, said = Path(given), f"--against {given}"
    else:
        init_from = tuned_cfg.checkpoint.init_from if tuned_cfg is not None else ""
        if not init_from:
            raise ConfigError(f"liandan eval --against: {tuned} was not started from another model (its"
                              " checkpoint.init_from is empty): name the base model, --against=RUN|CKPT")  # fmt: skip
        path, said = Path(init_from), f"the base model (checkpoint.init_from = {init_from})"
    if not path.exists():
        raise ConfigError(f"liandan eval --against: {said} is not there (from {Path.cwd()}): name the base model,"
                          " --against=RUN|CKPT")  # fmt: skip
    if is_weight_source(path):
        raise ConfigError(f"liandan eval --against: {said} is Hugging Face weights, not a liandan checkpoint:"
                          " `liandan import` it and name the imported checkpoint with --against")  # fmt: skip
    try:
        return resolve_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"liandan eval --against: {said}: {err}") from None


def foreign_ids(base: Any, tuned: Any) -> str | None:
    """Why the tuned model cannot read the base run's held-out token ids as the base model does (None when it
    can): its tokenizer must be the base's, or the base's with tokens appended (ChatML's markers, say)."""
    if base.fingerprint() == tuned.fingerprint():
        return None
    vocab = getattr(base, "vocabulary", None)
    grown = getattr(tuned, "vocabulary", None)
    if vocab is None or grown is None:
        return "its tokenizer is not the base model's"
    theirs = grown()
    if any(theirs.get(token) != index for token, index in vocab().items()):
        return "its tokenizer is neither the base model's nor the base model's with tokens appended"
    return None


def compare(before: dict[str, Any], after: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The "eval_tax" fields from `liandan eval`'s results on the base checkpoint (`before`) and the tuned one
    (`after`, its held-out scored on the base run's windows): task rows, held-out rows and notes."""
    old = {(t["task"], m): (t, s) for t in before["tasks"] for m, s in t["summary"].items()}
    tasks = []
    for task in after["tasks"]:
        for metric, now in task["summary"].items():
            if (task["task"], metric) not in old:
                continue
            then_task, then = old[(task["task"], metric)]
            spread = max(then["spread"], now["spread"])
            change = now["mean"] - then["mean"]
            formats = {fmt: [then_task["scores"][fmt][metric], scores[metric]]
                       for fmt, scores in task["scores"].items() if fmt in then_task["scores"]}  # fmt: skip
            tasks.append({"task": task["task"], "metric": metric, "n": task["n"], "before": then["mean"],
                          "after": now["mean"], "change": change, "spread_before": then["spread"],
                          "spread_after": now["spread"], "spread": spread, "verdict": task_verdict(change, spread),
                          "formats": formats})  # fmt: skip
    then_sources = {h["source"]: h for h in before["heldout"]}
    heldout = []
    for now in after["heldout"]:
        then = then_sources.get(now["source"])
        if then is None:
            continue
        change = now["bits_per_byte"] - then["bits_per_byte"]
        heldout.append({"source": now["source"], "before": then["bits_per_byte"], "after": now["bits_per_byte"],
                        "change": change, "relative": change / then["bits_per_byte"] if then["bits_per_byte"] else 0.0,
                        "verdict": TAX if change > 0 else "", "loss_before": then["loss"], "loss_after": now["loss"],
                        "tokens": now["tokens"], "bytes": now["bytes"]})  # fmt: skip
    return {"step": after["step"], "checkpoint": after["checkpoint"], "baseline": before["checkpoint"],
            "baseline_step": before["step"], "tasks": tasks, "heldout": heldout, "notes": list(notes or [])}  # fmt: skip


def task_verdict(change: float, spread: float) -> str:
    """A drop beyond the prompt-format spread is a tax, a rise beyond it a gain; the rest is within it."""
    if change < -spread:
        return TAX
    if change > spread:
        return GAIN
    return WITHIN


def lines(comparison: dict[str, Any]) -> list[str]:
    """The comparison as the console shows it: one line per task and metric (its formats under it), one per
    held-out source, then the notes."""
    head = (f"before and after fine-tuning: {comparison['baseline']} (step {comparison['baseline_step']}) ->"
            f" {comparison['checkpoint']} (step {comparison['step']})")  # fmt: skip
    out = [head]
    for row in comparison["tasks"]:
        mark = {TAX: "  TAX: a drop beyond the prompt-format spread", GAIN: "  a gain beyond the spread"}.get(
            row["verdict"], "  within the spread")  # fmt: skip
        out.append(f"  {row['task']} {row['metric']}: mean {row['before']:.3f} -> {row['after']:.3f}, change"
                   f" {row['change']:+.3f}, spread {row['spread_before']:.3f} -> {row['spread_after']:.3f}{mark}")  # fmt: skip
        out.append("    " + ", ".join(f"{fmt} {a:.3f} -> {b:.3f}" for fmt, (a, b) in row["formats"].items()))
    for row in comparison["heldout"]:
        mark = "  TAX" if row["verdict"] == TAX else ""
        out.append(f"  held-out {row['source']}: {row['before']:.4f} -> {row['after']:.4f} bits/byte, change"
                   f" {row['change']:+.4f} ({row['relative']:+.1%}){mark}")  # fmt: skip
    out += [f"  note: {note}" for note in comparison["notes"]]
    return out
