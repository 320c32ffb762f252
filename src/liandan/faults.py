"""Fault injection for tests of the recovery machinery: off unless $LIANDAN_FAULTS names faults.

Format: comma-separated `ACTION@POINT:STEP[:RANK]`, for example
    LIANDAN_FAULTS="kill@step:6"          SIGKILL every rank after optimizer step 6
    LIANDAN_FAULTS="kill@save:4:0"        SIGKILL rank 0 while finalising the checkpoint of step 4
    LIANDAN_FAULTS="hang@data:5:1"        rank 1 sleeps forever while loading the batch of step 5
    LIANDAN_FAULTS="corrupt@saved:8"      flip a byte in a shard of the checkpoint of step 8 once it is complete
    LIANDAN_FAULTS="enospc@save:4"        raise ENOSPC while writing the checkpoint of step 4
    LIANDAN_FAULTS="nan@grad:30:1"        rank 1's gradients of step 30 turn NaN after backward
    LIANDAN_FAULTS="spike@grad:30:1"      rank 1's gradients of step 30 are multiplied by 10^4
    LIANDAN_FAULTS="burst@update:30"      the update of step 30 is made at 100 times the learning rate
    LIANDAN_FAULTS="perturb@matmul:40:1"  rank 1's matrix products are wrong in rare elements from step 40 on
    LIANDAN_FAULTS="flip@param:40:2"      rank 2 flips one bit of one parameter after the update of step 40
    LIANDAN_FAULTS="slow@forward:40:1"    rank 1 sleeps SLOW_S in every forward pass from step 40 on
    LIANDAN_FAULTS="stall@forward:1"      every rank sleeps STALL_S in every forward pass from step 1 on
    LIANDAN_FAULTS="corrupt@allreduce:40:1"  rank 1's contribution to the gradient all-reduce of step 40 is wrong
    LIANDAN_FAULTS="hang@allreduce:40:1"  rank 1 never sends its contribution to that all-reduce (DDP)
    LIANDAN_FAULTS="forget@loader:0"      on every resume the loader ignores its saved position (a resume bug)
    LIANDAN_FAULTS="collapse@router:40:1" before step 40, MoE layer 1's router is pushed to send every token to
                                          expert 0 (its balancing bias raised by COLLAPSE_BIAS)

Points: `data` (loading the batch of step STEP), `step` (after optimizer step STEP), `save` (a checkpoint's
shards written, its manifest not yet), `saved` (a checkpoint complete; its path is passed along); in the data
pipeline, each stage's name (`clean`, `dedup`, `tokenizer`, `tokenize`, ...: task STEP's output written, its
done marker not yet; STEP 0 for a stage that runs once) and `clean-midway` (task STEP's files half written); in
object storage, `publish` (file STEP of a directory put, its marker not yet) and `fetch` (chunk STEP of a
download written to its partial file).
Actions: `kill` (SIGKILL), `exit` (exit code 1 at once), `raise` (RuntimeError), `hang` (sleep forever), `enospc`
(OSError ENOSPC), `corrupt` (flip one byte of a checkpoint shard; `saved` only).

Gradient and update faults fire once per process, the first time their step is trained: a run that rolls
back over that step does not meet them again, as with a real transient fault. So do `flip@param` and
`corrupt@allreduce`. Device faults are persistent, as a bad device is: `perturb@matmul` and `slow@forward` hold
on their rank from their step on, for the rest of the process (step 0: from before the first step, so the
preflight doctor meets them too); so does `stall@forward`, long steps for drills of a preemption's grace period.

`collapse@router:STEP[:LAYER]` is a drill of router collapse in a mixture of experts: before the forward of
step STEP, expert 0's balancing bias in the router of block LAYER (the first MoE block when absent) is raised
by COLLAPSE_BIAS, far above any router score, so that every token chooses expert 0 from that step on (the bias
update moves it back by the bias rate a step, which takes thousands of steps). The third field names a layer,
not a rank: the biases are replicated, so every rank plants the same (under pipeline parallelism every rank
holding that block: name the layer there). It fires once per process, like the gradient faults; a rollback
restores the bias with the rest of the state (it is a buffer).

`forget@loader` is a planted resume bug, for the resume oracle (`liandan doctor --resume`) to find: when the
data loader is handed a saved state (a resume, or a rollback of the loss-spike guard), it keeps its fresh
position instead, so the resumed run trains on the batches of the first steps again. STEP 0 forgets every
saved state; another STEP only the state saved at that step. It fires on every load, as a bug would.

Real faults are transient: the supervisor hands $LIANDAN_FAULTS to the first attempt of a supervised run only
(`liandan.run.worker_env`). Faults in $LIANDAN_FAULTS_ALWAYS fire in every attempt, the way a deterministic bug
would. This module sits below everything that can fail, so it reads its two variables itself; their names are
defined here, and the supervisor-worker contract in `liandan.run.worker_env` takes them from here.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENV, ENV_ALWAYS = "LIANDAN_FAULTS", "LIANDAN_FAULTS_ALWAYS"
BURST = 100.0  # the learning-rate factor of a `burst`
SPIKE = 1e4  # the gradient factor of a `spike`
SLOW_S = 0.05  # the sleep of a `slow` forward pass
STALL_S = 2.5  # the sleep of a `stall`ed forward pass
PERTURBATION = 0.5  # added to the rare elements a `perturb`ed matrix product gets wrong
PERTURB_EVERY = 997  # one output element in this many is wrong (and at least one per product)
COLLAPSE_BIAS = 10.0  # added to one expert's balancing bias by `collapse@router` (router scores are in [0, 1])
_fired: set[tuple] = set()  # (action, point, step[, layer]) of the faults that fired once


def _parse(spec: str) -> list[tuple[str, str, int, int | None]]:
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, where = item.split("@", 1)
        parts = where.split(":")
        rank = int(parts[2]) if len(parts) > 2 else None
        out.append((action, parts[0], int(parts[1]), rank))
    return out


def _active() -> list[tuple[str, str, int, int | None]]:
    return _parse(os.environ.get(ENV_ALWAYS, "")) + _parse(os.environ.get(ENV, ""))


def maybe_inject(point: str, step: int, path: Path | None = None) -> None:
    """Fire every configured fault that matches this point, step and rank."""
    if ENV not in os.environ and ENV_ALWAYS not in os.environ:
        return
    rank = int(os.environ.get("RANK", "0"))
    for action, where, at_step, at_rank in _active():
        if where != point or at_step != step or (at_rank is not None and at_rank != rank):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "exit":
            os._exit(1)
        elif action == "raise":
            raise RuntimeError(f"injected fault at {point} {step} on rank {rank}")
        elif action == "hang":
            threading.Event().wait()  # forever; only a signal ends this process now
        elif action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point} {step})")
        elif action == "corrupt" and path is not None:
            shard = min(Path(path).glob("*.distcp"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        else:
            raise ValueError(f"{ENV}: cannot do '{action}' at '{point}'")


def _once(point: str, step: int) -> list[str]:
    """The actions configured for this point, step and rank that have not fired in this process yet."""
    if ENV not in os.environ and ENV_ALWAYS not in os.environ:
        return []
    rank = int(os.environ.get("RANK", "0"))
    actions = []
    for action, where, at_step, at_rank in _active():
        mine = where == point and at_step == step and (at_rank is None or at_rank == rank)
        if mine and (action, point, step) not in _fired:
            _fired.add((action, point, step))
            actions.append(action)
    return actions


def forgets(what: str, saved_step: int) -> bool:
    """`forget@loader`: whether this rank should ignore the saved state of `what` (saved at `saved_step`)."""
    if ENV not in os.environ and ENV_ALWAYS not in os.environ:
        return False
    rank = _rank()
    return any(a == "forget" and w == what and s in (0, saved_step) and (r is None or r == rank)
               for a, w, s, r in _active())  # fmt: skip


def corrupt_gradients(step: int, parameters: Iterable[Any]) -> None:
    """`nan@grad` and `spike@grad`: this rank's gradients of `step`, after backward and before clipping."""
    for action in _once("grad", step):
        if action not in ("nan", "spike"):
            raise ValueError(f"{ENV}: cannot do '{action}' at 'grad'")
        for p in parameters:
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grad.fill_(float("nan")) if action == "nan" else grad.mul_(SPIKE)


def learning_rate_burst(step: int) -> float:
    """`burst@update`: the factor on the learning rate of the update of `step` (1 but for a burst)."""
    factor = 1.0
    for action in _once("update", step):
        if action != "burst":
            raise ValueError(f"{ENV}: cannot do '{action}' at 'update'")
        factor *= BURST
    return factor


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def planned_at(point: str) -> bool:
    """Whether any fault is configured at `point` (for this process's rank or every rank)."""
    if ENV not in os.environ and ENV_ALWAYS not in os.environ:
        return False
    rank = _rank()
    return any(w == point and (r is None or r == rank) for _, w, _, r in _active())


def _from_step(action: str, point: str, step: int) -> bool:
    """Whether a persistent device fault `action@point` holds on this rank at `step`."""
    if ENV not in os.environ and ENV_ALWAYS not in os.environ:
        return False
    rank = _rank()
    return any(a == action and w == point and step >= s and (r is None or r == rank) for a, w, s, r in _active())


def slow_forward(step: int) -> None:
    """`slow@forward`: a straggler: this rank sleeps SLOW_S in each forward pass from its step on."""
    if _from_step("slow", "forward", step):
        time.sleep(SLOW_S)
    if _from_step("stall", "forward", step):  # long steps, whose sleep a signal does not cut short
        time.sleep(STALL_S)


def perturb(output: Any) -> Any:
    """Make rare elements of a matrix product wrong, the way a faulty device does: every PERTURB_EVERY-th
    element (and the first) gets PERTURBATION added. Deterministic, so a recomputation on the same device
    is wrong in the same way and only another device or a float64 reference tells."""
    import torch

    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.numel() == 0:
        return output
    flat = output.reshape(-1)
    wrong = flat[::PERTURB_EVERY] + PERTURBATION
    flat = flat.clone()
    flat[::PERTURB_EVERY] = wrong
    return flat.view(output.shape)


def faulty_matmuls(step: int):
    """`perturb@matmul`: a context under which this rank's matrix products (`mm`, `matmul`, `bmm`, `addmm`,
    `linear`, `@`) are wrong in rare elements, when the fault holds at `step`; a null context otherwise."""
    import contextlib

    if not _from_step("perturb", "matmul", step):
        return contextlib.nullcontext()
    return _faulty_matmul_mode_type()()


def _faulty_matmul_mode_type():
    import torch
    from torch.overrides import TorchFunctionMode

    products = {torch.mm, torch.matmul, torch.bmm, torch.addmm, torch.nn.functional.linear,
                torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm}  # fmt: skip

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return perturb(out) if func in products else out

    return Mode


def flip_parameter_bit(step: int, parameters: Iterable[Any]) -> str | None:
    """`flip@param`: after the update of `step`, flip one exponent bit of one element of this rank's first
    parameter with elements, as a memory error would; returns what was flipped (or None)."""
    if "flip" not in _once("param", step):
        return None
    import torch

    for index, p in enumerate(parameters):
        local = p.data.to_local() if hasattr(p.data, "to_local") else p.data
        if local.numel() == 0:
            continue
        flat = local.view(-1)
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        element = flat.numel() // 2
        as_int = flat[element : element + 1].view(bits)
        as_int ^= 1 << (flat.element_size() * 8 - 3)  # the exponent's second-highest bit
        return f"parameter {index}, element {element}"
    return None


def collapse_router(step: int, modules: Iterable[Any], stages: bool = False) -> str | None:
    """`collapse@router`: before the forward of `step`, raise expert 0's balancing bias in one MoE layer's
    router (the buffers named `...router.expert_bias` of `modules`); returns the buffer's name (or None).
    `stages`: `modules` are a rank's pipeline stages, and a layer they lack is another rank's to plant."""
    if ENV not in os.environ and ENV_ALWAYS not in os.environ:
        return None
    planted = None
    for action, where, at_step, layer in _active():
        if where != "router" or at_step != step or (action, where, step, layer) in _fired:
            continue
        _fired.add((action, where, step, layer))
        if action != "collapse":
            raise ValueError(f"{ENV}: cannot do '{action}' at 'router'")
        biases = [(name, b) for module in modules for name, b in module.named_buffers()
                  if name.endswith("router.expert_bias")]  # fmt: skip
        chosen = [(name, b) for name, b in biases if layer is None or f".{layer}." in f".{name}"]
        if not chosen and stages and layer is not None:
            continue
        if not chosen:
            raise ValueError(f"{ENV}: collapse@router:{step}:{layer}: no MoE router there")
        name, bias = chosen[0]
        local = bias.to_local() if hasattr(bias, "to_local") else bias
        local.data[0] += COLLAPSE_BIAS
        planted = name
    return planted


def corrupt_contribution(step: int, tensor: Any) -> bool:
    """`corrupt@allreduce`: this rank's contribution to the gradient all-reduce of `step` goes out wrong
    (rare elements perturbed in place, before it is sent); True when it did. `hang@allreduce`: this rank never
    sends it (it blocks forever where it would, its peers in the all-reduce): a hang in a collective."""
    actions = _once("allreduce", step)
    if "hang" in actions:
        threading.Event().wait()  # forever; only a signal ends this process now
    if "corrupt" not in actions:
        return False
    flat = tensor.view(-1)
    flat[::PERTURB_EVERY] += PERTURBATION * 100
    return True
