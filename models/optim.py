"""Parameter groups and learning-rate schedules shared by every LightningModule.

Weight decay applies to matrices only (nanoGPT, timm): biases, norms, and whatever the model
lists in ``no_weight_decay()`` (positions, class token, object queries) are not decayed.
Schedules are multipliers of the base learning rate for ``torch.optim.lr_scheduler.LambdaLR``,
stepped once per optimizer step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from torch import nn


def param_groups(model: nn.Module, weight_decay: float, no_weight_decay: Iterable[str] = ()) -> list[dict]:
    """Two AdamW groups: decayed matrices, and everything else (ndim < 2 or named in ``no_weight_decay``).

    A name in ``no_weight_decay`` matches a parameter whose name equals it or ends with ``.name``.
    """
    skip = tuple(no_weight_decay)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = p.ndim < 2 or any(name == s or name.endswith("." + s) for s in skip)
        (no_decay if exempt else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def inverse_sqrt(warmup_steps: int) -> Callable[[int], float]:
    """The schedule of Vaswani et al. (2017) as a multiplier that peaks at 1 after ``warmup_steps``:
    lr = base_lr · min(step^-0.5, step · warmup^-1.5) · warmup^0.5."""

    def factor(step: int) -> float:
        step = step + 1
        return min(step ** -0.5, step * warmup_steps ** -1.5) * warmup_steps ** 0.5

    return factor
