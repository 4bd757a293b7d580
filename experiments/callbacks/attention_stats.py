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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from experiments.callbacks import sinks
from models.core.attention import AttentionScores, MultiHeadAttention
from models.core.capture import capture_attention

SATURATION = 0.9  # a query whose largest weight exceeds this attends, in effect, to one key
# what capture_attention may hold for the statistics: every layer's fp32 weights and logits and its mask
CAPTURE_MIB = 1024.0


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
    """What `capture_attention(scores=True)` would hold for ``model(*args, **kwargs)``, in MiB: weights and logits
    (fp32) and a boolean mask of (B, H, Lq, Lk) per attention call. One forward pass without capture (long inputs take
    the chunked path) reads the calls' sizes."""
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
    return sum(elements) * 9 / 2**20


def first_sample(value: Any) -> Any:
    """The first sample of a model's inputs: tensors and per-sample lists cut to one row, in tuples and mappings."""
    if isinstance(value, Tensor):
        return value[:1] if value.dim() else value
    if isinstance(value, tuple):
        return tuple(first_sample(v) for v in value)
    if isinstance(value, dict):
        return {k: first_sample(v) for k, v in value.items()}
    return value[:1] if isinstance(value, list) else value


def measurable(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | str:
    """The inputs the statistics are measured on: the fixed batch, or its first sample where the batch's weights would
    pass `CAPTURE_MIB`; why neither is, where the first sample's would too (a long-context model: its layers run
    chunked, and capturing the whole weights is what they avoid)."""
    was_training = model.training
    model.eval()
    try:
        for inputs in ((args, kwargs), (first_sample(args), first_sample(kwargs))):
            if (size := captured_mib(model, *inputs)) <= CAPTURE_MIB:
                return inputs
    finally:
        model.train(was_training)
    return (
        f"the attention weights of the fixed batch's first sample would take {size:,.0f} MiB, more than the "
        f"{CAPTURE_MIB:,.0f} MiB the statistics may hold (experiments.callbacks.attention_stats.CAPTURE_MIB)"
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


def _layer_stats(
    weights: Tensor, logits: Tensor, blocked: Tensor, valid_q: Tensor, q_seq: Sequence | None, k_seq: Sequence | None
) -> dict[str, list[float] | None]:
    """Per-head statistics of one layer. weights/logits (B, H, Lq, Lk); blocked broadcastable to them; valid_q (B, Lq)."""
    allowed = ~blocked.expand_as(weights)
    rows = valid_q[:, None, :].expand(weights.shape[:3]) & allowed.any(-1)  # (B, H, Lq)
    n = rows.sum((0, 2)).clamp(min=1)  # (H,)

    def mean(x: Tensor) -> list[float]:  # (B, H, Lq) -> per head, over counted rows
        return ((x * rows).sum((0, 2)) / n).tolist()

    p = weights.float()
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    top = p.max(-1).values
    k = allowed.sum(-1).clamp(min=1)
    x = logits.float().masked_fill(~allowed, 0.0)
    mu = x.sum(-1, keepdim=True) / k[..., None]
    var = ((x - mu).masked_fill(~allowed, 0.0) ** 2).sum(-1) / k
    out = {
        "entropy": mean(entropy),
        "max_weight": mean(top),
        "saturated": mean((top > SATURATION).float()),
        "logit_var": mean(var),
        "distance": None,
        "special": None,
    }
    if q_seq is not None and k_seq is not None and q_seq.positions is not None and k_seq.positions is not None:
        d = torch.cdist(q_seq.positions, k_seq.positions).to(p.device)  # (Lq, Lk), NaN where a side has no place
        placed = ~d.isnan()
        mass = (p * placed).sum(-1)
        dist = (p * d.nan_to_num(0.0)).sum(-1) / mass.clamp_min(1e-12)
        q_placed = ~q_seq.positions.isnan().any(-1).to(p.device)  # (Lq,)
        keep = rows & q_placed & (mass > 0)
        out["distance"] = ((dist * keep).sum((0, 2)) / keep.sum((0, 2)).clamp(min=1)).tolist()
    if k_seq is not None and k_seq.special is not None:
        out["special"] = mean((p * k_seq.special.to(p.device)[:, None, None, :]).sum(-1))
    return out


def layer_calls(maps: dict[str, list[AttentionScores]]) -> Iterator[tuple[str, AttentionScores, Tensor, Tensor]]:
    """(name, scores of the first call, blocked (B|1, H|1, Lq, Lk), valid queries (B, Lq)) of each layer that ran, in
    module order (``capture_attention``'s): a self-attention's queries are valid where its own key is not blocked,
    a cross-attention's where those of its decoder's self-attention are."""
    dec_valid = None
    for name, calls in maps.items():
        if not calls:
            continue
        scores = calls[0]  # the first call: one forward pass
        b, _, lq, lk = scores.logits.shape
        device = scores.logits.device
        blocked = (
            scores.blocked if scores.blocked is not None else torch.zeros(1, 1, lq, lk, dtype=torch.bool, device=device)
        )
        if name.endswith("multihead_attn"):
            valid_q = dec_valid if dec_valid is not None and dec_valid.shape == (b, lq) else None
            valid_q = torch.ones(b, lq, dtype=torch.bool, device=device) if valid_q is None else valid_q
        else:
            # a padded position is blocked as a key, also to itself, which no other mask blocks: the diagonal
            valid_q = ~blocked.expand(b, -1, lq, lk).diagonal(dim1=-2, dim2=-1)[:, 0]  # (B, Lq)
            if "decoder" in name.split("."):
                dec_valid = valid_q
        yield name, scores, blocked, valid_q


@torch.no_grad()
def attention_statistics(
    model: nn.Module, args: tuple, kwargs: dict | None = None, special_ids: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Run ``model(*args, **kwargs)`` once in eval mode and measure its attention: ``{"modality", "unit",
    "batch_size", "layers": [{"name", "kind": "self"|"cross", "heads", and each statistic of the module docstring
    as one value per head (sink_heads, out_max, out_kurtosis: one per layer), or None where not defined}, ...],
    "summary": `experiments.callbacks.sinks.model_summary`}``, layers in module order."""
    kind = modality(model)
    heads = {name: m.num_heads for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    registers = sinks.register_keys(model)
    was_training = model.training
    model.eval()
    try:
        with (
            capture_attention(model, scores=True) as maps,
            feature_sizes(model) as feature_hw,
            sinks.attention_outputs(model) as outputs,
        ):
            model(*args, **(kwargs or {}))
    finally:
        model.train(was_training)
    enc, dec = _sequences(kind, model, args, feature_hw[0] if feature_hw else None, special_ids)
    stats = []
    for name, scores, blocked, valid_q in layer_calls(maps):
        lq, lk = scores.logits.shape[-2:]
        cross = name.endswith("multihead_attn")
        if cross:
            q_seq, k_seq = dec, enc
        else:
            q_seq = k_seq = dec if "decoder" in name.split(".") and dec is not None else enc
        if q_seq is not None and q_seq.positions is not None and len(q_seq.positions) != lq:
            q_seq = None  # a layout this function does not know: no distance rather than a wrong one
        if k_seq is not None and k_seq.positions is not None and len(k_seq.positions) != lk:
            k_seq = None
        layer = {"name": name, "kind": "cross" if cross else "self", "heads": heads[name]}
        layer.update(_layer_stats(scores.weights, scores.logits, blocked, valid_q, q_seq, k_seq))
        layer.update(sinks.sink_stats(scores.weights, blocked, valid_q, registers.get(name)))
        layer.update(sinks.output_outliers(outputs[name], valid_q))
        stats.append(layer)
    return {
        "modality": kind,
        "unit": "tokens" if kind == "text" else "pixels",
        "batch_size": int(args[0].shape[0]) if args and isinstance(args[0], Tensor) else None,
        "layers": stats,
        "summary": sinks.model_summary(stats),
    }
