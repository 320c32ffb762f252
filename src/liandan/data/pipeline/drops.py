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
