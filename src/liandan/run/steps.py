"""Step directories (`step-00000120`): one name for checkpoints, snapshots and anything else kept per step.
A save in progress writes `step-00000120.tmp` and renames it into place once complete; the files of a step
directory that say what it holds (`meta.json`) and that it is complete (`manifest.json`, written last) are
named here too."""

from __future__ import annotations

import re
from pathlib import Path

from liandan.run.remote import locate

STEP_DIR = re.compile(r"^step-(\d{8})$")
PARTIAL_STEP_DIR = re.compile(r"^step-(\d{8})\.tmp$")
MANIFEST = "manifest.json"  # written last: a step directory without it is incomplete
META = "meta.json"  # step, tokens, layout, model and loader state of a checkpoint


def step_dir_name(step: int) -> str:
    """The directory name of `step`; zero-padded so that names sort as steps do."""
    if step < 0:
        raise ValueError(f"step {step} is negative")
    return f"step-{step:08d}"


def partial_step_dir_name(step: int) -> str:
    """The name a step directory is written under until it is complete (`step-00000120.tmp`)."""
    return step_dir_name(step) + ".tmp"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None for any other name (`step-00000120.tmp` included)."""
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def parse_partial_step_dir(name: str) -> int | None:
    """The step of a step directory still being written (`step-00000120.tmp`), or None for any other name."""
    match = PARTIAL_STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def partial_of(step_dir: Path) -> Path:
    """Where the step directory `step_dir` is written until it is complete."""
    step = parse_step_dir(Path(step_dir).name)
    if step is None:
        raise ValueError(f"{step_dir} is not a step directory")
    return locate(step_dir).with_name(partial_step_dir_name(step))


def _listed(root: Path, parse) -> list[Path]:
    root = locate(root)  # a local directory, or a prefix in a store (`s3://bucket/prefix`)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if parse(p.name) is not None and p.is_dir()), key=lambda p: p.name)


def step_dirs(root: Path) -> list[Path]:
    """Every step directory under `root`, complete or not, oldest first."""
    return _listed(root, parse_step_dir)


def complete_step_dirs(root: Path) -> list[Path]:
    """The step directories under `root` that have their manifest, oldest first (not yet verified)."""
    return [p for p in step_dirs(root) if (p / MANIFEST).is_file()]


def partial_step_dirs(root: Path) -> list[Path]:
    """The step directories under `root` still being written, or left half-written by a process that died,
    oldest first."""
    return _listed(root, parse_partial_step_dir)
