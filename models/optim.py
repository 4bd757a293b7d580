"""The one optimizer and learning-rate schedule builder that every LightningModule uses.

Parameter groups: weight decay applies to matrices only (nanoGPT, timm): biases, norms, and whatever the
model lists in ``no_weight_decay()`` (positions, class token, object queries) are not decayed. A trunk
(DETR's backbone) may train at its own learning rate, and a ViT may use layer-wise decay (BEiT).

Schedules are multipliers of each group's learning rate for ``torch.optim.lr_scheduler.LambdaLR``, stepped
once per optimizer step: linear warmup, then cosine decay, the inverse square root of Vaswani et al., or
DETR's step drop. Their length is the training horizon: the step or epoch limit that ends first. With
``trainer.max_time`` set, `experiments.callbacks.TimeBudget` re-estimates the horizon from the measured step
time while training runs, so a time-budgeted run warms up, decays fully and ends on time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

import pytorch_lightning as pl
import torch
from torch import nn

ScheduleName = Literal["cosine", "inverse_sqrt", "step"]


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


def adamw(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    trunk: nn.Module | None = None,
    lr_trunk: float | None = None,
    layer_decay: float | None = None,
) -> torch.optim.AdamW:
    """Fused AdamW over `param_groups`, with the ``trunk``'s parameters at ``lr_trunk`` (0 freezes them in effect),
    or with timm's layer-wise decay (block i of L at ``lr * layer_decay ** (L + 1 - i)``, the head at ``lr``)."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    if layer_decay is not None:
        from timm.optim import param_groups_layer_decay

        groups = param_groups_layer_decay(model, weight_decay, skip, layer_decay=layer_decay)
        for group in groups:  # LambdaLR scales each group's own lr; timm's schedulers would read lr_scale
            group["lr"] = lr * group.pop("lr_scale")
    else:
        groups = param_groups(model, weight_decay, skip)
    if trunk is not None:
        in_trunk = {id(p) for p in trunk.parameters()}
        groups = [
            {"params": params, "weight_decay": group["weight_decay"], "lr": group_lr}
            for group in groups
            for group_lr, params in (
                (lr, [p for p in group["params"] if id(p) not in in_trunk]),
                (lr if lr_trunk is None else lr_trunk, [p for p in group["params"] if id(p) in in_trunk]),
            )
            if params
        ]
    # fused: one kernel for the whole update (CPU and GPU), and it skips a step on the device when the
    # non-finite guard (experiments.callbacks.guards) raises ``found_inf``, without a wait for the device
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=True)


class Schedule:
    """The learning-rate multiplier of one step, for ``LambdaLR``.

    Its attributes are plain numbers, which ``LambdaLR.state_dict`` saves with the checkpoint, so a resumed
    run continues on the same schedule, the re-estimated horizon of a time budget included.

    Args:
        name: "cosine" (warmup, then cosine decay to ``min_ratio`` at ``total_steps``), "inverse_sqrt"
            (Vaswani et al. 2017: min(step^-0.5, step·warmup^-1.5)·warmup^0.5, peaking at 1) or "step"
            (warmup, then 1 until ``drop_fraction`` of the horizon, then ``gamma``).
        warmup_steps: linear warmup from 1/warmup_steps to 1.
        total_steps: the horizon; None while a time budget has not estimated it yet (no decay until then).
    """

    def __init__(
        self,
        name: ScheduleName,
        warmup_steps: int,
        total_steps: int | None,
        min_ratio: float = 0.0,
        drop_fraction: float = 1.0,
        gamma: float = 0.1,
    ):
        self.name, self.warmup_steps, self.total_steps = name, warmup_steps, total_steps
        self.min_ratio, self.drop_fraction, self.gamma = min_ratio, drop_fraction, gamma

    def __call__(self, step: int) -> float:
        if self.name == "inverse_sqrt":
            step, warmup = step + 1, max(1, self.warmup_steps)
            return min(step**-0.5, step * warmup**-1.5) * warmup**0.5
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        if self.name == "step":
            return self.gamma if step >= self.drop_fraction * self.total_steps else 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def steps_per_epoch(trainer: pl.Trainer) -> int | None:
    """Optimizer steps in one epoch (the train loader is set up if it is not yet); None for an endless loader."""
    if trainer.train_dataloader is None:
        trainer.fit_loop.setup_data()
    if math.isinf(trainer.num_training_batches):
        return None
    return max(1, math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches))


def horizon(trainer: pl.Trainer) -> int | None:
    """The optimizer steps of the step or epoch limit that ends first; None when neither is set (or only an
    epoch limit over an endless loader). Each limit is counted itself: the epoch-based settings (ViT's warmup,
    DETR's drop) need the epoch's length, not only Lightning's one ``estimated_stepping_batches``.
    """
    limits = []
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        limits.append(trainer.max_steps)
    per_epoch = steps_per_epoch(trainer) if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    if per_epoch is not None:
        limits.append(trainer.max_epochs * per_epoch)
    return min(limits) if limits else None


def schedule(
    optimizer: torch.optim.Optimizer,
    trainer: pl.Trainer,
    name: ScheduleName,
    warmup_steps: int = 0,
    warmup_epochs: float | None = None,
    min_ratio: float = 0.0,
    drop_epoch: float | None = None,
) -> dict:
    """Lightning's ``lr_scheduler`` entry: a per-step `Schedule` over the trainer's horizon.

    ``warmup_epochs`` (ViT) and ``drop_epoch`` (DETR's step drop) are converted with the loader's steps per
    epoch; the drop becomes a fraction of the horizon, so it moves with a time budget's estimate.
    """
    per_epoch = steps_per_epoch(trainer)
    for key, value in (("warmup_epochs", warmup_epochs), ("lr_drop_epoch", drop_epoch if name == "step" else None)):
        if value is not None and per_epoch is None:
            raise ValueError(
                f"model.{key}={value} counts epochs, but the training loader has no length (an endless one)"
            )
    if warmup_epochs is not None:
        warmup_steps = int(round(warmup_epochs * per_epoch))
    total = horizon(trainer)
    drop_fraction = 1.0
    if name == "step" and drop_epoch is not None and total:
        drop_fraction = min(1.0, drop_epoch * per_epoch / total)
    factor = Schedule(name, warmup_steps, total, min_ratio, drop_fraction)
    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}
