"""Decoding state that the attention core reads and writes: each layer's projected keys and values.

Incremental decoding keeps each layer's projected keys and values (B, H, L, d) between steps, in a `KVCache`
(growing by each step; or, ``static``, filled once from the memory for cross-attention and then only read), or
in a `StaticKVCache` (buffers of a fixed length written in place: static shapes, for CUDA graphs).
`models.core.attention.MultiHeadAttention` fills them when its ``cache=`` is given; with grouped-query attention
they hold the key/value heads. Beam search reorders them with ``reorder(index, static_index)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """One attention layer's projected keys and values, (B, H, L, d) each, kept between decoding steps.

    Self-attention appends each step's keys and values. A ``static`` cache (cross-attention) is filled
    once from the memory, then only read; it may hold one row per sentence for all of its beams.
    """

    k: Tensor | None = None
    v: Tensor | None = None
    static: bool = False

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys and values (B, H, Lq, d) -> all of them so far (B, H, Lk, d)."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v

    def reorder(self, index: Tensor, static_index: Tensor | None) -> None:
        """Keep rows ``index`` (dim 0), in this order (beam search). A static cache takes ``static_index``
        instead, or stays as it is when that is None (beams reordered within their sentences). Each tensor
        is replaced as soon as its copy exists, so the cache is never held twice."""
        if self.static:
            if static_index is None:
                return
            index = static_index
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)


@dataclass
class StaticKVCache:
    """One self-attention layer's keys and values in buffers of a fixed size, (B, H, max_len, d) each
    (static shapes, as transformers' ``StaticCache`` and gpt-fast's cache; not `KVCache`'s ``static``, which
    means a read-only cross-attention cache).

    Each call writes its new rows in place at positions ``length``.. and attends over the whole buffer, the
    positions not yet filled blocked; ``length`` is a device tensor that the call advances in place. So a
    decoding step has the same shapes and addresses at every position and can be replayed as a CUDA graph.
    The buffers are allocated at the first call, with the new keys' batch, heads, dtype and device.
    """

    max_len: int
    k: Tensor | None = None
    v: Tensor | None = None
    length: Tensor | None = None  # () long: positions filled so far
    static = False  # a class constant, not a field: never `KVCache`'s read-only cross-attention cache

    def update(self, k: Tensor, v: Tensor, is_causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Write k/v (B, H, Lq, d) at the next positions -> the buffers (B, H, max_len, d) and the mask
        (Lq, max_len), True at keys a query may not see: those not filled, and with ``is_causal`` those after it."""
        if self.k is None:
            b, h, _, d = k.shape
            self.k = k.new_zeros(b, h, self.max_len, d)
            self.v = v.new_zeros(b, h, self.max_len, d)
            self.length = torch.zeros((), dtype=torch.long, device=k.device)
        lq = k.size(2)
        positions = self.length + torch.arange(lq, device=k.device)  # (Lq,) where the new rows go
        self.k.index_copy_(2, positions, k.to(self.k.dtype))
        self.v.index_copy_(2, positions, v.to(self.v.dtype))
        keys = torch.arange(self.max_len, device=k.device)
        last = positions[:, None] if is_causal else positions[-1:, None]  # the last key each query sees
        self.length.add_(lq)
        return self.k, self.v, keys[None, :] > last

    def reorder(self, index: Tensor, static_index: Tensor | None) -> None:
        """Keep rows ``index`` (dim 0) in this order, in place: the buffers keep their shape and address. A
        static-shape search keeps every row, so ``index`` covers them all and ``static_index`` must be None."""
        if static_index is not None or index.numel() != self.k.size(0):
            raise ValueError(
                f"a StaticKVCache keeps its {self.k.size(0)} rows: reorder takes an index of that many rows and no "
                "static_index (decoding with cache='static' keeps finished sentences in the batch)"
            )
        self.k.copy_(self.k.index_select(0, index))
        self.v.copy_(self.v.index_select(0, index))
