"""Muon over parameters that may be sharded (DTensors of FSDP2, tensor parallelism or both), with the update of
one process; liandan's Muon for plain tensors too.

Plain matrices are orthogonalised together: those of one shape (taken on their wide side, as Newton-Schulz
works on it) are stacked and iterated as one batched product, where `torch.optim.Muon` runs the iteration one
matrix at a time. A model's hidden matrices come in a few shapes only, so each iteration is a few large
products instead of dozens of small ones (`benchmarks/muon_overhead.py` prints the time of both). The
arithmetic per matrix is the same (bf16, the same operations in the same order), but a batched matmul kernel
may sum in another order than a single one, so now and then an element rounds to the neighbouring bf16 value
(measured: the 28 matrices of a 4-layer model of width 128 bit for bit those of `torch.optim.Muon`; 3 of 720
random small matrices off by up to 0.8%, tests/test_muon.py's tolerance 2%). Runs stay deterministic: the
same matrices are stacked the same way every step.

Momentum stays sharded like its parameter and is updated shard by shard (element-wise, so exactly as on the
whole matrix). The Newton-Schulz orthogonalisation needs the whole matrix: each matrix's update is gathered,
orthogonalised on one owner rank of its mesh (round-robin over the mesh's ranks, so the work is spread), and
the bf16 result is broadcast from the owner; every rank keeps its own shard of it. Same arithmetic, same
order, same dtype as `torch.optim.Muon` on the whole matrix: given the same gradients the parameters come out
bit for bit the same (measured: max abs difference 0 on 2 and 4 CPU processes; the stated tolerance,
what tests/test_muon.py asserts, is a max abs difference of 1e-6 relative to the parameter's largest value).
Under training the gradients themselves differ between layouts in the last fp32 bits (sharded reductions), and
Newton-Schulz in bf16 turns a few of those into a bf16 rounding step of an update's element: losses of a run
on 2 processes agree with one process's to a relative 1e-4 (seen: 1.1e-5 after 6 steps; AdamW's, 1e-7).

State and group keys are `torch.optim.Muon`'s (`momentum_buffer`; `lr`, `weight_decay`, `momentum`,
`nesterov`, `ns_coefficients`, `eps`, `ns_steps`, `adjust_lr_fn`), so checkpoints move between the two.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

EPS = 1e-7
# `adjust_lr_fn` values as torch.optim.Muon names them, and "none" (no scale), which it does not take.
ADJUST_LR_FNS = ("original", "match_rms_adamw", "none")


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float = EPS) -> torch.Tensor:  # fmt: skip
    """The quintic Newton-Schulz iteration towards the nearest semi-orthogonal matrix, in bf16, as
    `torch.optim.Muon` computes it (same operations in the same order)."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def newton_schulz_stacked(updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int,
                          eps: float = EPS) -> list[torch.Tensor]:  # fmt: skip
    """`newton_schulz` of each of `updates`, matrices of one shape, in one batched iteration (tall ones
    transposed before and after, as `newton_schulz` does): each matrix's own norm, then `baddbmm` where
    `newton_schulz` calls `addmm`."""
    a, b, c = coefficients
    tall = updates[0].size(0) > updates[0].size(1)
    x = torch.stack([u.T if tall else u for u in updates]).bfloat16()
    x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return [m.T if tall else m for m in x.unbind()]


def newton_schulz_by_shape(updates: list[torch.Tensor], coefficients: tuple[float, float, float], steps: int,
                           eps: float = EPS) -> list[torch.Tensor]:  # fmt: skip
    """`newton_schulz` of each of `updates` (plain matrices), in their order. Matrices of one shape on the wide
    side (an A x B matrix and a B x A one share one) go through one `newton_schulz_stacked`; a shape held by
    one matrix alone goes by `newton_schulz`."""
    tall = [u.size(0) > u.size(1) for u in updates]
    wide = [u.T if t else u for u, t in zip(updates, tall, strict=True)]
    by_shape: dict[tuple, list[int]] = {}
    for i, w in enumerate(wide):
        by_shape.setdefault((*w.shape, w.dtype, w.device), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(updates)
    for indices in by_shape.values():
        if len(indices) == 1:
            out[indices[0]] = newton_schulz(updates[indices[0]], coefficients, steps, eps)
            continue
        for i, result in zip(indices, newton_schulz_stacked([wide[i] for i in indices], coefficients, steps, eps),
                             strict=True):  # fmt: skip
            out[i] = result.T if tall[i] else result
    return out  # type: ignore[return-value]


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate of an A x B matrix: "original" x sqrt(max(1, A/B)) (Keller Jordan's), "match_rms_adamw"
    x 0.2 sqrt(max(A, B)) (Moonlight's: the update's RMS that of AdamW's), "none" x 1."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `newton_schulz` on a rows x cols matrix (m = the smaller side, n = the larger): per iteration
    X X^T (2 m^2 n), c A A + b A (2 m^3) and a X + B X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


class ShardedMuon(torch.optim.Optimizer):
    """Muon for 2-D parameters, sharded (DTensor) or not; see the module's docstring. liandan's own rather
    than `torch.optim.Muon` because that one orthogonalises one matrix at a time, and whole matrices only."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
                 eps: float = EPS, ns_steps: int = 5, adjust_lr_fn: str | None = None) -> None:  # fmt: skip
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn = {adjust_lr_fn!r} is not one of {', '.join(ADJUST_LR_FNS)}")
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov,
                    "ns_coefficients": tuple(ns_coefficients), "eps": eps, "ns_steps": ns_steps,
                    "adjust_lr_fn": adjust_lr_fn}  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, not one of shape {tuple(p.shape)}")
        self._groups_by_mesh: dict[Any, tuple[Any, int, int]] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, updates = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if isinstance(grad, DTensor) and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf, g = _local(state["momentum_buffer"]), _local(grad)
                buf.lerp_(g, 1 - group["momentum"])
                params.append(p)
                updates.append(g.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            coefficients, steps, eps = tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"]
            lr = float(group["lr"])
            for p, update in zip(params, self._orthogonalised(params, updates, coefficients, steps, eps), strict=True):
                local = _local(p)
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss

    def _orthogonalised(self, params: list, updates: list[torch.Tensor], coefficients: tuple[float, float, float],
                        steps: int, eps: float) -> list[torch.Tensor]:  # fmt: skip
        """Each parameter's orthogonalised update, this rank's shard of it. Sharded matrices go round by round,
        one matrix per rank of their mesh a round: all are gathered, each rank orthogonalises the one it owns,
        and the owners broadcast theirs."""
        out: list[torch.Tensor | None] = [None] * len(params)
        by_mesh: dict[Any, list[int]] = {}
        plain: list[int] = []
        for i, p in enumerate(params):
            if isinstance(p, DTensor):
                by_mesh.setdefault(p.device_mesh, []).append(i)
            else:
                plain.append(i)
        if plain:
            orthogonalised = newton_schulz_by_shape([updates[i] for i in plain], coefficients, steps, eps)
            for i, result in zip(plain, orthogonalised, strict=True):
                out[i] = result
        for mesh, indices in by_mesh.items():
            group, size, me = self._mesh_group(mesh)
            for start in range(0, len(indices), size):
                round_ = indices[start : start + size]
                owners = range(len(round_))  # the k-th matrix of a round is orthogonalised by rank k
                wholes = [_whole(updates[i], params[i]) for i in round_]
                results = []
                for i, whole, owner in zip(round_, wholes, owners, strict=True):
                    if owner == me:
                        results.append(newton_schulz(whole, coefficients, steps, eps).contiguous())
                    else:
                        results.append(torch.empty(whole.shape, dtype=torch.bfloat16, device=whole.device))
                for result, owner in zip(results, owners, strict=True):
                    dist.broadcast(result, group=group, group_src=owner)
                for i, result in zip(round_, results, strict=True):
                    p = params[i]
                    out[i] = DTensor.from_local(result, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                                run_check=False).redistribute(p.device_mesh, p.placements).to_local()  # fmt: skip
        return out  # type: ignore[return-value]

    def _mesh_group(self, mesh: Any) -> tuple[Any, int, int]:
        """(process group over every rank of `mesh`, its size, this rank's place in it)."""
        if mesh not in self._groups_by_mesh:
            if mesh.ndim == 1:
                group = mesh.get_group()
            elif mesh.size() == dist.get_world_size():
                group = dist.group.WORLD
            else:
                group = mesh._flatten().get_group()
            self._groups_by_mesh[mesh] = (group, dist.get_world_size(group), dist.get_rank(group))
        return self._groups_by_mesh[mesh]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _whole(local_update: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The whole matrix of which `local_update` is this rank's shard, laid out as the parameter `like`."""
    sharded = DTensor.from_local(local_update, like.device_mesh, like.placements, run_check=False,
                                 shape=like.shape, stride=like.stride())  # fmt: skip
    return sharded.full_tensor()
