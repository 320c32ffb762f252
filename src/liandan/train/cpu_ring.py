"""PyTorch's ring attention over the CPU's SDPA kernel, so that context parallelism runs on the CPU too.

`torch.distributed.tensor.experimental.context_parallel` routes SDPA to its ring (`_templated_ring_attention`
and its backward: the keys and values passed round the cp ranks, the partial outputs merged by their
log-sum-exp, the causal load balance) through DTensor handlers for CUDA's flash, memory-efficient and cuDNN
kernels only. On the CPU, SDPA dispatches `_scaled_dot_product_flash_attention_for_cpu`, which returns the
same (output, log-sum-exp) pair and has a backward of the same shape, but for which PyTorch registers neither
a handler nor a sharding rule. `install` adds the two handlers to the ones `context_parallel` turns on: they
run PyTorch's own ring (not a copy of it) with the CPU kernel as its per-chunk op, and wrap the local results
as DTensors sharded on the sequence like the inputs.

These are private PyTorch names (torch 2.13); `missing` says in one line when a torch version lacks them,
and context parallelism on the CPU is then refused with that line.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

SEQ_DIM = 2  # (batch, heads, sequence, head_dim): the ring shards the sequence
_CP_ATTENTION = "torch.distributed.tensor.experimental._context_parallel._attention"
_NEEDED = ("custom_ops", "_templated_ring_attention", "_templated_ring_attention_backward")


def _ring_module() -> Any:
    return importlib.import_module(_CP_ATTENTION)


def missing() -> str | None:
    """Why PyTorch's ring cannot take the CPU kernel in this torch (one line), or None."""
    try:
        module = _ring_module()
    except ImportError as err:
        return f"{_CP_ATTENTION} does not import ({err})"
    absent = [name for name in _NEEDED if not hasattr(module, name)]
    if absent:
        return f"{_CP_ATTENTION} has no {', '.join(absent)}"
    aten = torch.ops.aten
    for op in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"):
        if not hasattr(aten, op):
            return f"torch.ops.aten has no {op}"
    return None


def install() -> None:
    """Register the CPU kernel's forward and backward handlers with context_parallel's (idempotent)."""
    aten = torch.ops.aten
    handlers = _ring_module().custom_ops
    handlers[aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_forward
    handlers[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_backward


def _sharded_like(local: torch.Tensor, like: Any) -> Any:
    """`local` as a DTensor with the placements of the DTensor `like` (its global shape from the local one)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    spec = like._spec
    shape, stride = compute_global_tensor_info(local, spec.mesh, spec.placements)
    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return DTensor(local, DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta), requires_grad=False)


def _local(t: Any) -> Any:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _ring_forward(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p=0.0, is_causal=False, *,
    attn_mask=None, scale=None) -> (output, logsumexp), on DTensors sharded on the sequence."""
    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("ring attention on the CPU takes no attention mask: causal only")
    out, lse = _ring_module()._templated_ring_attention(
        query.device_mesh.get_group(), SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        query=_local(query), key=_local(key), value=_local(value), is_causal=is_causal, dropout_p=dropout_p,
        scale=kwargs.get("scale"),
    )  # fmt: skip
    return _sharded_like(out, query), _sharded_like(lse, query)


_BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")


def _ring_backward(op_call: Any, args: tuple, kwargs: dict) -> tuple:
    """_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
    dropout_p, is_causal, *, attn_mask=None, scale=None) -> (grad_query, grad_key, grad_value)."""
    a = {**dict(zip(_BACKWARD_ARGS, args)), **kwargs}
    if a.get("attn_mask") is not None:
        raise NotImplementedError("ring attention on the CPU takes no attention mask: causal only")
    grads = _ring_module()._templated_ring_attention_backward(
        a["query"].device_mesh.get_group(), SEQ_DIM,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=_local(a["grad_out"]), grad_out_name="grad_out", query=_local(a["query"]), key=_local(a["key"]),
        value=_local(a["value"]), out=_local(a["out"]), logsumexp=_local(a["logsumexp"]), is_causal=a["is_causal"],
        dropout_p=a["dropout_p"], scale=a.get("scale"),
    )  # fmt: skip
    return tuple(_sharded_like(g, like) for g, like in zip(grads[:3], (a["query"], a["key"], a["value"]), strict=True))
