"""What a checkpoint, a memory snapshot and the rollback ring hold of a train module: its model parts and the
optimizers of each part, as one state.

A train module has one model part or several (the stages of a pipeline, a policy beside a frozen reference)
and one optimizer per part or several (Muon on the hidden matrices and AdamW on the rest). Callers hand over
`(model, optimizer)` in any of these shapes: a module or a list of them; None, an optimizer, a list of
optimizers, a list of lists (one list per part) or a container with `per_part`. `TrainState.of` makes one
shape of them all.

Names are chosen so that one part with one optimizer is saved exactly as before there were several: the
layout-independent names of `get_state_dict` for checkpoints, `param.<name>` and `optim.<group>.<index>.<key>`
for snapshots. Several parts are saved under flattened optimizer names (`state.<fqn>.<key>`), which merge
across parts without clashing; each part's fully qualified names are its own. So are the stages of a pipeline
(parts marked `pipeline_stage`) even one to a rank, since each rank's optimizer groups then hold other
parameters; a checkpoint is loaded in the form it was saved in (`flat_optimizer`), so one saved by a
pipeline resumes whole and the other way round.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

# Optimizer settings that choose how the update is computed, not what it is: each layout keeps its own.
KERNEL_CHOICES = ("foreach", "fused")


@dataclass
class TrainState:
    parts: list[torch.nn.Module]
    optimizers: list[list[torch.optim.Optimizer]]  # per part; empty lists for weights only
    flat: bool | None = None  # the optimizers' state under flattened names; None: as the parts ask
    # The optimizers' parameter groups (their hyperparameters) are kept as they are, not loaded: a whole
    # model's checkpoint numbers its groups, which name no parameter a pipeline stage could match them by.
    own_groups: bool = False

    @property
    def flattened(self) -> bool:
        if self.flat is not None:
            return self.flat
        return len(self.parts) > 1 or any(getattr(p, "pipeline_stage", None) is not None for p in self.parts)

    @classmethod
    def of(cls, model: Any, optimizer: Any = None) -> TrainState:
        if isinstance(model, TrainState):
            return model
        parts = list(model) if isinstance(model, (list, tuple)) else [model]
        if optimizer is None:
            per_part: list[list[torch.optim.Optimizer]] = [[] for _ in parts]
        elif hasattr(optimizer, "per_part"):
            per_part = [list(opts) for opts in optimizer.per_part]
        elif isinstance(optimizer, torch.optim.Optimizer):
            per_part = [[optimizer]] + [[] for _ in parts[1:]]
        elif all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
            per_part = [list(optimizer)] + [[] for _ in parts[1:]]
        else:
            per_part = [list(opts) for opts in optimizer]
        if len(per_part) != len(parts):
            raise ValueError(f"{len(per_part)} lists of optimizers for {len(parts)} model parts")
        return cls(parts, per_part)

    @property
    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for opts in self.optimizers for o in opts]

    @property
    def has_optimizers(self) -> bool:
        return bool(self.all_optimizers)

    # -- checkpoints (DCP) ----------------------------------------------------------------------------------
    def state_dict(self, with_optimizers: bool = True) -> dict[str, Any]:
        """{"model": ..., "optim": ...} under layout-independent names, for `torch.distributed.checkpoint`."""
        if not with_optimizers or not self.has_optimizers:
            return {"model": self._merged(get_model_state_dict(p) for p in self.parts)}
        if not self.flattened:
            model_sd, optim_sd = get_state_dict(self.parts[0], self._one_or_list(self.optimizers[0]))
            return {"model": model_sd, "optim": optim_sd}
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model_sd, optim_sd = {}, {}
        for part, opts in zip(self.parts, self.optimizers, strict=True):
            if not opts:
                model_sd.update(get_model_state_dict(part))
                continue
            m, o = get_state_dict(part, opts, options=flat)
            model_sd.update(m)
            optim_sd.update(o)
        if self.own_groups:
            self._groups = {k: optim_sd.pop(k) for k in [k for k in optim_sd if k.startswith("param_groups.")]}
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a state read into `state_dict()`'s structure back into the parts and optimizers. Each optimizer
        keeps its own kernel choice: the saved groups carry the saving layout's, which this layout's mix of
        DTensors and plain tensors may not take (tensor parallelism)."""
        if "optim" not in state or not self.has_optimizers:
            for part in self.parts:
                set_model_state_dict(part, state["model"], options=StateDictOptions(strict=len(self.parts) == 1))
            return
        kernels = [[{k: g[k] for k in KERNEL_CHOICES if k in g} for g in o.param_groups] for o in self.all_optimizers]
        if not self.flattened:
            opts = self._one_or_list(self.optimizers[0])
            set_state_dict(self.parts[0], opts, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            if self.own_groups:
                state["optim"].update(self._groups)
            flat = StateDictOptions(flatten_optimizer_state_dict=True, strict=len(self.parts) == 1)
            for part, opts in zip(self.parts, self.optimizers, strict=True):
                if opts:
                    set_state_dict(part, opts, model_state_dict=state["model"], optim_state_dict=state["optim"],
                                   options=flat)  # fmt: skip
                else:
                    set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
        for optimizer, groups in zip(self.all_optimizers, kernels, strict=True):
            for group, kernel in zip(optimizer.param_groups, groups, strict=True):
                group.update(kernel)

    @staticmethod
    def _one_or_list(opts: list[torch.optim.Optimizer]) -> Any:
        return opts[0] if len(opts) == 1 else opts

    @staticmethod
    def _merged(dicts: Iterator[dict[str, Any]]) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for d in dicts:
            merged.update(d)
        return merged

    # -- snapshots and the ring (this rank's own tensors, in place) -------------------------------------------
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor a rank must get back to continue bit for bit, by a name stable across restarts."""
        out: list[tuple[str, torch.Tensor]] = []
        for i, part in enumerate(self.parts):
            prefix = "" if i == 0 else f"part{i}."
            out += [(f"param.{prefix}{n}", _local(p.detach())) for n, p in part.named_parameters()]
            out += [(f"buffer.{prefix}{n}", _local(b)) for n, b in part.named_buffers()]
        for k, optimizer in enumerate(self.all_optimizers):
            name = "optim" if k == 0 else f"optim{k}"
            for gi, group in enumerate(optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    for key, value in sorted(optimizer.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            out.append((f"{name}.{gi}.{pi}.{key}", _local(value)))
        out.append(("rng.torch", torch.get_rng_state()))
        if torch.cuda.is_available():
            out.append(("rng.cuda", torch.cuda.get_rng_state()))
        return out

    def hyperparameters(self) -> list[dict[str, Any]]:
        """Every optimizer's groups without their parameters, in order (one optimizer: its groups)."""
        return [group for optimizer in self.all_optimizers for group in _hyperparameters(optimizer)]

    def set_hyperparameters(self, groups: list[dict[str, Any]]) -> None:
        it = iter(groups)
        for optimizer in self.all_optimizers:
            for group in optimizer.param_groups:
                saved = next(it)
                for key, value in saved.items():
                    current = group.get(key)
                    if isinstance(current, torch.Tensor):
                        current.fill_(value)
                    else:
                        group[key] = tuple(value) if isinstance(current, tuple) else value

    def ensure_optimizer_state(self) -> None:
        for optimizer in self.all_optimizers:
            ensure_optimizer_state(optimizer)

    def clear_optimizer_state(self) -> None:
        for optimizer in self.all_optimizers:
            optimizer.state.clear()

    def optimizer_state_empty(self) -> bool:
        return not any(o.state for o in self.all_optimizers)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a (possibly distributed) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for group in optimizer.param_groups:
        entry = {}
        for key, value in group.items():
            if key == "params":
                continue
            entry[key] = float(value) if isinstance(value, torch.Tensor) else value
        groups.append(entry)
    return groups


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (AdamW makes it lazily, on the first step) without changing any weight:
    one step with zero gradients at a learning rate of zero. The state is overwritten right after."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    saved = [(g, g["lr"]) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in saved:
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def parts_parameters(parts: Sequence[torch.nn.Module]) -> Iterator[torch.nn.Parameter]:
    """Every parameter of every part, each once."""
    seen: set[int] = set()
    for part in parts:
        for p in part.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def flat_optimizer(metadata: Any) -> bool | None:
    """Whether a checkpoint's DCP metadata holds its optimizer state under flattened names (its parameter
    groups by parameter name, `optim.param_groups.<fqn>.<key>`, not by index); None without optimizer state."""
    groups = [k for k in metadata.state_dict_metadata if k.startswith("optim.param_groups.")]
    if not groups:
        return None
    return not any(k.split(".")[2].isdigit() for k in groups)
