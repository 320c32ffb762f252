"""Training: process groups, parallelism applied to a plain model, the train module, callbacks and the loop."""

from liandan.train.callbacks import Callback
from liandan.train.trainer import Trainer, TrainResult

__all__ = ["Callback", "TrainResult", "Trainer"]
