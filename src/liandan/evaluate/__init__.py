"""Evaluation: scoring primitives on a liandan model (plain or sharded), tasks, held-out loss and the
lm-evaluation-harness bridge."""
