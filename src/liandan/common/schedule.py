"""The learning-rate schedule as a pure function of the step: the trainer's scheduler and the forecaster's
model of a run's learning rate read the same numbers."""

from __future__ import annotations

import math

from liandan.config import ScheduleSection


def lr_multiplier(step: int, total_steps: int, cfg: ScheduleSection) -> float:
    """Learning rate at `step` (0-based) as a fraction of the peak.

    Warmup rises linearly to 1 over warmup_steps (the first step trains at 1/warmup_steps, never at zero).
    Then: cosine or linear decay to min_lr_ratio at the last step; WSD holds 1 until the final
    decay_fraction of the steps and cools down as 1 - sqrt(progress) (Hägele et al. 2024); constant holds 1.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / max(1, total_steps - decay_start))
        return floor + (1.0 - floor) * (1.0 - math.sqrt(progress))
    span = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
