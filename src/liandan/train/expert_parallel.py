"""Expert parallelism, applied to a plain MoE model from outside (torchtitan's dp2ep).

The `ep` ranks of an expert-parallel group (neighbouring ranks of the FSDP shard group, see
`liandan.common.layout`) divide each MoE layer's routed experts among them: each expert's weights live on one
of them, as DTensors sharded on the experts' dimension over the `ep` mesh dimension. The router, the shared
experts and everything else stay replicated (FSDP2 shards them as any dense weight), so each rank routes its
own tokens as it would without expert parallelism. Between the router and the experts, the `ExpertParallel`
style's input hook sends each (token, expert) row to the rank holding its expert (one all-to-all of the
per-expert row counts, then one of the rows), orders the rows it received by local expert and hands them to
the experts' own forward with the local counts; its output hook puts the results back in the order they came
in and returns them to their ranks with the reverse all-to-all. Both all-to-alls are differentiable, so the
backward pass sends the gradients of the rows back the same way.

Gradients: a rank's expert weights see the rows of every rank of its group, so where the dense weights'
gradients are averaged over the data-parallel ranks by FSDP2's reduction, the experts' are averaged over
the data-parallel ranks that hold the same experts (`dp_shard / ep`, times `dp_replicate`) but divided by
the whole data-parallel size (`apply_expert_fsdp`): both are then the gradient of the global mean loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from liandan.common.layout import Layout
from liandan.model.moe import GroupedExperts, moe_layers

# The names of the expert mesh's dimensions: the root mesh's dp_shard, split in two.
EXPERT_DIMS = ("dp_shard_mod_ep", "ep")


def ep_refusal(args, ep: int) -> str | None:
    """Why the model cannot be split over `ep` expert-parallel ranks (one line), or None."""
    if ep == 1:
        return None
    experts = getattr(args, "moe_experts", 0)
    if not experts:
        return f"parallel.ep = {ep} needs a mixture-of-experts model (model.moe_experts > 0); this one is dense"
    if experts % ep:
        return f"model.moe_experts = {experts} must divide evenly over parallel.ep = {ep} ranks"
    return None


def expert_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The root mesh with its `dp_shard` dimension split into (`dp_shard_mod_ep`, `ep`), the ep ranks of a
    group neighbours (one root: FSDP2 combines the experts' two shardings into one DTensor)."""
    return mesh._unflatten("dp_shard", (layout.expert_shard, layout.ep), EXPERT_DIMS)


class ExpertParallel(ParallelStyle):
    """Shards a `GroupedExperts`' stacked weights on the experts' dimension over a 1-D `ep` mesh and moves its
    input rows to the experts' ranks and the results back (see the module's docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, GroupedExperts):
            raise TypeError(f"ExpertParallel applies to GroupedExperts, not {type(module).__name__}")
        return distribute_module(module, device_mesh, _shard_experts, input_fn=_dispatch, output_fn=_combine)


def _shard_experts(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad)
        module.register_parameter(key, sharded)


class _Routes:
    """Where the rows of one forward came from, for the output hook to send the results back."""

    def __init__(self, sent: list[int], received: list[int], order: torch.Tensor, rows: torch.Tensor):
        self.sent, self.received, self.order, self.rows = sent, received, order, rows


def _dispatch(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    """(rows sorted by expert, rows per expert) -> (the rows of this rank's experts from every rank of the
    group, sorted by local expert, rows per local expert)."""
    rows, counts = inputs
    group, ranks = mesh.get_group(), mesh.size()
    local = counts.numel() // ranks
    counts = counts.to(torch.int64)
    # received[src, j]: how many rows rank src sends to this rank's expert j
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ranks, local)
    sent_splits = counts.view(ranks, local).sum(1).tolist()
    received_splits = received.sum(1).tolist()
    arrived = all_to_all_single_autograd(rows, received_splits, sent_splits, group)
    # The rows arrive grouped by source rank, then by expert: regroup them by expert, then by source rank.
    segment = torch.repeat_interleave(
        torch.arange(ranks * local, device=rows.device), received.flatten().to(rows.device)
    )
    by_expert = (segment % local) * ranks + segment // local
    order = torch.argsort(by_expert, stable=True)
    rows = arrived[order]
    module._ep_routes = _Routes(sent_splits, received_splits, order, rows)
    return rows, received.sum(0)


def _combine(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The experts' results back to the ranks and the order their rows came from."""
    routes: _Routes = module._ep_routes
    del module._ep_routes
    unsorted = torch.empty_like(routes.order)
    unsorted[routes.order] = torch.arange(routes.order.numel(), device=routes.order.device)
    if not unsorted.numel():
        # No rows came to this rank's experts, and the experts' empty output depends on nothing. Tie it to
        # the rows that came (none) and to the weights: the backward pass must still take this rank through
        # the dispatch's all-to-all, which the others wait in, and give the weights a (zero) gradient, so
        # that every rank of their FSDP2 group reduces the same tensors.
        weights = sum(w.to_local().sum() for w in module.parameters())
        output = output + (routes.rows.sum() + weights) * 0.0
    return all_to_all_single_autograd(output[unsorted], routes.sent, routes.received, mesh.get_group())


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Expert parallelism on every MoE layer of `model` over the expert mesh's `ep` dimension."""
    from torch.distributed.tensor.parallel import parallelize_module

    for moe in moe_layers(model).values():
        parallelize_module(moe.experts, mesh["ep"], ExpertParallel())


def apply_expert_fsdp(model: nn.Module, mesh: DeviceMesh, layout: Layout, mp_policy, reshard: bool,
                      offload_policy=None) -> None:  # fmt: skip
    """FSDP2 units of the routed experts alone, over the data-parallel ranks that hold the same experts,
    before the blocks' units take the rest; their gradients are divided by the whole data-parallel size."""
    from torch.distributed.fsdp import fully_shard

    dims = ("dp_replicate", EXPERT_DIMS[0]) if layout.dp_replicate > 1 else (EXPERT_DIMS[0],)
    for moe in moe_layers(model).values():
        kwargs = {} if offload_policy is None else {"offload_policy": offload_policy}
        fully_shard(moe.experts, mesh=mesh[dims], mp_policy=mp_policy, reshard_after_forward=reshard, **kwargs)
        moe.experts.set_gradient_divide_factor(float(layout.dp_size))
        if mesh.device_type == "cpu" and layout.expert_shard > 1:
            # A divide factor other than the group's size is NCCL's pre-multiplied sum, which gloo lacks: sum,
            # then divide. Not over a single rank: FSDP2 then divides while copying the gradient and would
            # divide again after.
            moe.experts.set_force_sum_reduction_for_comms(True)
