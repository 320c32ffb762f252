"""Step directories (`step-00000120`): one name for checkpoints, snapshots and anything else kept per step."""

from __future__ import annotations

import re

STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    """The directory name of `step`; zero-padded so that names sort as steps do."""
    if step < 0:
        raise ValueError(f"step {step} is negative")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name stands for, or None for any other name (`step-00000120.tmp` included)."""
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None
