"""What the callbacks share: a batch's size, and which of two callbacks of one class acts."""

from __future__ import annotations

import itertools
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback


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
