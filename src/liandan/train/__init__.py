"""Training: process groups, parallelism applied to a plain model, the train module, callbacks and the loop.
Names are imported on first use, so that an optimizer's config keys can be read without torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Callback": "liandan.train.callbacks",
    "Trainer": "liandan.train.trainer",
    "TrainResult": "liandan.train.trainer",
}

__all__ = ["Callback", "TrainResult", "Trainer"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'liandan.train' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
