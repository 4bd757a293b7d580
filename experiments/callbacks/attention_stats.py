"""Attention statistics of any attnlab model on one fixed batch, measured with `capture_attention`.

Per attention layer and head, each a mean over queries (padded queries and blocked keys left out):
    entropy      -Σ_k p_k log p_k (nats): the spread of attention
    max_weight   max_k p_k: softmax saturation (1 = one-hot)
    saturated    share of queries whose largest weight exceeds 0.9
    logit_var    the variance of the logits (scaled, before the softmax) over the keys a query may see: √d keeps
                 it near 1
    distance     attention-weighted distance to the keys: tokens for text (|i - j|, also target to source in
                 cross-attention), pixels for ViT patches and DETR's memory cells ([CLS] and object queries have no
                 place and are left out)
    special      attention mass on special tokens: [CLS] for the ViT, BOS/EOS for text (none in DETR)
    sink_mass, sink_heads, register_mass, out_max, out_kurtosis: the sinks and the outliers of the layer's output
                 (`experiments.callbacks.sinks`), and their reduction over the model under ``summary``
The model's inputs are what the LightningModule passed to ``model`` on the fixed batch (`FirstCall`): ViT
``(images,)``, DETR ``(images, mask)``, translation ``(src, tgt)``, language model ``(tokens,)``.

Long inputs. Every statistic of the weights is a mean over query rows of a quantity of one row (its weights, logits
and mask over all the keys; which queries count is row-wise too: a self-attention's padded query is its own blocked
key), so it is measured a block of query rows at a time, exactly: a layer call whose fp32 scores (B, H, Lq, Lk) pass
`BLOCK_MIB` is recorded in row blocks of at most `BLOCK_MIB` each (``capture_attention(block_mib=...)``), each
reduced to per-head sums and counts of the rows that count (`_row_sums`) and freed before the next; the means divide
the summed sums by the summed counts (`_means`). sink_heads follows from the combined sink_mass; out_max and
out_kurtosis read the layer's output (B, Lq, D). So a long-context model's statistics are those of the whole fixed
batch, holding one block's weights, logits and mask and a few temporaries of that size at a time (O(rows · Lk) per
head, a few times `BLOCK_MIB`), never (B, H, Lq, Lk); none is left out for its size. A normalisation of one's own
that is not row-wise (``row_wise = False``, `models.core.chunked`) or a kernel of one's own gives its whole weights,
which the layer computes anyway. ``attention.png`` draws the whole maps of the first sample, and is left out (the
reason in summary.json) where they would pass `CAPTURE_MIB`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch import Tensor, nn

from experiments.callbacks import sinks
from models.core.attention import AttentionScores, MultiHeadAttention
from models.core.capture import capture_attention

SATURATION = 0.9  # a query whose largest weight exceeds this attends, in effect, to one key
BLOCK_MIB = 64.0  # the fp32 scores of one row block of a layer call that the statistics hold (module docstring)
CAPTURE_MIB = 1024.0  # the whole fp32 weights of every layer call that attention.png may hold


@dataclass
class Sequence:
    """What the attention of one sequence needs besides the weights: ``positions`` (L, C), coordinates in ``unit``
    (NaN rows have no place: [CLS], object queries); ``special`` (B, L), True at special tokens, or None."""

    positions: Tensor | None
    special: Tensor | None


class FirstCall:
    """Record the positional and keyword inputs of ``module``'s next call (detached), then stop listening."""

    def __init__(self, module: nn.Module):
        self.args: tuple | None = None
        self.kwargs: dict[str, Any] = {}
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        detach = lambda x: x.detach().clone() if isinstance(x, Tensor) else x  # noqa: E731
        self.args, self.kwargs = tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()}
        self._handle.remove()


def captured_mib(model: nn.Module, args: tuple, kwargs: dict) -> float:
    """What `capture_attention(model)` would hold for ``model(*args, **kwargs)``, in MiB: the fp32 weights
    (B, H, Lq, Lk) of every attention call. One forward pass without capture (long inputs take the chunked path)
    reads the calls' sizes."""
    elements = []

    def count(module: nn.Module, call_args: tuple, call_kwargs: dict) -> None:
        query = call_args[0] if call_args else call_kwargs["query"]
        key = call_args[1] if len(call_args) > 1 else call_kwargs.get("key")
        key = query if key is None else key
        elements.append(query.shape[0] * module.num_heads * query.shape[1] * key.shape[1])

    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    handles = [m.register_forward_pre_hook(count, with_kwargs=True) for m in layers]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return sum(elements) * 4 / 2**20


def first_sample(value: Any) -> Any:
    """The first sample of a model's inputs: tensors and per-sample lists cut to one row, in tuples and mappings."""
    if isinstance(value, Tensor):
        return value[:1] if value.dim() else value
    if isinstance(value, tuple):
        return tuple(first_sample(v) for v in value)
    if isinstance(value, dict):
        return {k: first_sample(v) for k, v in value.items()}
    return value[:1] if isinstance(value, list) else value


def figure_inputs(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | str:
    """The inputs ``attention.png`` is drawn from: the fixed batch's first sample, whose whole weights it captures;
    why not, where they would pass `CAPTURE_MIB` (a long-context model: the statistics hold row blocks instead)."""
    inputs = first_sample(args), first_sample(kwargs)
    was_training = model.training
    model.eval()
    try:
        size = captured_mib(model, *inputs)
    finally:
        model.train(was_training)
    if size <= CAPTURE_MIB:
        return inputs
    return (
        f"attention.png left out: the attention weights of the fixed batch's first sample would take {size:,.0f} MiB, "
        f"more than the {CAPTURE_MIB:,.0f} MiB it may hold (experiments.callbacks.attention_stats.CAPTURE_MIB)"
    )


def modality(model: nn.Module) -> str:
    if hasattr(model, "patch_embed"):
        return "vision"
    if hasattr(model, "backbone") and hasattr(model, "transformer"):
        return "detection"
    return "text"


@contextmanager
def feature_sizes(model: nn.Module) -> Iterator[list[tuple[int, int]]]:
    """The (h, w) of DETR's backbone feature map at each forward pass inside (none for other models)."""
    sizes: list[tuple[int, int]] = []
    handle = None
    if modality(model) == "detection":
        handle = model.backbone.register_forward_hook(lambda m, a, out: sizes.append(tuple(out.shape[-2:])))
    try:
        yield sizes
    finally:
        if handle is not None:
            handle.remove()


def _grid(h: int, w: int, stride_h: float, stride_w: float) -> Tensor:
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([(rows.flatten() + 0.5) * stride_h, (cols.flatten() + 0.5) * stride_w], -1).float()  # (h·w, 2)


def _text(tokens: Tensor, special_ids: tuple[int, ...]) -> Sequence:
    """Token ids (B, L) -> positions 0 .. L-1 and the special tokens."""
    special = torch.isin(tokens, torch.tensor(special_ids, dtype=tokens.dtype, device=tokens.device))
    return Sequence(torch.arange(tokens.shape[1], dtype=torch.float32)[:, None], special.cpu())


def _sequences(
    kind: str, model: nn.Module, args: tuple, feature_hw: tuple[int, int] | None, special_ids: tuple[int, ...]
) -> tuple[Sequence, Sequence | None]:
    """(encoder-side sequence, decoder-side sequence or None) of the fixed batch."""
    if kind == "vision":
        images = args[0]  # (B, C, H, W)
        g = model.patch_embed.grid_size  # a conv stem's patches are cut from its feature map: the stride is H / g
        cells = _grid(g, g, images.shape[-2] / g, images.shape[-1] / g)
        prefix = getattr(model, "num_prefix_tokens", 1)
        positions = torch.cat([torch.full((prefix, 2), float("nan")), cells])  # [CLS] first, no place
        special = (torch.arange(len(positions)) < prefix).expand(images.shape[0], -1)  # (B, L)
        return Sequence(positions, special), None
    if kind == "detection":
        images = args[0]
        h, w = feature_hw
        return Sequence(_grid(h, w, images.shape[-2] / h, images.shape[-1] / w), None), Sequence(None, None)
    decoder_side = len(args) > 1 and isinstance(args[1], Tensor)  # encoder-decoder: (src, tgt)
    return _text(args[0], special_ids), _text(args[1], special_ids) if decoder_side else None


def _decoder_self(name: str) -> bool:
    return not name.endswith("multihead_attn") and "decoder" in name.split(".")


def _valid_queries(name: str, scores: AttentionScores, dec_valid: Tensor | None) -> Tensor:
    """The queries that count (B, rows) of a block of a call: a self-attention's where its own key is not blocked (a
    padded position is blocked as a key, also to itself, which no other mask blocks: the diagonal), a
    cross-attention's where those of its decoder's self-attention (``dec_valid`` (B, Lq)) are."""
    b, _, rows, lk = scores.weights.shape
    every = torch.ones(b, rows, dtype=torch.bool, device=scores.weights.device)
    if name.endswith("multihead_attn"):
        if dec_valid is not None and dec_valid.shape == (b, scores.lq):
            return dec_valid[:, scores.start : scores.start + rows]
        return every
    if scores.blocked is None:
        return every
    own = scores.blocked.expand(b, -1, rows, lk)[:, 0, :, scores.start : scores.start + rows]  # (B, rows, rows)
    return ~own.diagonal(dim1=-2, dim2=-1)


def _layer_sides(
    name: str, lq: int, lk: int, enc: Sequence, dec: Sequence | None
) -> tuple[Sequence | None, Sequence | None]:
    """(query side, key side) of the layer ``name`` over lq queries and lk keys; None for a side whose positions have
    another length (a layout this module does not know: no distance rather than a wrong one)."""
    if name.endswith("multihead_attn"):
        q_seq, k_seq = dec, enc
    else:
        q_seq = k_seq = dec if "decoder" in name.split(".") and dec is not None else enc
    if q_seq is not None and q_seq.positions is not None and len(q_seq.positions) != lq:
        q_seq = None
    if k_seq is not None and k_seq.positions is not None and len(k_seq.positions) != lk:
        k_seq = None
    return q_seq, k_seq


def _row_sums(
    scores: AttentionScores,
    valid_q: Tensor,
    q_seq: Sequence | None,
    k_seq: Sequence | None,
    registers: slice | None = None,
) -> dict[str, Tensor | None]:
    """Per head (H,), the sums over the counted query rows of a block (or a whole call) of each per-row statistic, and
    the counts: ``rows`` (valid, with a key to see) and ``placed`` (those with a distance). valid_q (B, rows); None
    where a statistic is not defined."""
    p, start = scores.weights.float(), scores.start  # (B, H, rows, Lk)
    b, h, n_rows, lk = p.shape
    blocked = scores.blocked
    blocked = torch.zeros(1, 1, n_rows, lk, dtype=torch.bool, device=p.device) if blocked is None else blocked
    allowed = ~blocked.expand_as(p)
    rows = valid_q[:, None, :].expand(b, h, n_rows) & allowed.any(-1)  # (B, H, rows)

    def total(x: Tensor) -> Tensor:  # (B, H, rows) -> (H,), over the counted rows
        return (x * rows).sum((0, 2))

    top = p.max(-1).values
    k = allowed.sum(-1).clamp(min=1)
    x = scores.logits.float().masked_fill(~allowed, 0.0)
    mu = x.sum(-1, keepdim=True) / k[..., None]
    var = ((x - mu).masked_fill(~allowed, 0.0) ** 2).sum(-1) / k
    sums = {
        "rows": rows.sum((0, 2)),
        "entropy": total(-(p * p.clamp_min(1e-30).log()).sum(-1)),
        "max_weight": total(top),
        "saturated": total((top > SATURATION).float()),
        "logit_var": total(var),
        "distance": None,
        "placed": None,
        "special": None,
    }
    if q_seq is not None and k_seq is not None and q_seq.positions is not None and k_seq.positions is not None:
        q_pos = q_seq.positions[start : start + n_rows]  # (rows, C)
        d = torch.cdist(q_pos, k_seq.positions).to(p.device)  # (rows, Lk), NaN where a side has no place
        mass = (p * ~d.isnan()).sum(-1)
        dist = (p * d.nan_to_num(0.0)).sum(-1) / mass.clamp_min(1e-12)
        keep = rows & ~q_pos.isnan().any(-1).to(p.device) & (mass > 0)
        sums["distance"], sums["placed"] = (dist * keep).sum((0, 2)), keep.sum((0, 2))
    if k_seq is not None and k_seq.special is not None:
        sums["special"] = total((p * k_seq.special.to(p.device)[:, None, None, :]).sum(-1))
    return sums | sinks.sink_sums(p, rows, registers)


def _means(sums: dict[str, Tensor | None]) -> dict[str, Any]:
    """The statistics of a layer (one value per head; sink_heads one) from its `_row_sums` added up over its blocks."""
    n = sums["rows"].clamp(min=1)
    out = {key: (sums[key] / n).tolist() for key in ("entropy", "max_weight", "saturated", "logit_var")}
    out["distance"] = None if sums["distance"] is None else (sums["distance"] / sums["placed"].clamp(min=1)).tolist()
    out["special"] = None if sums["special"] is None else (sums["special"] / n).tolist()
    return out | sinks.sink_means(sums, sums["rows"])


class LayerSums:
    """The `_row_sums` of every layer's first call, added up from the blocks ``capture_attention(consume=self)`` hands
    over as the layers make them (a block is freed once added), and each layer's valid queries (B, Lq).
    ``sequences()``: (encoder side, decoder side) of the batch, asked at the first block (DETR's feature map is known
    by then); ``registers``: `sinks.register_keys`. `close` ends the last call."""

    def __init__(self, sequences: Callable[[], tuple[Sequence, Sequence | None]], registers: dict[str, slice]):
        self.sums: dict[str, dict[str, Tensor | None]] = {}
        self.valid: dict[str, Tensor] = {}
        self._sequences, self._registers = sequences, registers
        self._open: str | None = None  # the layer whose call the blocks come from
        self._pieces: list[Tensor] = []  # its valid queries so far, (B, rows) per block
        self._dec_valid: Tensor | None = None  # the last decoder self-attention's, for its cross-attention

    def __call__(self, name: str, scores: AttentionScores) -> None:
        if name != self._open or scores.start == 0:
            self.close()
            if name in self.valid:  # a later call of a layer
                return
            self._open = name
        valid_q = _valid_queries(name, scores, self._dec_valid)
        self._pieces.append(valid_q)
        sides = _layer_sides(name, scores.lq, scores.weights.shape[-1], *self._sequences())
        block = _row_sums(scores, valid_q, *sides, self._registers.get(name))
        so_far = self.sums.get(name)
        self.sums[name] = (
            block if so_far is None else {k: None if v is None else v + block[k] for k, v in so_far.items()}
        )

    def close(self) -> None:
        """End the open call: its valid queries (B, Lq) are kept."""
        if self._open is None:
            return
        self.valid[self._open] = torch.cat(self._pieces, 1)
        if _decoder_self(self._open):
            self._dec_valid = self.valid[self._open]
        self._open, self._pieces = None, []


def layer_calls(maps: dict[str, list[AttentionScores]]) -> Iterator[tuple[str, AttentionScores, Tensor, Tensor]]:
    """(name, scores of the first call, blocked (B|1, H|1, Lq, Lk), valid queries (B, Lq)) of each layer that ran, in
    module order (``capture_attention``'s whole calls; `_valid_queries`)."""
    dec_valid = None
    for name, calls in maps.items():
        if not calls:
            continue
        scores = calls[0]  # the first call: one forward pass
        lq, lk = scores.logits.shape[-2:]
        blocked = scores.blocked
        blocked = (
            torch.zeros(1, 1, lq, lk, dtype=torch.bool, device=scores.logits.device) if blocked is None else blocked
        )
        valid_q = _valid_queries(name, scores, dec_valid)
        if _decoder_self(name):
            dec_valid = valid_q
        yield name, scores, blocked, valid_q


@torch.no_grad()
def attention_statistics(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    special_ids: tuple[int, ...] = (),
    block_mib: float = BLOCK_MIB,
) -> dict[str, Any]:
    """Run ``model(*args, **kwargs)`` once in eval mode and measure its attention: ``{"modality", "unit",
    "batch_size", "layers": [{"name", "kind": "self"|"cross", "heads", and each statistic of the module docstring
    as one value per head (sink_heads, out_max, out_kurtosis: one per layer), or None where not defined}, ...],
    "summary": `experiments.callbacks.sinks.model_summary`}``, layers in module order. A call whose fp32 scores pass
    ``block_mib`` is measured in row blocks of at most ``block_mib`` (module docstring)."""
    kind = modality(model)
    heads = {name: m.num_heads for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    was_training = model.training
    model.eval()
    try:
        with feature_sizes(model) as feature_hw, sinks.attention_outputs(model) as outputs:
            sequences = cache(lambda: _sequences(kind, model, args, feature_hw[0] if feature_hw else None, special_ids))
            sums = LayerSums(sequences, sinks.register_keys(model))
            with capture_attention(model, scores=True, block_mib=block_mib, consume=sums):
                model(*args, **(kwargs or {}))
            sums.close()
    finally:
        model.train(was_training)
    stats = []
    for name in (name for name in heads if name in sums.sums):
        kind_of = "cross" if name.endswith("multihead_attn") else "self"
        layer = {"name": name, "kind": kind_of, "heads": heads[name], **_means(sums.sums[name])}
        layer.update(sinks.output_outliers(outputs[name], sums.valid[name]))
        stats.append(layer)
    return {
        "modality": kind,
        "unit": "tokens" if kind == "text" else "pixels",
        "batch_size": int(args[0].shape[0]) if args and isinstance(args[0], Tensor) else None,
        "layers": stats,
        "summary": sinks.model_summary(stats),
    }
