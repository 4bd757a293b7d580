"""The chunked path: attention a block of query rows at a time, each block recomputed in the backward.

Every normalisation of `models.core.attend` normalises each query's row over the keys (softmax, softmax1, clipped
softmax and sigmoid count the visible keys of that row), so computing the weights of a block of queries alone is
exact. The block's scores and weights are freed once its output is made; `torch.utils.checkpoint` keeps only the
block's inputs and recomputes the block in the backward. The masks and position biases come for the block's rows
only (`models.core.masks.MaskParts.rows`): nothing of size (Lq, Lk) is ever held, and the memory of one layer is
O(rows · Lk) per head instead of O(Lq · Lk).

``rows`` follows from ``attention.memory_budget_mib``: the largest block whose fp32 scores (B, H, rows, Lk) fit in
it. A block is given only the keys that the causal and window masks let one of its rows see. A normalisation of one's
own is row-wise when a row's weights depend on its visible keys alone (blocked keys take no weight and change nothing,
as padding must not either); one that is not says ``row_wise = False`` and keeps the full path.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from models.core.attend import FUSED, Softmax1, attention_fast, attention_reference
from models.core.masks import MaskParts

BYTES = 4  # an fp32 score


def scores_mib(batch: int, heads: int, lq: int, lk: int) -> float:
    """The size of the scores (B, H, Lq, Lk) in fp32, in MiB."""
    return batch * heads * lq * lk * BYTES / 2**20


def block_rows(batch: int, heads: int, lk: int, budget_mib: float) -> int:
    """The query rows of one block: as many as keep its scores (B, H, rows, Lk) within ``budget_mib``, at least 1."""
    return max(1, int(budget_mib * 2**20 // (batch * heads * lk * BYTES)))


def _keys_per_row(parts: MaskParts, lk: int) -> int:
    """The keys one query row can see: all of them, or a sliding window's span (a block of at most span rows then sees
    at most 2·span - 1 keys: within twice the budget)."""
    if not parts.window:
        return lk
    return min(lk, parts.window if parts.is_causal else 2 * parts.window - 1)


def row_wise(normalization: nn.Module | None) -> bool:
    """Whether ``normalization`` normalises each query's row alone (every built-in does; a class of one's own may say
    ``row_wise = False``)."""
    return getattr(normalization, "row_wise", True)


def _block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    parts: MaskParts,
    start: int,
    scale: float,
    dropout_p: float,
    normalization: nn.Module,
    similarity: Callable[[Tensor, Tensor], Tensor] | None,
) -> Tensor:
    """The output (B, H, rows, d) of the queries start..start + rows, q (B, H, rows, d). The block sees only the keys
    the causal and window masks leave it: blocked keys take no weight, so leaving them out changes nothing but the
    work (half of it, causal; all but 2·window keys, windowed)."""
    stop = start + q.size(2)
    keys = parts.key_range(start, stop)
    k, v = k[:, :, keys[0] : keys[1]], v[:, :, keys[0] : keys[1]]
    mask = parts.rows(start, stop, q.device, q.dtype, keys)
    if isinstance(normalization, FUSED) and similarity is None:
        sink = normalization.sink_logit if isinstance(normalization, Softmax1) else None
        return attention_fast(q, k, v, mask, scale, dropout_p, sink_logit=sink)
    logits = None if similarity is None else similarity(q, k)
    return attention_reference(q, k, v, mask, scale, dropout_p, normalization, logits)[0]


def attention_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    parts: MaskParts,
    scale: float,
    budget_mib: float,
    dropout_p: float = 0.0,
    normalization: nn.Module | None = None,
    similarity: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """q (B, H, Lq, d), k/v (B, H, Lk, d) -> out (B, H, Lq, d), equal to the full path's, a block of query rows at a
    time (module docstring). ``similarity`` (q, k) -> logits replaces q·k·scale (a similarity of one's own)."""
    span = _keys_per_row(parts, k.size(2))
    rows = min(block_rows(q.size(0), q.size(1), span, budget_mib), span if parts.window else q.size(2))
    block = partial(
        _block,
        parts=parts,
        scale=scale,
        dropout_p=dropout_p,
        normalization=normalization or FUSED[0](),
        similarity=similarity,
    )
    recompute = torch.is_grad_enabled()
    outs = []
    for start in range(0, q.size(2), rows):
        q_rows = q[:, :, start : start + rows]  # (B, H, rows, d)
        if recompute:  # the block's scores are freed now and made again in the backward
            outs.append(checkpoint(partial(block, start=start), q_rows, k, v, use_reentrant=False))
        else:
            outs.append(block(q_rows, k, v, start=start))
    return torch.cat(outs, dim=2)
