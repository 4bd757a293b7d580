"""What the callbacks share: a batch's size, which of two callbacks of one class acts, the attention scores of a
training step, and the refusal of a callback that reads attention weights on a model that gives none."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from models.core.attention import AttentionScores
from models.core.capture import capture_attention, kernel_without_weights


def batch_size(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (images, token ids, dataset indices); 0 without one."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 0
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(batch_size, values) if n), 0)


def shadowed(trainer: pl.Trainer, callback: Callback) -> bool:
    """True when an earlier callback of the same class exists: a default-on callback yields to one a config lists."""
    earlier = itertools.takewhile(lambda other: other is not callback, trainer.callbacks)
    return any(type(other) is type(callback) for other in earlier)


def needs_weights(pl_module: pl.LightningModule, callback: Callback) -> None:
    """At setup: one line refusing ``callback``, which reads attention weights, on a model whose kernel of one's own
    (``attention.kernel``) returns none."""
    if why := kernel_without_weights(pl_module):
        raise ValueError(f"trainer.callbacks: {type(callback).__name__} reads attention weights; {why}")


# pl_module -> [the open capture, its maps, how many callbacks hold it]
_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def open_scores(pl_module: pl.LightningModule) -> dict[str, list[AttentionScores]]:
    """``capture_attention(pl_module, scores=True)``, opened once for every callback that asks during a step: a layer
    records into one capture at a time, so a second capture opened beside the first would leave the first empty."""
    entry = _SCORES.get(pl_module)
    if entry is None:
        stack = contextlib.ExitStack()
        entry = _SCORES[pl_module] = [stack, stack.enter_context(capture_attention(pl_module, scores=True)), 0]
    entry[2] += 1
    return entry[1]


def close_scores(pl_module: pl.LightningModule) -> None:
    """Give back what `open_scores` gave; the capture closes when its last holder gives it back."""
    entry = _SCORES.get(pl_module)
    if entry is not None:
        entry[2] -= 1
        if entry[2] <= 0:
            entry[0].close()
            del _SCORES[pl_module]
