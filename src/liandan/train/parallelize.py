"""Parallelism, recomputation and compilation, applied to a plain model from outside, as its family's spec
(`liandan.model.spec`) describes: the tensor-parallel plan, the container of repeated blocks, what to compile.

One DeviceMesh with named dims ("pp", "dp_replicate", "dp_shard", "cp", "tp"), pipeline stages outermost (each
stage is parallelised here as a whole model would be); FSDP2 shards over "dp_shard" and "cp" flattened into
one dim ("dp_shard_cp") when context parallelism is on; under expert parallelism its dp_shard
dim is split into ("dp_shard_mod_ep", "ep") for the routed experts (`liandan.train.expert_parallel`). The order of application follows
torchtitan: fp8 linear layers first (they replace modules, which the rest then wraps), tensor parallel next (it rewrites the linear layers into DTensor shards), expert parallel (the experts'
weights into DTensor shards over `ep`), then activation
checkpointing and torch.compile per block, then data parallelism (FSDP2 `fully_shard`, HSDP on a 2-D
mesh, or DDP when only replication is asked for).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from liandan.common.layout import Layout, uses_fsdp
from liandan.model.spec import ModelSpec, spec_for
from liandan.train.expert_parallel import apply_ep, apply_expert_fsdp, ep_refusal, expert_mesh
from liandan.train.fp8 import Fp8, convert_to_fp8
from liandan.train.health.allreduce import AllReduceAudit, audited_allreduce

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    if layout.world_size == 1:
        return None
    sizes = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp)
    return init_device_mesh(device_type, sizes, mesh_dim_names=DIMS)


def dp_coordinates(mesh: DeviceMesh | None, layout: Layout) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks: the ones that see different data."""
    if mesh is None:
        return 0, 1
    return mesh.get_local_rank("dp_replicate") * layout.dp_shard + mesh.get_local_rank("dp_shard"), layout.dp_size


# ---------------------------------------------------------------------------------------------------------
# tensor parallel


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    spec: ModelSpec | None = None,
    *,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
) -> None:
    """The family's tensor-parallel plan: its top-level modules, then the per-block plan on every block (for
    Llama, Megatron-style: each rank holds n_heads / tp heads; a MoE block's feed-forward stays whole). `loss_parallel` keeps the logits split
    over the vocabulary; `sequence_parallel` splits the activations between the parallel regions over the
    sequence."""
    from torch.distributed.tensor.parallel import parallelize_module

    spec = spec or spec_for(model.args)
    refusal = spec.tp_refusal(model.args, tp_mesh.size())
    if refusal:
        raise ValueError(refusal)
    plan = spec.tp_plan(model.args, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    # A pipeline stage lacks the top-level modules of the other stages (the embedding, the head).
    top = {name: style for name, style in plan.top.items() if _submodule(model, name) is not None}
    if top:
        parallelize_module(model, tp_mesh, top)
    for name, block in _blocks(model, spec).named_children():
        parallelize_module(block, tp_mesh, plan.blocks.get(name, plan.block))
    _retie(model, spec)
    # Readers of the model that choose their own sequence lengths (evaluation) need to know: between the
    # blocks each rank then holds 1/tp of the positions, so lengths must divide by tp and a position's hidden
    # state is on one rank only.
    model.sequence_split = tp_mesh.size() if sequence_parallel else 1


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def sequence_split(model: nn.Module) -> int:
    """Over how many ranks sequence parallelism splits the model's positions (1 without it)."""
    return getattr(getattr(model, "module", model), "sequence_split", 1)


def _retie(model: nn.Module, spec: ModelSpec) -> None:
    """Sharding replaces each module's parameters by new DTensor ones, which undoes a tie; both sides of a
    tie are split alike (the embedding and the head by vocabulary rows), so the shared one serves both."""
    for key, source in spec.tied(model.args).items():
        owner, _, name = key.rpartition(".")
        source_owner, _, source_name = source.rpartition(".")
        setattr(model.get_submodule(owner), name, getattr(model.get_submodule(source_owner), source_name))


def _blocks(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """The container of the model's repeated blocks (a ModuleDict or ModuleList)."""
    return getattr(model, spec.blocks)


# ---------------------------------------------------------------------------------------------------------
# activation checkpointing and compile


def _selective_policy():
    """Keep the outputs of matmuls and attention (expensive to recompute), recompute the cheap pointwise ops
    and norms in between: most of the memory saving of full recomputation at a fraction of its cost."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: nn.Module, mode: str, spec: ModelSpec | None = None) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs: dict = {"preserve_rng_state": False}
    if mode == "selective":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _selective_policy())
    blocks = _blocks(model, spec or spec_for(model.args))
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, checkpoint_wrapper(block, **kwargs))


def apply_compile(model: nn.Module, spec: ModelSpec | None = None) -> None:
    """Compile each block separately (blocks are identical, so one compilation serves them all) and the
    methods the family names (Llama: the head with its loss). Without sharding the whole model is compiled
    instead, which fuses across blocks."""
    spec = spec or spec_for(model.args)
    blocks = _blocks(model, spec)
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, torch.compile(block, dynamic=False))
    for method in spec.compiled_methods:
        setattr(model, method, torch.compile(getattr(model, method), dynamic=False))


# ---------------------------------------------------------------------------------------------------------
# data parallel


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype | None,
    spec: ModelSpec | None = None,
    experts: tuple[DeviceMesh, Layout] | None = None,
    cpu_offload: bool = False,
) -> None:
    """One FSDP2 unit per block of the family's block container, and the root unit for the rest. With
    `experts` (the expert mesh and the layout, under expert parallelism), each block's routed experts get a
    unit of their own over the data-parallel ranks that hold the same experts. `cpu_offload` keeps every
    unit's parameter shards, gradients and so the optimizer's state in host memory (FSDP2's
    CPUOffloadPolicy): each unit's shards are copied to the device for its all-gather and its gradients back
    after the reduce-scatter."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    # Pinned host memory makes the copies asynchronous; pinning needs CUDA, which CPU-only builds lack.
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    blocks = list(_blocks(model, spec or spec_for(model.args)).children())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once for backward: keep them gathered.
        if experts is not None:
            apply_expert_fsdp(block, *experts, mp_policy=mp, reshard=i < len(blocks) - 1, offload_policy=offload)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1,
                    offload_policy=offload)  # fmt: skip
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload)


def fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard, flattened with cp under context parallelism (the cp ranks hold
    the same weights and average their gradients), with dp_replicate outside it for HSDP."""
    if layout.cp == 1:
        return mesh[("dp_replicate", "dp_shard")] if layout.dp_replicate > 1 else mesh["dp_shard"]
    flat = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    return mesh[("dp_replicate", "dp_shard_cp")] if layout.dp_replicate > 1 else flat


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, audit: AllReduceAudit | None = None) -> nn.Module:
    """DDP over the replicas; with `audit`, its gradient all-reduce goes through the audited hook (the
    silent-data-corruption check's records, and where a `corrupt@allreduce` fault strikes)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    # The model's buffers (rotary tables) are computed alike on every rank: broadcasting them before every
    # forward would only make each rank wait for the slowest one there.
    ddp = DistributedDataParallel(model, process_group=dp_mesh.get_group(), device_ids=device_ids,
                                  broadcast_buffers=False)  # fmt: skip
    if audit is not None:
        audit.group = dp_mesh.get_group()
        ddp.register_comm_hook(audit, audited_allreduce)
    return ddp


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    layout: Layout,
    *,
    activation_checkpoint: str = "none",
    compile: bool = False,
    fsdp_param_dtype: torch.dtype | None = None,
    spec: ModelSpec | None = None,
    allreduce_audit: AllReduceAudit | None = None,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
    materialize: Callable[[nn.Module], None] | None = None,
    fp8: Fp8 | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Apply TP, recomputation, compile and data parallelism; returns the module to call (DDP wraps).
    `spec` is the model's family (default: found from `model.args`); `allreduce_audit`, under DDP, the state
    of the audited gradient all-reduce; `loss_parallel` and `sequence_parallel` shape tensor parallelism;
    `materialize`, for a model built on the meta device, allocates and fills its shards once they are known
    (before DDP, which broadcasts the values it is given); `fp8`, the linears to run in fp8 and how. Under
    FSDP the weights are gathered in the compute dtype and cast to fp8 in each step (not gathered in fp8);
    `cpu_offload`, FSDP2's parameter, gradient and optimizer-state offload to host memory."""
    spec = spec or spec_for(model.args)
    if fp8 is not None:
        convert_to_fp8(model, fp8)
    if layout.tp > 1:
        apply_tp(model, mesh["tp"], spec, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    experts = None
    if layout.ep > 1:
        refusal = ep_refusal(model.args, layout.ep)
        if refusal:
            raise ValueError(refusal)
        experts = (expert_mesh(mesh, layout), layout)
        apply_ep(model, experts[0])
    apply_activation_checkpointing(model, activation_checkpoint, spec)
    if compile and (uses_fsdp(layout) or layout.tp > 1):
        apply_compile(model, spec)  # per block: FSDP2 and TP hooks sit between blocks
    elif compile:
        model.compile(dynamic=False)  # whole graph, in place (parameter names unchanged)
    if uses_fsdp(layout):
        apply_fsdp(model, fsdp_mesh(mesh, layout), fsdp_param_dtype, spec, experts, cpu_offload)
    if materialize is not None:
        materialize(model)
    if not uses_fsdp(layout) and layout.dp_replicate > 1:
        return apply_ddp(model, mesh["dp_replicate"], allreduce_audit)
    return model


def gradient_sync(model: nn.Module, sync: bool):
    """Skip the gradient reduction on all but the last micro-batch of an accumulation."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if not sync and hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 unit back into its sharded state, as between steps: a step left in its middle (the
    root unit stays unsharded from its forward to its backward) would otherwise show whole parameters."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 unit
            module.reshard()
