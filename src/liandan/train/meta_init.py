"""Meta-device initialisation: the model is built on the meta device (shapes, no storage), parallelised and
sharded there, and only then does each rank allocate and fill its own shards.

The values are the ones the model gets when it is built whole in one process from the same seed, bit for
bit, whatever the layout. While the model is built on the meta device every in-place initialiser it runs
(`nn.init.normal_`, `kaiming_uniform_`, `ones_`, ...) is recorded with its arguments. After sharding, the
record is replayed in order on the CPU from the same seed, one whole parameter at a time: an initialiser
whose result a later one overwrites (`nn.Linear`'s own kaiming init before the family's `init_weights`) runs
on a scratch tensor, only to draw the same random numbers, and the last one of each parameter fills a whole
tensor from which the rank copies its shard (the slice DCP would load into it). A rank thus holds its shards
plus one whole parameter at a time, never the whole model.

A per-parameter seed would let each rank draw only its own shard, but it gives other numbers than a model
built whole, so a run could not be compared with (or continue) one started the other way; the CPU generator
has no skip-ahead, so keeping today's numbers means drawing every number on every rank. That costs the time
of today's init, not its memory.

Buffers are not initialisers' work (Llama's rotary table is computed in its constructor): the model's
`init_buffers()` computes them again on the rank's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from liandan.checkpoint.streaming import local_part, local_slice

# Initialisers that overwrite their whole tensor without reading it: what they leave depends only on the
# tensor's shape and the random numbers they draw, so each can be replayed on a fresh tensor of that shape.
DRAWING = {
    "normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "sparse_", "bernoulli_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_",
}  # fmt: skip
CONSTANT = {"fill_", "zero_", "ones_", "zeros_", "constant_", "eye_", "dirac_"}
RANDOM_FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "rand_like",
                    "randn_like", "randint_like"}  # fmt: skip
# In-place methods that change no values.
IGNORED = {"requires_grad_", "share_memory_"}
# Wrappers that parallelize() puts into parameter names (activation checkpointing, torch.compile).
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


IN_PLACE_OPERATORS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                      "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                      "__irshift__"}  # fmt: skip


def _in_place(name: str) -> bool:
    """Whether a tensor method of this name may change its tensor's values (`add_`, `+=`, `t[i] = v`)."""
    if name in IN_PLACE_OPERATORS:
        return True
    return name.endswith("_") and not name.startswith("__") and name not in IGNORED


@dataclass
class Write:
    """One initialiser call on a tensor during construction: `func(tensor, *args, **kwargs)`."""

    target: torch.Tensor  # the meta tensor written (kept alive so that its id stays unique)
    func: Callable
    args: tuple
    kwargs: dict
    draws: bool  # draws random numbers: replayed even where its result is dead


@dataclass
class InitRecord:
    """What building the model on the meta device wrote, in order, and what it did that cannot be replayed:
    (the tensor it wrote, or None where it drew random numbers outside an initialiser, and what it was)."""

    writes: list[Write] = field(default_factory=list)
    refusals: list[tuple[torch.Tensor | None, str]] = field(default_factory=list)


class _Recorder(TorchFunctionMode):
    def __init__(self, record: InitRecord):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in DRAWING or name in CONSTANT:
            rest = dict(kwargs)
            target = args[0] if args else rest.pop("tensor")
            extra = args[1:] if args else ()
            if any(isinstance(a, torch.Tensor) for a in (*extra, *rest.values())):
                self.record.refusals.append((None, f"{name} with tensor arguments"))
            elif target._base is not None:  # part of a tensor (an embedding's padding row, say)
                self.record.refusals.append((target._base, f"{name} on part of a parameter"))
            else:
                self.record.writes.append(Write(target, func, tuple(extra), rest, name in DRAWING))
        elif name in RANDOM_FACTORIES:
            self.record.refusals.append((None, f"torch.{name} in a constructor"))
        elif name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data":
            self.record.refusals.append((args[0], "an assignment to a parameter's .data"))
        elif _in_place(name) and args and isinstance(args[0], torch.Tensor):
            target = args[0] if args[0]._base is None else args[0]._base
            self.record.refusals.append((target, f"{name} on a parameter (it reads or copies values)"))
        return func(*args, **kwargs)


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """`build()` run on the meta device, with every initialiser it calls recorded."""
    record = InitRecord()
    with torch.device("meta"), _Recorder(record):
        model = build()
    return model, record


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model, without the wrappers parallelize() adds."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


@dataclass
class InitPlan:
    """The record, tied to the plain model's parameter names (taken before parallelize replaces the tensors)."""

    writes: list[Write]
    last_write: dict[int, int]  # id(meta tensor) -> index of the write that leaves its value
    names: dict[str, int]  # canonical parameter name -> id(meta tensor)


def plan_init(model: nn.Module, record: InitRecord) -> InitPlan:
    """Check that the record leaves every parameter a value it can reproduce; raises ValueError otherwise."""
    last: dict[int, int] = {}
    for i, write in enumerate(record.writes):
        last[id(write.target)] = i
    names = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    unset = sorted(name for name, key in names.items() if key not in last)
    if unset:
        raise ValueError(f"meta init: no initialiser sets {', '.join(unset[:4])}; set train.meta_init = false")
    params = set(names.values())
    for target, what in record.refusals:
        if target is None or id(target) in params:  # buffers are init_buffers()' work
            raise ValueError(f"meta init cannot replay {what}; set train.meta_init = false")
    return InitPlan(record.writes, last, names)


@torch.no_grad()
def materialize(model: nn.Module, plan: InitPlan, device: torch.device, seed: int) -> None:
    """Allocate this rank's shards on `device` and fill them as the model built whole from `seed` is filled."""
    model.to_empty(device=device)
    targets: dict[int, list[torch.Tensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = plan.names.get(canonical_name(name))
        if key is None:
            raise ValueError(f"meta init: parameter {name} is not in the model as built")
        if all(p is not param for p in targets.setdefault(key, [])):
            targets[key].append(param)
    torch.manual_seed(seed)
    for i, write in enumerate(plan.writes):
        key = id(write.target)
        final = plan.last_write[key] == i and key in targets
        if not (final or write.draws):
            continue
        whole = torch.empty(write.target.shape, dtype=write.target.dtype)
        write.func(whole, *write.args, **write.kwargs)
        if final:
            for param in targets[key]:
                index = local_slice(param)
                local_part(param).copy_(whole if index is None else whole[index])
        del whole  # one whole parameter at a time
    init_buffers = getattr(model, "init_buffers", None)
    if init_buffers is not None:
        init_buffers()
    elif any(True for _ in model.buffers()):
        raise ValueError(f"meta init: {type(model).__name__} has buffers but no init_buffers()")


def largest_param_elements(shapes: dict[str, tuple[int, ...]]) -> int:
    """Elements of the largest whole parameter: what a rank holds beside its shards while it initialises."""
    return max((math.prod(s) for s in shapes.values()), default=0)
