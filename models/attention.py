"""The shared attention core: similarity functions, multi-head attention, masks, capture.

Every model in attnlab (text, ViT, DETR) attends through `MultiHeadAttention` below.

Similarity functions (``similarity=``), for a query q and key k of one head (size d):
    "scaled_dot"  q·k / √d        (Vaswani et al. 2017, the default)
    "dot"         q·k             (Luong et al. 2015, "dot")
    "general"     qᵀ W k          (Luong et al. 2015, "general"; W is a learned d×d map per head,
                                   initialised to the identity, so it starts equal to "dot")
Softmax is taken over keys; the output is the weighted sum of values, heads are concatenated and
projected by ``out_proj``.

Mask convention (ONE for the whole project, the one of ``torch.nn.MultiheadAttention`` and DETR):
    a boolean mask is True where attention is BLOCKED (padding, the future).
    ``key_padding_mask``  (B, Lk)                      True at padded keys
    ``attn_mask``         (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk): boolean (True = blocked) or
                          float (added to the logits; -inf blocks)
    ``is_causal``         query i may attend to keys j <= i, aligned to the END of the keys, so
                          that a decoder step with cached keys (Lq < Lk) sees its whole past.
A query row whose keys are all blocked gets all-zero weights and a zero attention output (before
``out_proj``), never NaN.

Positions inside attention (the tables come from `models.position`):
    ``rope``           a `Rotation` of the queries and keys after the projections (RoPE, 1D or 2D), before the
                       kernel; with a KV cache the keys are cached rotated, so a step rotates only its new rows
                       (at the cache's offset, which the caller gives).
    ``position_bias``  (H, Lq, Lk) or (B, H, Lq, Lk) added to the logits (ALiBi, T5, Swin); merged with the
                       masks into one additive float mask.
QK-norm (``qk_norm="layernorm"|"rmsnorm"``, Dehghani et al. 2023, Wortsman et al. 2023): each head's queries
and keys are normalised over d after the projections (learned scale shared by the heads, as in timm), before
the rotation and the similarity; it bounds the logits, whose maximum `capture_attention(scores=True)` records.

SDPA kernel that each option gets on a GPU: no mask, or ``is_causal`` alone (keys as long as queries): flash;
a boolean mask (a cached causal step, padding that the padding-free path below does not take): memory-efficient;
``position_bias``: memory-efficient with a float mask (its gradient flows to a learned bias); math where those
kernels do not apply (e.g. head sizes they lack). ``rope`` and ``qk_norm`` act before the kernel, so they keep
whichever kernel the masks allow.

Padding-free path (`models.padding_free`): a boolean key-padding mask alone (with ``is_causal`` in self-attention;
no other mask, no ``position_bias``, weights not requested, no KV cache, not under torch.compile) packs the valid
rows and runs one variable-length flash kernel over them, so padded keys (and, in self-attention, padded query
rows, which come back as zeros) cost nothing. ``PADDING_FREE`` gives each device type its kernels, first choice
first; the first that takes the call runs (varlen_attn has no dropout). Off by default: on the CPU it cannot be
faster, and on CUDA it waits for its measurement (issue 28); the tests set ``PADDING_FREE["cpu"]`` to hold it to
the reference path.

Fast path: ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU) whenever
weights are not needed. Reference path: explicit softmax, used when weights are requested
(``need_weights=True`` or inside `capture_attention`) and as the test oracle.

Incremental decoding keeps each layer's projected keys and values in a `KVCache` (growing by each step), or
in a `StaticKVCache` (buffers of a fixed length written in place: static shapes, for CUDA graphs).

Grouped-query attention (``num_kv_heads`` < ``num_heads``, Ainslie et al. 2023; Llama 2/3, Mistral): keys
and values have ``num_kv_heads`` heads, each shared by ``num_heads // num_kv_heads`` consecutive query heads.
The KV cache holds the key/value heads; they are repeated to the query heads just before the kernel.

Parameters use the layout of ``torch.nn.MultiheadAttention`` (packed ``in_proj_weight`` of shape
(3D, D), ``in_proj_bias``, ``out_proj``), so its state dict loads unchanged and timm's ``attn.qkv``
/ DETR's checkpoints load by renaming keys. With grouped-query attention the packing stays, with
narrower keys and values: ``in_proj_weight`` is (D + 2·D_kv, D), the q rows, then k, then v
(D_kv = num_kv_heads·d), as Llama's ``q_proj``, ``k_proj``, ``v_proj`` concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.padding_free import PaddingFree, attention_padding_free, packing, supported
from models.position import Rotation

Similarity = Literal["scaled_dot", "dot", "general"]
SIMILARITIES = ("scaled_dot", "dot", "general")
QKNorm = Literal["layernorm", "rmsnorm"]
_QK_NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
# device type -> the padding-free kernels for a key-padding mask, first choice first (module docstring); none: the
# masked SDPA. Off on CUDA too until a GPU session has run tests/test_padding_free.py's CUDA tests and
# `python -m benchmarks --only padding`, then sets the kernels the measurement supports, e.g. ("varlen", "nested").
PADDING_FREE: dict[str, tuple[PaddingFree, ...]] = {"cuda": (), "cpu": ()}


def subsequent_mask(size: int, device: torch.device | None = None) -> Tensor:
    """(size, size) boolean mask, True above the diagonal: position i may not see j > i."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


def _causal_mask(lq: int, lk: int, device: torch.device) -> Tensor:
    # Aligned to the end: query i sits at absolute position lk - lq + i.
    return torch.ones(lq, lk, dtype=torch.bool, device=device).triu(lk - lq + 1)


def merge_masks(
    batch: int,
    lq: int,
    lk: int,
    *,
    attn_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    position_bias: Tensor | None = None,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor | None:
    """Combine causal, key-padding and arbitrary masks and a position bias into one broadcastable
    (B|1, H|1, Lq, Lk) mask.

    Returns a boolean mask (True = blocked) when every input is boolean, else an additive float
    mask; None when nothing is masked.
    """
    parts: list[Tensor] = []
    if position_bias is not None:
        if position_bias.shape[-2:] != (lq, lk) or position_bias.dim() not in (3, 4):
            raise ValueError(
                f"position_bias has shape {tuple(position_bias.shape)}, expected (heads, {lq}, {lk}) or (batch, heads, {lq}, {lk})"
            )
        parts.append(position_bias.to(device) if position_bias.dim() == 4 else position_bias.to(device)[None])
    if is_causal:
        parts.append(_causal_mask(lq, lk, device))
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, lk):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (batch={batch}, keys={lk})"
            )
        parts.append(key_padding_mask.to(device)[:, None, None, :])
    if attn_mask is not None:
        if attn_mask.shape[-2:] != (lq, lk):
            raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}, expected (..., {lq}, {lk})")
        m = attn_mask.to(device)
        if m.dim() == 3:
            m = m[:, None]
        parts.append(m)
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        mask = parts[0]
        for p in parts[1:]:
            mask = mask | p
        return mask if mask.dim() == 4 else mask[None, None]
    additive = torch.zeros((), dtype=dtype, device=device)
    for p in parts:
        additive = additive + (
            torch.zeros_like(p, dtype=dtype).masked_fill(p, float("-inf")) if p.dtype == torch.bool else p.to(dtype)
        )
    return additive if additive.dim() == 4 else additive.reshape((1,) * (4 - additive.dim()) + additive.shape)


def _empty_rows(mask: Tensor) -> Tensor:
    """(B|1, H|1, Lq, 1): True where a query row blocks every key."""
    return (mask if mask.dtype == torch.bool else torch.isneginf(mask)).all(-1, keepdim=True)


def _split_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Unblock rows that block every key (so softmax stays finite) and return which rows they were."""
    empty = _empty_rows(mask)
    if mask.dtype == torch.bool:
        return mask & ~empty, empty
    return mask.masked_fill(empty, 0.0), empty


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Explicit softmax attention. q (B, H, Lq, d), k/v (B, H, Lk, d) -> out (B, H, Lq, d), weights (B, H, Lq, Lk)
    and logits (B, H, Lq, Lk): the scaled similarities before the mask (and a position bias in it) and the softmax."""
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    scores, empty = logits, None
    if mask is not None:
        mask, empty = _split_empty_rows(mask)
        scores = logits.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    weights = scores.softmax(dim=-1)
    if empty is not None:
        weights = weights.masked_fill(empty, 0.0)
    out = F.dropout(weights, dropout_p) @ v if dropout_p > 0 else weights @ v
    return out, weights, logits


def _cpu_sdpa_zeroes_empty_rows() -> bool:
    """Whether this torch's CPU SDPA already returns zeros (and finite gradients) for a query row whose
    keys are all blocked (torch >= 2.5 uses a safe softmax there); then the fast path skips its own fix,
    a pass over the output that costs ~15% of self-attention at L=64 with padding."""
    q = torch.ones(1, 1, 1, 2, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 1, dtype=torch.bool))
    out.sum().backward()
    return bool((out == 0).all() and torch.isfinite(q.grad).all())


_CPU_SDPA_SAFE = _cpu_sdpa_zeroes_empty_rows()


def attention_fast(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, dropout_p: float = 0.0, is_causal: bool = False
) -> Tensor:
    """SDPA with the project's mask convention. ``is_causal`` only when Lq == Lk and no other mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if q.device.type == "cpu" and _CPU_SDPA_SAFE:  # GPU kernels are not all known to: fix the rows below
        sdpa_mask = ~mask if mask.dtype == torch.bool else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, scale=scale)
    empty = _empty_rows(mask)
    if (
        mask.dtype == torch.bool
    ):  # SDPA's boolean convention is True = attend; an empty row attends to all, then is zeroed
        sdpa_mask = torch.logical_not(mask).logical_or_(
            empty
        )  # two kernels: each launch counts at these sizes on a GPU
    else:
        sdpa_mask = mask.masked_fill(empty, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, scale=scale)
    # where, not masked_fill: it keeps SDPA's memory layout (B, L, H, d), so that merging the heads stays a
    # view; masked_fill returns a contiguous (B, H, L, d) copy, which the merge then copies once more
    return torch.where(empty, 0.0, out)


def _padding_free_kernel(
    q: Tensor, lk: int, key_padding_mask: Tensor | None, is_causal: bool, self_attention: bool, dropout_p: float
) -> PaddingFree | None:
    """The padding-free kernel for q (B, H, Lq, d) and this key-padding mask alone, or None (module docstring)."""
    if key_padding_mask is None or key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (q.shape[0], lk):
        return None  # (merge_masks names a wrong shape)
    if (is_causal and not self_attention) or torch.compiler.is_compiling():
        return None
    return next((k for k in PADDING_FREE.get(q.device.type, ()) if supported(q, k, is_causal, dropout_p)), None)


@dataclass
class KVCache:
    """One attention layer's projected keys and values, (B, H, L, d) each, kept between decoding steps.

    Self-attention appends each step's keys and values. A ``static`` cache (cross-attention) is filled
    once from the memory, then only read; it may hold one row per sentence for all of its beams.
    """

    k: Tensor | None = None
    v: Tensor | None = None
    static: bool = False

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


@dataclass
class AttentionScores:
    """What one call of a layer computed, recorded by ``capture_attention(model, scores=True)``.

    weights (B, H, Lq, Lk): the attention; logits (B, H, Lq, Lk): the scaled similarities before the
    mask, the position bias and the softmax (their maximum is the largest attention logit, which QK-norm
    bounds); blocked: the mask, True where attention is blocked, broadcastable to the weights
    ((B|1, H|1, Lq, Lk)), or None when nothing was masked.
    """

    weights: Tensor
    logits: Tensor
    blocked: Tensor | None


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self- and cross-attention, with a choice of similarity.

    Args:
        embed_dim: model width D.
        num_heads: number of heads H; D must be divisible by H.
        dropout: dropout on the attention weights during training.
        similarity: "scaled_dot", "dot" or "general" (see the module docstring).
        bias: biases on the input and output projections.
        qk_norm: None, "layernorm" or "rmsnorm": normalise each head's queries and keys (module docstring).
        num_kv_heads: key/value heads; fewer than ``num_heads`` (a divisor): grouped-query attention (module
            docstring). None: ``num_heads``.

    Shapes (batch first): query (B, Lq, D), key/value (B, Lk, D) -> output (B, Lq, D) and,
    when requested, weights (B, H, Lq, Lk).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        similarity: Similarity = "scaled_dot",
        bias: bool = True,
        qk_norm: QKNorm | None = None,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        if similarity not in SIMILARITIES:
            raise ValueError(f"similarity={similarity!r} is not known; choose one of {', '.join(SIMILARITIES)}")
        if qk_norm is not None and qk_norm not in _QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not known; choose null, {' or '.join(_QK_NORMS)}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={num_heads}")
        self.kv_dim = self.num_kv_heads * self.head_dim  # D_kv
        self.dropout, self.similarity = dropout, similarity
        self.in_proj_weight = nn.Parameter(torch.empty(embed_dim + 2 * self.kv_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(embed_dim + 2 * self.kv_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if similarity == "general":
            self.general_weight = nn.Parameter(torch.eye(self.head_dim).repeat(num_heads, 1, 1))  # (H, d, d)
        if qk_norm is not None:  # timm's names
            self.q_norm = _QK_NORMS[qk_norm](self.head_dim, eps=1e-6)
            self.k_norm = _QK_NORMS[qk_norm](self.head_dim, eps=1e-6)
        self.qk_norm = qk_norm
        self._captured: list[Tensor] | list[AttentionScores] | None = None
        self._capture_scores = False
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.similarity == "scaled_dot" else 1.0

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project and split into heads: q (B, H, Lq, d), k and v (B, H, Lk, d). Packed projections are
        split with one view, permute and unbind, as timm does: every view is an autograd node, and at
        small sizes (on a GPU, most steps) each node's host time counts."""
        w, b, d = self.in_proj_weight, self.in_proj_bias, self.embed_dim
        if self.kv_dim != d:
            return self._project_grouped(query, key, value)
        if query is key and key is value:  # self-attention: one packed matmul
            return self._heads(F.linear(query, w, b), 3)
        bq, bk, bv = (None, None, None) if b is None else b.split(d)
        if query is key:  # DETR: positions added to queries and keys, not to values
            q, k = self._heads(F.linear(query, w[: 2 * d], None if b is None else b[: 2 * d]), 2)
            return q, k, self._heads(F.linear(value, w[2 * d :], bv))[0]
        q = self._heads(F.linear(query, w[:d], bq))[0]
        if key is value:  # cross-attention to a memory
            k, v = self._heads(F.linear(key, w[d:], None if b is None else b[d:]), 2)
            return q, k, v
        return q, self._heads(F.linear(key, w[d : 2 * d], bk))[0], self._heads(F.linear(value, w[2 * d :], bv))[0]

    def _project_grouped(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Grouped-query attention: q (B, H, Lq, d), k and v (B, H_kv, Lk, d), from ``in_proj``'s rows (D, D_kv, D_kv)."""
        sizes = (self.embed_dim, self.kv_dim, self.kv_dim)
        if query is key and key is value:  # self-attention: one packed matmul
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).split(sizes, -1)
        else:
            biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.split(sizes)
            q, k, v = (
                F.linear(x, w, b) for x, w, b in zip((query, key, value), self.in_proj_weight.split(sizes), biases)
            )
        return tuple(x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for x in (q, k, v))

    def _heads(self, x: Tensor, n: int = 1) -> tuple[Tensor, ...]:
        """(B, L, n·D) -> n tensors (B, H, L, d)."""
        b, l, _ = x.shape
        if n == 1:
            return (x.view(b, l, self.num_heads, self.head_dim).transpose(1, 2),)
        return x.view(b, l, n, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: KVCache | StaticKVCache | None = None,
        rope: Rotation | None = None,
        position_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (both default to ``query``: self-attention).

        ``cache`` enables incremental decoding: the module fills it with this layer's projected keys
        and values (B, H, Lk, d). New keys are appended each call, unless the cache is ``static``
        (cross-attention): then they are computed once from the memory and read afterwards. A `StaticKVCache`
        (self-attention) takes the new keys in place and the attention covers its whole buffer, unfilled keys blocked.

        ``key``/``value`` may hold fewer rows than ``query`` (cross-attention only, ``key_padding_mask``
        (B_kv, Lk) the only mask): each of their rows then serves ``B // B_kv`` consecutive query rows, so
        beam search keeps one copy of a sentence's memory and its keys/values for all its beams.

        ``rope`` rotates the queries and the new keys (cos/sin (..., Lq, d): self-attention, the new rows'
        positions); ``position_bias`` (H, Lq, Lk) or (B, H, Lq, Lk) is added to the logits. See the module docstring.

        Returns (output (B, Lq, D), weights (B, H, Lq, Lk) or None).
        """
        key = query if key is None else key
        value = key if value is None else value
        if cache is not None and cache.static and cache.k is not None:
            if rope is not None:
                raise ValueError("rope rotates self-attention; a static (cross-attention) cache takes none")
            q = self._heads(
                F.linear(
                    query,
                    self.in_proj_weight[: self.embed_dim],
                    None if self.in_proj_bias is None else self.in_proj_bias[: self.embed_dim],
                )
            )[0]
            k, v = cache.k, cache.v
            if self.qk_norm is not None:
                q = self.q_norm(q)
        else:
            q, k, v = self._project(query, key, value)
            if self.qk_norm is not None:  # (B, H, L, d), over d
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = rope(q), rope(k)
            if isinstance(cache, StaticKVCache):
                if attn_mask is not None or key_padding_mask is not None:
                    raise ValueError("a StaticKVCache masks the positions it has not filled itself; pass no other mask")
                k, v, attn_mask = cache.update(k, v, is_causal)
                is_causal = False
                if position_bias is not None:  # given over the filled keys: the rest are blocked
                    position_bias = F.pad(position_bias, (0, cache.max_len - position_bias.size(-1)))
            elif cache is not None:
                if cache.k is not None:
                    k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
                cache.k, cache.v = k, v
        if self.num_kv_heads != self.num_heads:
            # kv head j serves q heads j·g .. j·g + g - 1: (B, H_kv, Lk, d) -> (B, H, Lk, d)
            k, v = (x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1) for x in (k, v))
        if self.similarity == "general":
            q = torch.einsum("bhld,hde->bhle", q, self.general_weight)  # qᵀW, then ·k below
        bsz, _, lq, _ = q.shape
        kv_bsz, _, lk, _ = k.shape
        group = bsz // kv_bsz  # query rows per key/value row
        if group * kv_bsz != bsz:
            raise ValueError(f"query batch {bsz} is not a multiple of the key/value batch {kv_bsz}")
        if group > 1:  # the rows of one key/value row's group attend as one longer query (beams sharing a memory)
            if attn_mask is not None or is_causal or position_bias is not None:
                raise ValueError(
                    "a query batch larger than the key/value batch (beams sharing one memory) takes key_padding_mask only"
                )
            q = (
                q.view(kv_bsz, group, self.num_heads, lq, self.head_dim)
                .transpose(1, 2)
                .reshape(kv_bsz, self.num_heads, group * lq, self.head_dim)
            )
        dropout_p = self.dropout if self.training else 0.0
        want_weights = need_weights or self._captured is not None
        plain_causal = (
            is_causal and lq == lk and attn_mask is None and key_padding_mask is None and position_bias is None
        )
        self_attention = key is query  # then the query rows are padded as the keys (no cache: as many)
        kernel = (
            None
            if want_weights or attn_mask is not None or position_bias is not None or group > 1 or cache is not None
            else _padding_free_kernel(q, lk, key_padding_mask, is_causal, self_attention, dropout_p)
        )
        if kernel is not None:
            pack = packing(key_padding_mask.to(q.device), lq, self_attention)
            out = attention_padding_free(q, k, v, pack, self.scale, dropout_p, is_causal, kernel)
            return self.out_proj(out.transpose(1, 2).reshape(bsz, lq, self.embed_dim)), None
        mask = (
            None
            if plain_causal and not want_weights
            else merge_masks(
                kv_bsz,
                q.shape[2],
                lk,
                attn_mask=attn_mask,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                position_bias=position_bias,
                device=q.device,
                dtype=q.dtype,
            )
        )
        weights = logits = None
        if want_weights:
            out, weights, logits = attention_reference(q, k, v, mask, self.scale, dropout_p)
        else:
            out = attention_fast(q, k, v, mask, self.scale, dropout_p, is_causal=plain_causal)
        if group > 1:  # (B_kv, H, group·Lq, ·) -> (B, H, Lq, ·)
            out = out.view(kv_bsz, self.num_heads, group, lq, -1).transpose(1, 2).reshape(bsz, self.num_heads, lq, -1)
            if weights is not None:
                weights, logits = (
                    x.view(kv_bsz, self.num_heads, group, lq, lk).transpose(1, 2).reshape(bsz, self.num_heads, lq, lk)
                    for x in (weights, logits)
                )
                mask = (
                    None if mask is None else mask.repeat_interleave(group, 0)
                )  # key padding only: (B_kv, 1, 1, Lk) -> (B, 1, 1, Lk)
        if self._captured is not None:
            if self._capture_scores:
                blocked = None if mask is None else mask if mask.dtype == torch.bool else torch.isneginf(mask)
                self._captured.append(AttentionScores(weights.detach(), logits.detach(), blocked))
            else:
                self._captured.append(weights.detach())
        out = out.transpose(1, 2).reshape(bsz, lq, self.embed_dim)  # (B, Lq, D)
        return self.out_proj(out), (weights if need_weights else None)


@contextmanager
def capture_attention(
    model: nn.Module, scores: bool = False
) -> Iterator[dict[str, list[Tensor]] | dict[str, list[AttentionScores]]]:
    """Record the attention weights of every `MultiHeadAttention` in ``model``, unedited.

    Inside the block every attention layer takes the reference path and appends its weights
    (B, H, Lq, Lk), detached, to the list under its module name, once per call::

        with capture_attention(vit) as maps:
            vit(images)
        maps["blocks.0.attn"][0]  # (B, H, 1 + N, 1 + N)

    With ``scores=True`` each call appends an `AttentionScores` instead: the weights together with
    the logits and the blocked mask, as the layer computed them (for the attention statistics).
    """
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    maps: dict[str, list] = {name: [] for name in layers}
    for name, m in layers.items():
        m._captured, m._capture_scores = maps[name], scores
    try:
        yield maps
    finally:
        for m in layers.values():
            m._captured, m._capture_scores = None, False
