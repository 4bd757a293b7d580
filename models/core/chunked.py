"""The chunked path: attention a block of query rows at a time, each block recomputed in the backward.

Every normalisation of `models.core.attend` normalises each query's row over the keys (softmax, softmax1, clipped
softmax and sigmoid count the visible keys of that row), so computing the weights of a block of queries alone is
exact. The block's scores and weights are freed once its output is made. `ChunkedAttention`, one autograd node for the
whole call, keeps q, k and v only; its backward makes each block again and adds the block's gradients into those of
q, k, v (and of the tensors the block reads that take a gradient: a learned bias table, a normalisation's parameters),
in place. The masks and position biases come for the block's rows only (`models.core.masks.MaskParts.rows`): nothing
of size (Lq, Lk) is ever held, and the memory of one layer is O(rows · Lk) per head instead of O(Lq · Lk).

``rows`` follows from ``attention.memory_budget_mib``: the largest block whose fp32 scores (B, H, rows, Lk) fit in
it (twice that for SDPA, which makes no scores: `SDPA_ROWS`). A block is given only the keys that the causal and window masks let one of its rows see. A normalisation of one's
own is row-wise when a row's weights depend on its visible keys alone (blocked keys take no weight and change nothing,
as padding must not either); one that is not says ``row_wise = False`` and keeps the full path.

Under ``torch.compile`` the chunked call is a graph break and runs eagerly (``fullgraph=True`` refuses it): traced, its
loop would unroll into a graph of every block of every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from models.core.attend import FUSED, Softmax1, attention_fast, attention_reference
from models.core.masks import LazyBias, MaskParts

BYTES = 4  # an fp32 score
# An SDPA block makes no scores or weights, only its float mask (the bias, masked): at the same budget it takes twice
# the rows, which halves the reads of k and v and the writes of their gradients, one per block (ALiBi, one causal layer
# at L = 8,192: 94 MB and 18.6 s with the rows of the reference path, 98 MB and 14.5 s with twice them)
SDPA_ROWS = 2


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


@dataclass
class Blocks:
    """How one call is cut: ``rows`` query rows a block, each over the keys ``parts.key_range`` leaves it, with the
    call's masks, scale, dropout, normalisation and similarity (None: q·k·scale)."""

    parts: MaskParts
    rows: int
    scale: float
    dropout_p: float
    normalization: nn.Module
    similarity: Callable[[Tensor, Tensor], Tensor] | None
    rng: dict = field(default_factory=dict)  # the RNG states a call with dropout started from, to draw its masks again

    def starts(self, lq: int) -> Iterator[tuple[int, int, tuple[int, int]]]:
        """(start, stop, keys) of every block, in order."""
        for start in range(0, lq, self.rows):
            stop = min(start + self.rows, lq)
            yield start, stop, self.parts.key_range(start, stop)

    def out(self, q: Tensor, k: Tensor, v: Tensor, start: int, keys: tuple[int, int]) -> Tensor:
        """The output (B, H, rows, d) of the query rows q (B, H, rows, d) from ``start``, over the keys k/v
        (B, H, keys, d) of keys[0]..keys[1]. Blocked keys take no weight, so leaving out those the causal and window
        masks block changes nothing but the work (half of it, causal; all but 2·window keys, windowed)."""
        mask = self.parts.rows(start, start + q.size(2), q.device, q.dtype, keys)
        if isinstance(self.normalization, FUSED) and self.similarity is None:
            sink = self.normalization.sink_logit if isinstance(self.normalization, Softmax1) else None
            return attention_fast(q, k, v, mask, self.scale, self.dropout_p, sink_logit=sink)
        logits = None if self.similarity is None else self.similarity(q, k)
        norm = self.normalization
        return attention_reference(q, k, v, mask, self.scale, self.dropout_p, norm, logits, keep_logits=False)[0]

    def read(self) -> list[Tensor]:
        """The tensors besides q, k and v that a block reads and that take a gradient."""
        modules = [m for m in (self.normalization, self.similarity) if isinstance(m, nn.Module)]
        tensors = [p for m in modules for p in m.parameters()]
        for part in (self.parts.attn_mask, self.parts.position_bias):
            tensors += list(part.tensors) if isinstance(part, LazyBias) else [part] if isinstance(part, Tensor) else []
        return [t for t in tensors if t.requires_grad]

    @contextmanager
    def replay(self, device: torch.device) -> Iterator[None]:
        """Inside, dropout draws what the forward drew: the blocks run again in order from the saved RNG state."""
        if not self.rng:
            yield
            return
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.rng["cpu"])
            if devices:
                torch.cuda.set_rng_state(self.rng["cuda"], device)
            yield

    def remember_rng(self, device: torch.device) -> None:
        if self.dropout_p > 0:
            self.rng["cpu"] = torch.get_rng_state()
            if device.type == "cuda":
                self.rng["cuda"] = torch.cuda.get_rng_state(device)


def _forward(blocks: Blocks, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """out (B, H, Lq, d) block by block, written in place."""
    out = q.new_empty(*q.shape[:3], v.size(-1))
    for start, stop, (k0, k1) in blocks.starts(q.size(2)):
        out[:, :, start:stop] = blocks.out(q[:, :, start:stop], k[:, :, k0:k1], v[:, :, k0:k1], start, (k0, k1))
    return out


class ChunkedAttention(torch.autograd.Function):
    """out = attention(q, k, v) a block of query rows at a time (`Blocks`); the backward makes each block again.
    ``read`` are the tensors the blocks read that take a gradient (`Blocks.read`), passed so that theirs flows on."""

    @staticmethod
    def forward(ctx, blocks: Blocks, q: Tensor, k: Tensor, v: Tensor, *read: Tensor) -> Tensor:
        blocks.remember_rng(q.device)
        device = q.device.type
        ctx.autocast = device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        ctx.blocks, ctx.read = blocks, read
        ctx.save_for_backward(q, k, v)
        return _forward(blocks, q, k, v)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v = ctx.saved_tensors
        blocks, read = ctx.blocks, ctx.read
        grads = [torch.zeros_like(t) if ctx.needs_input_grad[i + 1] else None for i, t in enumerate((q, k, v, *read))]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), blocks.replay(q.device), torch.autocast(device, dtype, enabled):
            for start, stop, (k0, k1) in blocks.starts(q.size(2)):
                spans = ((start, stop), (k0, k1), (k0, k1))
                views = [t[:, :, a:b] for t, (a, b) in zip((q, k, v), spans)]
                rows = [t.detach().requires_grad_(g is not None) for t, g in zip(views, grads)]
                out = blocks.out(*rows, start, (k0, k1))
                if start == 0:
                    _check_reads(out, rows, read)
                targets = [None if g is None else g[:, :, a:b] for g, (a, b) in zip(grads, spans)] + grads[3:]
                _accumulate(out, grad[:, :, start:stop], [*rows, *read], targets)
        return None, *grads


def _accumulate(out: Tensor, grad: Tensor, inputs: list[Tensor], targets: list[Tensor | None]) -> None:
    """Add the gradient of ``out`` (seen from ``grad``) with respect to each input into its target, where there is
    one, in place: a block's share of the gradients of q, k, v and the tensors it reads."""
    pairs = [(t, g) for t, g in zip(inputs, targets) if g is not None]
    found = torch.autograd.grad(out, [t for t, _ in pairs], grad, allow_unused=True)
    for (_, target), block in zip(pairs, found):
        if block is not None:
            target.add_(block)


def _check_reads(out: Tensor, rows: list[Tensor], read: tuple[Tensor, ...]) -> None:
    """One line if a block's output depends on a tensor that takes a gradient and that `Blocks.read` did not name
    (its gradient would be lost): a `LazyBias` whose ``tensors`` leave one out."""
    known = {id(t) for t in (*rows, *read)}
    stops = {t.grad_fn for t in read if t.grad_fn is not None}
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stops:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known:
            raise ValueError(
                f"the chunked attention path reads a tensor of shape {tuple(variable.shape)} that takes a gradient "
                "but is not among the tensors its masks and biases declare (LazyBias.tensors): its gradient would be "
                "lost; name it there"
            )
        todo += [next_node for next_node, _ in node.next_functions]


@torch.compiler.disable(reason="the chunked path runs eagerly: tracing it would unroll every block of every layer")
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
    normalization = normalization or FUSED[0]()
    fused = isinstance(normalization, FUSED) and similarity is None
    span = _keys_per_row(parts, k.size(2))
    rows = block_rows(q.size(0), q.size(1), span, budget_mib * (SDPA_ROWS if fused else 1))
    blocks = Blocks(parts, min(rows, span if parts.window else q.size(2)), scale, dropout_p, normalization, similarity)
    read = blocks.read()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *read)):
        return ChunkedAttention.apply(blocks, q, k, v, *read)
    return _forward(blocks, q, k, v)
