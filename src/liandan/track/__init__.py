"""Tracking: where metrics and events go (files, console, the project's run store) and how runs are seen."""

from liandan.track.logger import ConsoleLogger, FanOut, JsonlLogger, MetricsLogger, NullLogger, read_metrics
from liandan.track.plot import plot_run

__all__ = ["ConsoleLogger", "FanOut", "JsonlLogger", "MetricsLogger", "NullLogger", "plot_run", "read_metrics"]
