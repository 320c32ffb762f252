"""Training: process groups, parallelism applied to a plain model, the train module, callbacks and the loop.

The names below are imported when first asked for (PEP 562): importing one module of the package, its FP8
counts for `liandan plan` say, does not import the trainer and, through it, torch.distributed.checkpoint."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from liandan.train.callbacks import Callback
    from liandan.train.trainer import Trainer, TrainResult

__all__ = ["Callback", "TrainResult", "Trainer"]
_MODULES = {
    "Callback": "liandan.train.callbacks",
    "TrainResult": "liandan.train.trainer",
    "Trainer": "liandan.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
