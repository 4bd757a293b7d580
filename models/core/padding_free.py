"""Padding-free attention for padded batches: the valid rows of every sequence packed end to end, one
variable-length kernel over them, the result scattered back. `models.core.attention` takes it for a key-padding
mask (alone, or with ``is_causal`` in self-attention) with the kernels its ``PADDING_FREE`` gives a device.

SDPA's flash kernel refuses any ``attn_mask``, so a padded batch gets the memory-efficient kernel over every
padded key and row. Here no work is done for a padded key, nor, in self-attention, for a padded query row;
a sequence with no valid key costs nothing. Those rows come back as zeros (before ``out_proj``): a padded
query row is never read by a loss nor attended to, so the model's outputs at valid positions and its
gradients are those of the masked path (the tests hold it to the reference path).

Kernels (``kernel=``), both torch's, both flash's variable-length kernel on a GPU:
    "varlen"  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10; CUDA only, fp16/bf16, no dropout)
    "nested"  ``F.scaled_dot_product_attention`` on nested jagged tensors (CUDA: flash, memory-efficient or
              cuDNN, dropout included; CPU: a math kernel, without ``is_causal``)
`python -m benchmarks --only padding` (also part of ``--only gpu``) measures both against the masked path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None

PaddingFree = Literal["varlen", "nested"]
KERNELS = ("varlen", "nested")


@dataclass(frozen=True)
class Packing:
    """Where the valid rows of a padded batch lie. q_rows (Tq,), k_rows (Tk,): indices into the flattened
    (B·Lq) queries and (B·Lk) keys, in order; cu_q, cu_k (N + 1,) int32: where each of the N kept sequences
    starts in the packed rows (flash's cumulative lengths); max_q, max_k: the longest kept sequence."""

    q_rows: Tensor
    k_rows: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


# the packings of the last few masks, newest first: (mask, its version, (Lq, self-attention), packing)
_RECENT: list[tuple[weakref.ref, int, tuple[int, bool], Packing]] = []


def packing(key_padding_mask: Tensor, lq: int, self_attention: bool) -> Packing:
    """The `Packing` of ``key_padding_mask`` (B, Lk), True at padding. In self-attention (Lq == Lk) the query
    rows are padded as the keys; in cross-attention every query row of a sequence with keys is kept.

    Computing it waits once for the device (its lengths become the kernel's integers); the packings of the
    last few masks are kept, so the other layers of a stack, which get the same mask, do not wait again."""
    key = (lq, self_attention)
    tracked = not torch.is_inference(key_padding_mask)  # an inference tensor has no version to check
    for ref, version, entry_key, pack in _RECENT if tracked else ():
        if ref() is key_padding_mask and version == key_padding_mask._version and entry_key == key:
            return pack
    device = key_padding_mask.device
    valid = ~key_padding_mask.cpu()  # (B, Lk)
    k_len = valid.sum(1)  # (B,)
    kept = k_len > 0  # a sequence without keys is left out: its rows stay zero
    q_len = k_len if self_attention else kept * lq

    def rows(m: Tensor) -> Tensor:
        return m.flatten().nonzero().squeeze(1).to(device)

    def starts(n: Tensor) -> Tensor:
        return F.pad(n[kept].cumsum(0), (1, 0)).to(device, torch.int32)

    k_rows, cu_k = rows(valid), starts(k_len)
    q_rows, cu_q = (k_rows, cu_k) if self_attention else (rows(kept[:, None].expand(-1, lq)), starts(q_len))
    pack = Packing(q_rows, k_rows, cu_q, cu_k, int(q_len.max()), int(k_len.max()))
    if tracked:
        _RECENT.insert(0, (weakref.ref(key_padding_mask), key_padding_mask._version, key, pack))
        del _RECENT[4:]
    return pack


def supported(q: Tensor, kernel: PaddingFree, is_causal: bool, dropout_p: float) -> bool:
    """Whether ``kernel`` takes these queries (B, H, L, d). "varlen": no dropout, a torch that has it. On a GPU:
    within flash's limits (fp16/bf16, d a multiple of 8 up to 256), outside which NJT SDPA would fall to kernels
    slower than the masked path's. On the CPU: "nested" without ``is_causal`` (NJT SDPA's math kernel has none);
    "varlen" for the tests' stand-in (torch has no CPU varlen_attn)."""
    if kernel == "varlen" and (dropout_p > 0 or varlen_attn is None):
        return False
    d = q.shape[-1]
    if q.device.type == "cuda":
        return _kernel_dtype(q) in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
    return kernel == "varlen" or not is_causal


def attention_padding_free(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pack: Packing,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    kernel: PaddingFree = "varlen",
) -> Tensor:
    """q (B, H, Lq, d), k/v (B, H, Lk, d) and their `Packing` -> out (B, H, Lq, d), laid out as (B, Lq, H, d)
    (the heads merge with a view); zero in the rows the packing leaves out. ``is_causal``: self-attention only."""
    b, h, lq, _ = q.shape
    if not pack.max_k:  # no sequence has a key: nothing to compute
        return q.new_zeros(b, h, lq, v.shape[-1])
    dtype = _kernel_dtype(q)
    qp, kp, vp = (
        x.transpose(1, 2).reshape(-1, h, x.shape[-1]).index_select(0, rows).to(dtype)  # (T, H, d)
        for x, rows in ((q, pack.q_rows), (k, pack.k_rows), (v, pack.k_rows))
    )
    if kernel == "varlen":  # `supported`: no dropout
        window = (-1, 0) if is_causal else (-1, -1)  # flash's causal window: within each sequence
        packed = varlen_attn(qp, kp, vp, pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, scale=scale, window_size=window)
    else:
        packed = F.scaled_dot_product_attention(
            _nested(qp, pack.cu_q, pack.max_q),
            _nested(kp, pack.cu_k, pack.max_k),
            _nested(vp, pack.cu_k, pack.max_k),
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
        )
        packed = packed.transpose(1, 2).values()  # (Tq, H, d)
    out = packed.new_zeros(b * lq, h, packed.shape[-1]).index_copy_(0, pack.q_rows, packed)  # (B·Lq, H, d)
    return out.view(b, lq, h, -1).transpose(1, 2)


def _kernel_dtype(q: Tensor) -> torch.dtype:
    """The dtype SDPA would attend in: autocast's where it is on (SDPA is on its lower-precision list; QK-norm's
    LayerNorm gives float32 queries and keys under it), else the queries'."""
    device = q.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype


def _nested(x: Tensor, starts: Tensor, longest: int) -> Tensor:
    """Packed rows (T, H, d) and where each sequence starts -> a jagged nested tensor (N, H, j, d)."""
    return torch.nested.nested_tensor_from_jagged(x, starts, max_seqlen=longest, min_seqlen=1).transpose(1, 2)
