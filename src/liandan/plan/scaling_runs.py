"""The runs a scaling law is fitted to: N parameters, D tokens, loss and training compute C of each, read
from CSV files and from liandan run directories."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from liandan.config import ConfigError
from liandan.run import RunDir


@dataclass
class Observations:
    """One row per run: N parameters, D tokens, loss, and training compute C in FLOPs."""

    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    compute: np.ndarray
    names: list[str] = field(default_factory=list)
    source: str = ""  # what N, D, loss and C are, in words

    def __post_init__(self) -> None:
        self.n, self.d, self.loss, self.compute = (
            np.asarray(x, dtype=float) for x in (self.n, self.d, self.loss, self.compute)
        )
        if not self.names:
            self.names = [f"run {i + 1}" for i in range(len(self.n))]

    def __len__(self) -> int:
        return len(self.n)

    def take(self, index: np.ndarray) -> Observations:
        return Observations(
            self.n[index],
            self.d[index],
            self.loss[index],
            self.compute[index],
            [self.names[i] for i in index],
            self.source,
        )


_COLUMNS = {
    "n": ("n", "params", "parameters", "non_embedding_parameters"),
    "d": ("d", "tokens"),
    "c": ("c", "flops", "compute"),
    "loss": ("loss", "l"),
}


def read_csv(path: Path) -> Observations:
    """Runs from a CSV with a header: N (or params), D (or tokens) and/or C (or flops), and loss.

    With D and no C, C = 6·N·D; with C and no D, D = C/(6·N). Lines starting with # are comments."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            lines = [line for line in handle if line.strip() and not line.lstrip().startswith("#")]
        rows = list(csv.reader(lines))
    except (UnicodeDecodeError, csv.Error) as err:
        reason = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else str(err)
        raise ConfigError(f"{path}: not a CSV of runs ({reason})") from None
    if not rows:
        raise ConfigError(f"{path}: empty; expected a header with columns N, D (or C) and loss")
    header = [h.strip().lower() for h in rows[0]]
    where: dict[str, int] = {}
    for key, names in _COLUMNS.items():
        found = [i for i, h in enumerate(header) if h in names]
        if len(found) > 1:
            raise ConfigError(f"{path}: more than one column for {key!r}: {[rows[0][i] for i in found]}")
        if found:
            where[key] = found[0]
    missing = [k for k in ("n", "loss") if k not in where]
    if missing or ("d" not in where and "c" not in where):
        raise ConfigError(
            f"{path}: header {','.join(h.strip() for h in rows[0])!r} needs columns N, loss and D or C "
            "(also accepted: params, tokens, flops)"
        )
    values: dict[str, list[float]] = {k: [] for k in where}
    for lineno, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ConfigError(f"{path}: row {lineno} has {len(row)} fields, the header {len(header)}")
        for key, i in where.items():
            text = row[i].strip()
            try:
                value = float(text)
            except ValueError:
                raise ConfigError(
                    f"{path}: row {lineno}, column {rows[0][i].strip()}: {text!r} is not a number"
                ) from None
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{path}: row {lineno}, column {rows[0][i].strip()}: {text} must be positive")
            values[key].append(value)
    n = np.array(values["n"])
    d = np.array(values["d"]) if "d" in values else np.array(values["c"]) / (6 * n)
    c = np.array(values["c"]) if "c" in values else 6 * n * d
    names = [f"{path.name}:{i}" for i in range(2, len(n) + 2)]
    return Observations(n, d, np.array(values["loss"]), c, names, source=f"from {path.name}")


LOSS_KEYS = {"smoothed": "final_loss_smoothed", "final": "final_loss", "val": "val_loss"}


def find_runs(path: Path) -> list[Path]:
    """A run directory (it has summary.json), or the run directories directly under a directory."""
    path = Path(path)
    if RunDir(path).summary.is_file():
        return [path]
    if path.is_dir():
        runs = sorted(p for p in path.iterdir() if RunDir(p).summary.is_file())
        if runs:
            return runs
        raise ConfigError(f"{path}: no summary.json in it or in the directories under it")
    raise ConfigError(f"no such file or directory: {path}")


# The N a run's summary.json gives, by name: of a mixture of experts, the parameters a token goes through
# (active) or all of them; a dense model's active counts are its totals.
PARAM_COUNTS = {
    "non_embedding": "non_embedding_parameters",
    "total": "parameters",
    "active": "active non-embedding parameters",
    "active_total": "active_parameters",
}


def parameter_count(summary: dict, params: str) -> float | None:
    """A run's N as `params` names it, from its summary.json; None where the summary lacks what it needs.
    Summaries written before active counts existed are of dense models, whose active counts are the totals."""
    total, non_embedding = summary.get("parameters"), summary.get("non_embedding_parameters")
    active = summary.get("active_parameters", total)
    if params == "non_embedding":
        return non_embedding
    if params == "total":
        return total
    if params == "active_total":
        return active
    if not all(isinstance(v, (int, float)) for v in (total, non_embedding, active)):
        return None
    return active - (total - non_embedding)


def read_runs(run_dirs: Sequence[Path], *, params: str = "non_embedding", loss: str = "auto") -> Observations:
    """Runs from liandan run directories' summary.json.

    params: the parameter count taken as N, one of PARAM_COUNTS (non_embedding, total, active, active_total). loss: "smoothed" (final_loss_smoothed, the mean
    of the last tenth of the training losses), "final", "val" (val_loss), or "auto" (val_loss when every run
    has one, else smoothed). C is flops_per_token × tokens (PaLM's accounting, attention included)."""
    summaries = []
    for run in run_dirs:
        file = RunDir(Path(run)).summary
        try:
            summaries.append(RunDir(Path(run)).load_summary())
        except FileNotFoundError:
            raise ConfigError(f"{run}: no summary.json (an unfinished run?)") from None
        except ValueError as err:
            raise ConfigError(f"{file}: {err}") from None
    if loss == "auto":
        loss = "val" if summaries and all(s.get("val_loss") is not None for s in summaries) else "smoothed"
    if loss not in LOSS_KEYS:
        raise ConfigError(f"loss = {loss!r}; allowed: auto, {', '.join(LOSS_KEYS)}")
    if params not in PARAM_COUNTS:
        raise ConfigError(f"params = {params!r}; allowed: {', '.join(PARAM_COUNTS)}")
    rows = []
    for run, s in zip(run_dirs, summaries):
        row = []
        for key in ("parameters", "tokens", LOSS_KEYS[loss]):
            value = parameter_count(s, params) if key == "parameters" else s.get(key)
            key = PARAM_COUNTS[params] if key == "parameters" else key
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                hint = " (try --loss smoothed)" if key == "val_loss" else ""
                raise ConfigError(f"{run}: summary.json has no positive {key} (got {value!r}){hint}")
            row.append(float(value))
        fpt = s.get("flops_per_token")
        row.append(float(fpt) * row[1] if isinstance(fpt, (int, float)) and fpt > 0 else 6 * row[0] * row[1])
        rows.append(row)
    n, d, l_, c = (np.array(col) for col in zip(*rows)) if rows else ([], [], [], [])
    names = [Path(r).name for r in run_dirs]
    return Observations(
        n, d, l_, c, names, source=f"N = {params.replace('_', '-')} parameters, D = tokens, loss = {LOSS_KEYS[loss]}"
    )


def _beside_the_runs(path: Path) -> bool:
    """An SQLite database or one of its journal files, as a project directory holds beside its runs."""
    if path.name.endswith(("-wal", "-shm", "-journal")):
        return True
    with path.open("rb") as handle:
        return handle.read(16) == b"SQLite format 3\x00"


def load_observations(
    paths: Iterable[Path | str], *, params: str = "non_embedding", loss: str = "auto"
) -> Observations:
    """Runs from CSV files and run directories (or directories of run directories), together."""
    csvs: list[Observations] = []
    runs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path == RunDir(path.parent).summary and path.is_file():
            runs.append(path.parent)
        elif path.is_file() and _beside_the_runs(path):
            continue  # `liandan fit runs/*` also names the project's databases (the run store, MLflow's)
        elif path.is_file():
            csvs.append(read_csv(path))
        else:
            runs.extend(find_runs(path))
    parts = csvs + ([read_runs(runs, params=params, loss=loss)] if runs else [])
    if not parts:
        raise ConfigError("no runs given")
    if len(parts) == 1:
        return parts[0]
    return Observations(
        np.concatenate([p.n for p in parts]),
        np.concatenate([p.d for p in parts]),
        np.concatenate([p.loss for p in parts]),
        np.concatenate([p.compute for p in parts]),
        [name for p in parts for name in p.names],
        source="; ".join(p.source for p in parts),
    )
