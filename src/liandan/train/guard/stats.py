"""What the guard measures in the model: the output logits of every step (their largest magnitude and the
mean squared log-normaliser, the quantity z-loss keeps small), and per-layer statistics at an interval and
around incidents: weight, gradient and update norms, activation RMS and the largest attention logit.

Everything is measured beside the real computation (forward hooks on the head and on each block, reading
their inputs and outputs) on a small sample of positions, so the model's code stays as it is and the cost
stays below a percent of a step. Layers are named by their parameters' prefixes: `layers.3`, `output`,
`tok_embeddings`."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from liandan.model.spec import ModelSpec

SAMPLED_ROWS = 128  # positions of a micro-batch whose logits are measured
WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: `layers.3` for `layers.3.attention.wq.weight`."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def norms_by_layer(named: Iterable[tuple[str, torch.Tensor | None]]) -> dict[str, float]:
    """The L2 norm of each layer's tensors (None entries skipped). Distributed tensors are reduced over their
    mesh: every rank must call this with the same tensors, in the same order."""
    squares: dict[str, float] = {}
    for name, t in named:
        if t is None:
            continue
        norm = torch.linalg.vector_norm(t.detach().float())
        squares[layer_of(name)] = squares.get(layer_of(name), 0.0) + float(_local(norm)) ** 2
    return {layer: math.sqrt(s) for layer, s in squares.items()}


def submodule(model: nn.Module, name: str) -> nn.Module:
    """`model.get_submodule(name)` through a DistributedDataParallel wrapper."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model.get_submodule(name)


def parameters_now(model: nn.Module) -> list[torch.Tensor]:
    """A copy of every parameter, to measure an update against (`update_norms`)."""
    return [p.detach().clone() for p in model.parameters()]


def update_norms(model: nn.Module, before: list[torch.Tensor]) -> dict[str, float]:
    """Each layer's norm of what changed since `before` (from `parameters_now`)."""
    pairs = zip(model.named_parameters(), before, strict=True)
    return norms_by_layer((name, p.detach() - old) for (name, p), old in pairs)


def _unwrap(module: nn.Module) -> nn.Module:
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if inner is None:
            return module
        module = inner


def _sample_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every stride-th row of `t` flattened to (rows, last dimension), and the stride."""
    rows = t.reshape(-1, t.shape[-1])
    stride = max(1, rows.shape[0] // SAMPLED_ROWS)
    return _local(rows[::stride]).float(), stride


class HeadProbe:
    """The largest |logit| and the mean squared log-normaliser of every forward's head output, sampled; with
    `per_sequence`, also each sequence's loss on the sampled positions (the log-normaliser is computed for z
    anyway, so a loss costs one gather). The targets are read off the model's own call by a pre-hook."""

    def __init__(self, model: nn.Module, spec: ModelSpec, per_sequence: bool = False):
        self.largest: list[torch.Tensor] = []
        self.z: list[torch.Tensor] = []
        self.loss_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sequences: tuple[torch.Tensor, torch.Tensor] | None = None  # of the last `take`: (loss sums, counts)
        self.targets: torch.Tensor | None = None
        head = submodule(model, spec.head)
        self.handles = [head.register_forward_hook(self._hook)]
        if per_sequence:
            self.handles.append(model.register_forward_pre_hook(self._remember_targets, with_kwargs=True))
        self.enabled = True

    def _remember_targets(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        targets = args[1] if len(args) > 1 else kwargs.get("targets")
        self.targets = targets if isinstance(targets, torch.Tensor) and module.training else None

    @torch.no_grad()
    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        targets, self.targets = self.targets, None
        if not self.enabled or not module.training:
            return
        rows, stride = _sample_rows(output.detach())
        self.largest.append(rows.abs().amax())
        normaliser = torch.logsumexp(rows, dim=-1)
        self.z.append(normaliser.pow(2).mean())
        if targets is not None and targets.shape == output.shape[:-1]:
            self.loss_parts.append(_sequence_losses(rows, normaliser, stride, targets))

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(largest |logit|, mean z) since the last call, as tensors (no device sync); the sampled losses of the
        sequences seen since then, in order, go to `sequences`."""
        parts, self.loss_parts = self.loss_parts, []
        self.sequences = (torch.cat([s for s, _ in parts]), torch.cat([c for _, c in parts])) if parts else None
        if not self.largest:
            zero = torch.zeros((), device=device)
            return zero, zero
        largest, z = torch.stack(self.largest).amax(), torch.stack(self.z).mean()
        self.largest, self.z = [], []
        return largest, z

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _sequence_losses(rows: torch.Tensor, normaliser: torch.Tensor, stride: int,
                     targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(sum of the sampled positions' losses, their count) for each sequence of `targets` (b, T); targets below
    zero are ignored, as in the model's loss."""
    sequences, length = targets.shape
    picked = targets.reshape(-1)[::stride][: rows.shape[0]].to(rows.device)
    valid = picked >= 0
    losses = (normaliser - rows.gather(1, picked.clamp(min=0)[:, None]).squeeze(1)) * valid
    owner = torch.arange(0, sequences * length, stride, device=rows.device)[: rows.shape[0]] // length
    sums = torch.zeros(sequences, device=rows.device).index_add_(0, owner, losses)
    counts = torch.zeros(sequences, device=rows.device).index_add_(0, owner, valid.float())
    return sums, counts


class BlockProbe:
    """Per block, for one step: the RMS of its output and its largest attention logit (if the family says how
    to compute it), the largest over the step's micro-batches."""

    def __init__(self, model: nn.Module, spec: ModelSpec):
        self.rms: dict[str, torch.Tensor] = {}
        self.attention: dict[str, torch.Tensor] = {}
        self.handles = []
        self.failed = ""
        blocks = submodule(model, spec.blocks)
        for index, block in blocks.named_children():
            name = f"{spec.blocks}.{index}"
            self.handles.append(block.register_forward_hook(self._output_hook(name)))
            if spec.attention_logit is not None:
                # A pre-hook registered after FSDP's runs once the block's parameters are gathered.
                self.handles.append(block.register_forward_pre_hook(self._input_hook(name, _unwrap(block), spec)))

    def _output_hook(self, name: str):
        @torch.no_grad()
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            rms = _sample_rows(out.detach())[0].pow(2).mean().sqrt()
            self.rms[name] = torch.maximum(self.rms[name], rms) if name in self.rms else rms

        return hook

    def _input_hook(self, name: str, block: nn.Module, spec: ModelSpec):
        @torch.no_grad()
        def hook(module: nn.Module, args: tuple) -> None:
            if self.failed:
                return
            try:
                largest = _local(spec.attention_logit(block, args[0].detach(), args[1:]))
            except Exception as err:  # noqa: BLE001 - a layout the family's function does not handle: measure the rest
                self.failed = f"{type(err).__name__}: {err}"
                return
            self.attention[name] = torch.maximum(self.attention[name], largest) if name in self.attention else largest

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
