"""Attention masks and kernels.

A batch's mask is described once by `MaskSpec` (causal, plus optional document ids for packed sequences and
an optional prefix region that attends bidirectionally) and turned into what each kernel wants: a
FlexAttention `BlockMask`, a dense boolean mask for SDPA, or the same dense mask for the eager path. The
model builds it once per forward pass and every layer shares it.

The rule, for query position q and key position k of one sequence:

    allowed(q, k) = same_document(q, k) and (k <= q or (in_prefix(q) and in_prefix(k)))
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    HAS_FLEX = True
except ImportError:  # pragma: no cover - torch without FlexAttention
    HAS_FLEX = False
    BlockMask = Any  # type: ignore[misc,assignment]


@dataclass
class MaskSpec:
    """What may attend to what in one batch. Tensors are (batch, seq)."""

    doc_ids: torch.Tensor | None = None
    prefix: torch.Tensor | None = None

    @property
    def is_causal_only(self) -> bool:
        return self.doc_ids is None and self.prefix is None

    def dense(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Boolean (batch or 1, 1, seq, seq) mask; True where attention is allowed."""
        idx = torch.arange(seq_len, device=device)
        allowed = (idx[None, :] <= idx[:, None])[None]
        if self.prefix is not None:
            p = self.prefix
            allowed = allowed | (p[:, :, None] & p[:, None, :])
        if self.doc_ids is not None:
            d = self.doc_ids
            allowed = allowed & (d[:, :, None] == d[:, None, :])
        return allowed[:, None]

    def block_mask(self, seq_len: int, device: torch.device) -> BlockMask:
        doc_ids, prefix = self.doc_ids, self.prefix

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = kv_idx <= q_idx
            if prefix is not None:
                allowed = allowed | (prefix[b, q_idx] & prefix[b, kv_idx])
            if doc_ids is not None:
                allowed = allowed & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
            return allowed

        batch = None if self.is_causal_only else (doc_ids if doc_ids is not None else prefix).shape[0]
        return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=str(device))


class PreparedMask:
    """A `MaskSpec` materialised for one kernel and one sequence length, shared by all layers."""

    def __init__(self, spec: MaskSpec, backend: str, seq_len: int, device: torch.device):
        self.backend = backend
        self.is_causal = spec.is_causal_only
        self.dense: torch.Tensor | None = None
        self.block: BlockMask | None = None
        if backend == "flex":
            self.block = spec.block_mask(seq_len, device)
        elif backend == "eager" or not self.is_causal:
            self.dense = spec.dense(seq_len, device)

    @classmethod
    def explicit(cls, allowed: torch.Tensor, backend: str) -> PreparedMask:
        """A dense mask given whole, (batch, 1, queries, keys), for queries that are not the keys' positions
        (decoding against cached keys). FlexAttention would compile a kernel per cache length: SDPA serves."""
        mask = cls.__new__(cls)
        mask.backend = "eager" if backend == "eager" else "sdpa"
        mask.is_causal = False
        mask.dense = allowed
        mask.block = None
        return mask


@functools.cache
def _compiled_flex():
    # FlexAttention is only fast when compiled; torch.compile caches the kernel per shape and mask signature.
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: PreparedMask) -> torch.Tensor:
    """q: (B, Hq, T, D); k, v: (B, Hkv, T, D) with Hq a multiple of Hkv (grouped-query attention)."""
    if mask.backend == "flex":
        flex = _compiled_flex() if q.is_cuda else flex_attention
        return flex(q, k, v, block_mask=mask.block, enable_gqa=k.shape[1] != q.shape[1])
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    if mask.backend == "sdpa":
        if mask.is_causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
    return eager_attention(q, k, v, mask.dense)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Attention as plain matmuls. The 1/sqrt(d) scale is split as d^-1/4 on q and on k before the product,
    so that q·k stays inside the range of fp16/bf16 (the overflow fix adopted for OPT-175B); the softmax
    itself runs in fp32."""
    root_scale = q.shape[-1] ** -0.25
    scores = (q * root_scale) @ (k * root_scale).transpose(-2, -1)
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1).to(v.dtype)) @ v


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The textbook formula in float64, for tests: softmax(q k^T / sqrt(d) + mask) v."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v


def choose_backend(requested: str, device: torch.device, training: bool = True) -> str:
    """`auto`: FlexAttention on CUDA, SDPA elsewhere. FlexAttention has no backward pass on the CPU (torch
    2.13), so it is refused there for training and used on the CPU for inference only."""
    flex_ok = HAS_FLEX and (device.type == "cuda" or not training)
    if requested == "auto":
        return "flex" if flex_ok else "sdpa"
    if requested == "flex" and not flex_ok:
        why = "this torch has no FlexAttention" if not HAS_FLEX else "FlexAttention cannot train on the CPU"
        raise ValueError(f"model.attention = 'flex' is not available here: {why}; use 'sdpa' or 'auto'")
    return requested
