"""What the cleaning steps dropped, per source and per input file: a rule that drops a quarter of the
documents may drop nearly all of one source (verse under a short-line rule), which totals over every source
hide."""

from __future__ import annotations

from collections import Counter
from typing import Any


def drops_by(cleaned: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One row per task `key` ("source" or "path") from the clean stage's results: documents read, kept
    after the steps, and the drops by `step: reason`, most first."""
    rows: dict[str, dict[str, Any]] = {}
    for result in cleaned:
        name = str(result["task"][key])
        row = rows.setdefault(name, {key: name, "read": 0, "kept": 0, "dropped": Counter()})
        row["read"] += result["read"]["documents"]
        row["kept"] += result["documents"]
        for step in result["steps"]:
            row["dropped"].update({f"{step['name']}: {reason}": n for reason, n in step["dropped"].items()})
    return [{**row, "dropped": dict(row["dropped"].most_common())} for row in rows.values()]


def drop_reasons(cleaned: list[dict[str, Any]], dedup_stats: dict[str, Any], shown: int = 3) -> str:
    """The most common reasons records were skipped on reading or dropped by a step, over every task, and the
    duplicates dedup removed, with their counts: `dropped: 1 invalid UTF-8, 3 language:other`."""
    reasons: Counter = Counter()
    for result in cleaned:
        reasons.update(result["read"]["skipped"])
        for step in result["steps"]:
            reasons.update(step["dropped"])
    if dedup_stats.get("removed"):
        reasons["duplicate"] += dedup_stats["removed"]
    if not reasons:
        return "no document was read"
    top = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))
    text = ", ".join(f"{n:,} {why}" for why, n in top[:shown])
    if len(top) > shown:
        rest = sum(n for _, n in top[shown:])
        text += f" and {rest:,} more ({len(top) - shown} other reason{'s' * (len(top) - shown > 1)})"
    return f"dropped: {text}"
