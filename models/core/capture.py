"""`capture_attention`: the attention weights of every `MultiHeadAttention` of any model, recorded without editing
the model, for the attention maps and statistics."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from models.core.attention import AttentionScores, MultiHeadAttention, weightless


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
    if why := kernel_without_weights(model):
        raise ValueError(why)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    maps: dict[str, list] = {name: [] for name in layers}
    for name, m in layers.items():
        m._captured, m._capture_scores = maps[name], scores
    try:
        yield maps
    finally:
        for m in layers.values():
            m._captured, m._capture_scores = None, False


def kernel_without_weights(model: nn.Module) -> str | None:
    """Why `capture_attention` cannot record ``model``: one line naming a kernel of one's own (``attention.kernel``)
    that returns no weights; None when every layer can."""
    layers = (m for m in model.modules() if isinstance(m, MultiHeadAttention) and not m.kernel_gives_weights)
    layer = next(layers, None)
    return None if layer is None else weightless(layer.config.kernel)
