"""`capture_attention`: the attention weights of every `MultiHeadAttention` of any model, recorded without editing
the model, for the attention maps and statistics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from torch import Tensor, nn

from models.core.attention import AttentionScores, MultiHeadAttention, weightless


@contextmanager
def capture_attention(
    model: nn.Module,
    scores: bool = False,
    block_mib: float | None = None,
    consume: Callable[[str, AttentionScores], None] | None = None,
) -> Iterator[dict[str, list[Tensor]] | dict[str, list[AttentionScores]]]:
    """Record the attention weights of every `MultiHeadAttention` in ``model``, unedited.

    Inside the block every attention layer takes the reference path and appends its weights
    (B, H, Lq, Lk), detached, to the list under its module name, once per call::

        with capture_attention(vit) as maps:
            vit(images)
        maps["blocks.0.attn"][0]  # (B, H, 1 + N, 1 + N)

    With ``scores=True`` each call appends an `AttentionScores` instead: the weights together with
    the logits and the blocked mask, as the layer computed them (for the attention statistics).

    ``consume(name, scores)`` takes each record in place of the lists (which then stay empty), as the layers make them.
    With ``block_mib`` (scores only) a call under no_grad whose fp32 scores (B, H, Lq, Lk) pass ``block_mib`` MiB
    is recorded as a sequence of row blocks, each an `AttentionScores` of rows start .. start + rows whose scores fit
    ``block_mib``, computed and recorded one after the other (a row-wise normalisation's weights of a block are those
    of its rows in the whole call); with ``consume`` a block it does not keep is freed before the next is made, so
    the call never holds (B, H, Lq, Lk). The layer's output is the blocks' outputs, the same as the whole call's.
    """
    if why := kernel_without_weights(model):
        raise ValueError(why)
    if block_mib is not None and not scores:
        raise ValueError("capture_attention(block_mib=...) records scores in row blocks: pass scores=True")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    maps: dict[str, list] = {name: [] for name in layers}
    for name, m in layers.items():
        m._captured = maps[name].append if consume is None else partial(consume, name)
        m._capture_scores, m._capture_block_mib = scores, block_mib
    try:
        yield maps
    finally:
        for m in layers.values():
            m._captured, m._capture_scores, m._capture_block_mib = None, False, None


def kernel_without_weights(model: nn.Module) -> str | None:
    """Why `capture_attention` cannot record ``model``: one line naming a kernel of one's own (``attention.kernel``)
    that returns no weights; None when every layer can."""
    layers = (m for m in model.modules() if isinstance(m, MultiHeadAttention) and not m.kernel_gives_weights)
    layer = next(layers, None)
    return None if layer is None else weightless(layer.config.kernel)
