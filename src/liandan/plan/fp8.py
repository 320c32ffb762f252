"""What `train.fp8` converts, for the planner: the same linears the trainer converts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from liandan.config import Config, ConfigError
from liandan.model.spec import get as get_model_spec
from liandan.train.fp8 import dims_refusal, fp8_linears, fp8_param_count


@dataclass(frozen=True)
class Fp8Count:
    recipe: str  # "none" when fp8 is off
    params: int  # weights of the converted linears, whole model
    layers: int  # how many linears are converted


def plan_fp8(cfg: Config, args: Any) -> Fp8Count:
    """The linears `train.fp8` converts, found as the trainer finds them: on the family's model built on
    the meta device (no memory), filtered by `train.fp8_skip`."""
    t = cfg.train
    if t.fp8 == "none":
        return Fp8Count("none", 0, 0)
    with torch.device("meta"):
        model = get_model_spec(cfg.model.family).build(args)
    refusal = dims_refusal(model, t.fp8_skip)
    if refusal:
        raise ConfigError(refusal)
    return Fp8Count(t.fp8, fp8_param_count(model, t.fp8_skip), len(fp8_linears(model, t.fp8_skip)))
