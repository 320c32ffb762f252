"""Training: process groups, parallelism applied to a plain model, the optimizer and the loop."""

from liandan.train.trainer import Callback, Trainer, TrainResult

__all__ = ["Callback", "TrainResult", "Trainer"]
