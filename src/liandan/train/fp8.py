"""FP8 training through torchao's float8 linear layers, applied to a plain model from outside.

Each chosen `nn.Linear` becomes a torchao `Float8Linear`: its three matmuls (the forward one and the two of
the backward pass) run in fp8 with dynamic scales, tensorwise (one scale per tensor) or rowwise (one per row,
more robust to outliers, somewhat slower). Master weights, optimizer state and everything outside those
matmuls keep the run's dtype. Which linears: every one whose qualified name matches no `train.fp8_skip`
pattern; the output head is skipped by default, since its logits feed the loss directly and it is the layer
most sensitive to quantisation. A linear that is chosen must have both dimensions divisible by 16 (what fp8
tensor-core matmuls require); rather than leaving such a layer out silently, the run is refused and the
message names the layer to add to `train.fp8_skip`.
"""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase

import torch
from torch import nn

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with fp8 tensor cores
ALIGNMENT = 16


@dataclasses.dataclass(frozen=True)
class Fp8:
    """What `train.fp8` asks for: the recipe, the linears left out, and whether to emulate."""

    recipe: str
    skip: list[str]
    emulate: bool = False


def skipped(name: str, skip: list[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in skip)


def fp8_linears(model: nn.Module, skip: list[str]) -> dict[str, nn.Linear]:
    """The linear layers that fp8 training converts, by qualified name (works on a meta-device model)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not skipped(name, skip)
    }


def fp8_param_count(model: nn.Module, skip: list[str]) -> int:
    """Weights of the converted linears: 6 FLOPs per weight per token run in fp8 (forward, both backward)."""
    return sum(module.weight.numel() for module in fp8_linears(model, skip).values())


def fp8_refusal(recipe: str, device: torch.device, *, emulate: bool = False) -> str | None:
    """Why fp8 training cannot run here, in one line; None where it can."""
    if recipe not in RECIPES:
        return f"train.fp8 = {recipe!r} is not a recipe; choose one of {', '.join(RECIPES)} (or none)"
    try:
        import_torchao_float8()
    except ImportError:
        return "train.fp8 needs torchao, which is not installed: pip install 'liandan[fp8]'"
    if emulate:
        return None
    if device.type != "cuda":
        return f"train.fp8 = {recipe!r} needs a CUDA GPU with fp8 tensor cores; this run is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"train.fp8 needs compute capability >= 8.9 (Ada, Hopper or newer); {name} has"
            f" {capability[0]}.{capability[1]}"
        )
    return None


def import_torchao_float8():
    """`torchao.float8`, imported without the warnings torchao and torch log on the way on a machine without
    its CUDA kernels ("Failed to load .../_C_mxfp8...so", a deprecated pytree registration): they concern
    kernels liandan does not use, and read as a failure."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8

        return torchao.float8
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


def dims_refusal(model: nn.Module, skip: list[str]) -> str | None:
    for name, module in fp8_linears(model, skip).items():
        if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
            return (
                f"train.fp8: linear {name!r} is {module.in_features} -> {module.out_features}; fp8 matmuls need"
                f" both dimensions divisible by {ALIGNMENT}: resize the model or add {name!r} to train.fp8_skip"
            )
    return None


def convert_to_fp8(model: nn.Module, fp8: Fp8) -> list[str]:
    """Swap the chosen linears of `model` for torchao's Float8Linear in place, before tensor parallel, FSDP
    and compile; returns the converted layers' names. Raises ValueError (one line) if the model cannot."""
    refusal = dims_refusal(model, fp8.skip)
    if refusal:
        raise ValueError(refusal)
    float8 = import_torchao_float8()
    Float8LinearConfig, convert_to_float8_training = float8.Float8LinearConfig, float8.convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(fp8.recipe), emulate=fp8.emulate)
    chosen = set(fp8_linears(model, fp8.skip))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return sorted(chosen)
