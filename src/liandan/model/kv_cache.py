"""Keys and values kept between forward passes, for decoding one token at a time without recomputing the
prompt.

A cache holds a batch of sequences laid out in slots 0..capacity-1. Prompts of different lengths are padded
on the left, so that every sequence's next token goes into the same slot; `left_pad[b]` slots at the start of
row b are padding, never attended to, and a row's rotary positions count from its first real token (slot
`left_pad[b]` is position 0), exactly as if the row had been run alone without padding.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, capacity: int, left_pad: torch.Tensor | None = None):
        """`capacity`: slots per row (prompt + generated tokens); `left_pad` (batch,): padding slots per row."""
        self.capacity = capacity
        self.left_pad = left_pad
        self.length = 0  # slots filled, the same for every row
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def positions(self, batch: int, new: int, device: torch.device) -> torch.Tensor:
        """(batch, new) rotary positions of the next `new` slots."""
        if self.length + new > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {new} slots > capacity {self.capacity}")
        slots = torch.arange(self.length, self.length + new, device=device)[None].expand(batch, new)
        if self.left_pad is None:
            return slots
        return (slots - self.left_pad.to(device)[:, None]).clamp(min=0)

    def allowed(self, batch: int, new: int, device: torch.device) -> torch.Tensor:
        """(batch, 1, new, length + new) boolean: the next `new` slots attend to the slots before them and to
        themselves, never to padding. A padding slot attends to itself alone, which keeps its (unused) output
        finite: a row of the softmax with nothing allowed would be NaN, and NaN times a zero weight stays NaN."""
        total = self.length + new
        query = torch.arange(self.length, total, device=device)[:, None]
        key = torch.arange(total, device=device)[None, :]
        causal = (key <= query)[None]
        if self.left_pad is None:
            return causal[:, None].expand(batch, 1, new, total)
        real_key = key[None] >= self.left_pad.to(device)[:, None, None]
        return ((causal & real_key) | (key == query)[None])[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's keys and values of the new slots, (batch, new, heads, head_dim), and return that
        layer's keys and values of every filled slot. Storage is allocated on first use, so it takes the
        shape each rank actually computes (its own heads under tensor parallelism)."""
        if layer not in self._keys:
            shape = (k.shape[0], self.capacity, *k.shape[2:])
            self._keys[layer] = k.new_empty(shape)
            self._values[layer] = v.new_empty(shape)
        end = self.length + k.shape[1]
        self._keys[layer][:, self.length : end] = k
        self._values[layer][:, self.length : end] = v
        return self._keys[layer][:, :end], self._values[layer][:, :end]

    def advance(self, new: int) -> None:
        """Mark the `new` slots of the forward pass that just ran as filled."""
        self.length += new

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (sequences that finished are dropped)."""
        for store in (self._keys, self._values):
            for layer, tensor in store.items():
                store[layer] = tensor[rows]
        if self.left_pad is not None:
            self.left_pad = self.left_pad[rows.to(self.left_pad.device)]
