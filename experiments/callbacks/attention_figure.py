"""``attention.png``: each attention layer's head-mean weights on the first sample of the fixed batch, one heat map
per layer with its colour bar, the axes labelled with what the tokens are: the words for text (token indices
without a tokenizer), patches by (row, column) for the ViT, feature-map cells by (row, column) and object queries
for DETR."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure  # no pyplot: no global backend, nothing to close
from torch import Tensor, nn

from experiments.callbacks.attention_stats import modality

MAX_TICKS = 24  # labels per axis; a longer sequence shows every k-th token


@dataclass
class Side:
    """One side of the attention (the queries or the keys): what its tokens are, one label per token, and the
    tokens to label when not all fit (None: every k-th)."""

    name: str
    labels: list[str]
    ticks: list[int] | None = None


def _cells(name: str, rows: int, cols: int, prefix: int = 0) -> Side:
    """A grid's tokens, flattened row-major after ``prefix`` class tokens: labelled "row,column", the first cell of
    each row when not all fit."""
    labels = ["cls"] * prefix + [f"{r},{c}" for r in range(rows) for c in range(cols)]
    return Side(name, labels, [prefix + r * cols for r in range(rows)])


def _words(ids: Tensor, tokenizer: Any) -> list[str]:
    """Token ids (L,) -> each token's text by ``tokenizer`` (a `tokenizers.Tokenizer` or the pretrained side that
    answers like one), or its id without one; a token of white space shows as ␣."""
    ids = ids.tolist()
    if tokenizer is None:
        return [str(i) for i in ids]
    return [w.strip() or "␣" for w in tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)]


def token_sides(
    model: nn.Module, args: tuple, feature_hw: tuple[int, int] | None, data: Any
) -> tuple[Side | None, Side | None]:
    """(encoder side, decoder side or None) of the first sample of ``args``, the model's inputs (`experiments.callbacks.attention_stats`):
    ViT ``(images,)``, DETR ``(images, mask)`` with ``feature_hw`` its backbone's (h, w), translation ``(src, tgt)``
    with ``data.tokenizers`` (source, target), language model ``(tokens,)`` with ``data.tokenizer``."""
    kind = modality(model)
    if kind == "vision":
        g, prefix = model.patch_embed.grid_size, getattr(model, "num_prefix_tokens", 1)
        return _cells("cls, then patch (row, column)", g, g, prefix), None
    if kind == "detection":
        queries = Side("object query", [str(q) for q in range(model.num_queries)])
        cells = _cells("feature-map cell (row, column)", *feature_hw) if feature_hw else None
        return cells, queries
    if len(args) > 1 and isinstance(args[1], Tensor):  # encoder-decoder: (src, tgt)
        src_tok, tgt_tok = getattr(data, "tokenizers", (None, None))
        return Side("source token", _words(args[0][0], src_tok)), Side("target token", _words(args[1][0], tgt_tok))
    return Side("token", _words(args[0][0], getattr(data, "tokenizer", None))), None


def _sides(name: str, encoder: Side | None, decoder: Side | None) -> tuple[Side | None, Side | None]:
    """(query side, key side) of the layer ``name``: cross-attention reads the encoder from the decoder."""
    if name.endswith("multihead_attn"):
        return decoder, encoder
    side = decoder if decoder is not None and "decoder" in name.split(".") else encoder
    return side, side


def _label_axis(axis: Any, role: str, side: Side | None, length: int) -> None:
    """Ticks at whole tokens labelled by ``side``: all of them up to `MAX_TICKS`, else the side's chosen ones or
    every k-th (by index when its labels do not match the map's length: a layout not known here)."""
    if side is None or len(side.labels) != length:
        side = Side("token index", [str(i) for i in range(length)])
    ticks = list(range(length)) if length <= MAX_TICKS else side.ticks or list(range(length))
    ticks = ticks[:: math.ceil(len(ticks) / MAX_TICKS)]
    axis.set_ticks(ticks, [side.labels[i] for i in ticks], fontsize=6)
    axis.set_label_text(f"{role}: {side.name}", fontsize=7)


def attention_figure(maps: dict[str, Tensor], encoder: Side | None, decoder: Side | None = None) -> Figure:
    """One heat map per layer of ``maps`` (name -> head-mean weights (Lq, Lk)), four to a row, each with its colour
    bar from 0 to its largest weight; rows are queries, columns keys."""
    cols = min(4, len(maps)) or 1
    rows = max(1, -(-len(maps) // cols))
    fig = Figure(figsize=(3.8 * cols, 3.6 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (name, weights) in zip(axes.flat, maps.items()):
        queries, keys = _sides(name, encoder, decoder)
        image = ax.imshow(weights.float().numpy(), cmap="viridis", vmin=0, aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax, shrink=0.9).ax.tick_params(labelsize=6)
        ax.set_title(name, fontsize=7)
        _label_axis(ax.xaxis, "key", keys, weights.shape[1])
        _label_axis(ax.yaxis, "query", queries, weights.shape[0])
        ax.tick_params(axis="x", labelrotation=90)
    for ax in axes.flat[len(maps) :]:
        ax.axis("off")
    return fig
