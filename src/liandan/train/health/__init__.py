"""Health of the devices a run trains on: golden tests that tell a faulty device from a good one."""

from liandan.train.health.golden import GoldenResult, golden_matmul, odd_ones_out

__all__ = ["GoldenResult", "golden_matmul", "odd_ones_out"]
