"""Muon's keys of the run config, `[optim.muon]`: its own, and AdamW's (inherited) for the parameters Muon
leaves to AdamW (embeddings, the output head, norm weights, biases). `weight_decay` serves both."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from liandan.config import ConfigError, option
from liandan.train.optimizers.adamw_options import AdamWOptions

# Keller Jordan's quintic Newton-Schulz coefficients, torch.optim.Muon's default.
NS_COEFFICIENTS = [3.4445, -4.7750, 2.0315]


@dataclass
class MuonOptions(AdamWOptions):
    momentum: float = option(0.95, "Muon momentum", min=0.0, max=1.0)
    nesterov: bool = option(True, "Muon: Nesterov momentum")
    ns_steps: int = option(5, "Muon: Newton-Schulz iterations per step", min=1, max=99)
    ns_coefficients: list[float] = option(NS_COEFFICIENTS, "Muon: the quintic's (a, b, c)")
    adjust_lr: Literal["match_rms_adamw", "spectral", "none"] = option(
        "match_rms_adamw",
        "Muon's learning rate per matrix (A x B): match_rms_adamw x0.2*sqrt(max(A,B)), AdamW's lr and weight decay"
        " carry over; spectral x sqrt(max(1,A/B)), width-invariant (muP); none x1",
    )

    def __post_init__(self) -> None:
        if len(self.ns_coefficients) != 3:
            raise ConfigError(
                f"optim.muon.ns_coefficients must be three numbers (a, b, c), not {len(self.ns_coefficients)}"
            )
