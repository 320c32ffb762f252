"""Foresight: FLOP and memory planning, scaling-law fits, compute-optimal plans, loss forecasts, sweeps."""
