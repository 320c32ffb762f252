"""A second optimizer in one file, as a package outside liandan would ship it: its config keys
(`[optim.sgdm]`) and the plug-in. Registered by the tests that use it, the way an entry point would:

    plugins.register(Plugin("optimizer", "sgdm", "toy_optimizer:SGDM", options="toy_optimizer:SgdmOptions"))

SGD with momentum: matrices with weight decay, the rest without, one optimizer per model part."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liandan.config import option
from liandan.train.optimizers import OptimizerPlugin


@dataclass
class SgdmOptions:
    momentum: float = option(0.9, "momentum", min=0.0, max=1.0)
    weight_decay: float = option(0.0, "weight decay of the matrices", min=0.0)


def build(parts, section, device, mixed_tensor_kinds):
    out = []
    for part in parts:
        params = [p for p in part.parameters() if p.requires_grad]
        matrices = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": section.options.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]  # fmt: skip
        out.append([torch.optim.SGD([g for g in groups if g["params"]], lr=section.lr,
                                    momentum=section.options.momentum)])  # fmt: skip
    return out


SGDM = OptimizerPlugin("sgdm", build, state_bytes_per_param=4.0)  # one momentum buffer
