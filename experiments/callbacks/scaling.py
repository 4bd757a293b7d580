"""`LearningRateScaling`: the learning rate follows the global batch size."""

from __future__ import annotations

from typing import Literal

import pytorch_lightning as pl
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import rank_zero_info


class LearningRateScaling(Callback):
    """Scale the configured learning rate(s) with the global batch size: ``data.batch_size`` is per device and ``lr``
    was tuned on one device, so each optimizer's learning rate (and its scheduler's base) is multiplied by
    ``k = devices × num_nodes × accumulate_grad_batches`` (``rule: linear``, Goyal et al. 2017), by √k (``sqrt``,
    usual for Adam) or left alone (``none``). A resumed run keeps the learning rates its checkpoint restored.
    """

    def __init__(self, rule: Literal["linear", "sqrt", "none"] = "linear"):
        if rule not in ("linear", "sqrt", "none"):
            raise ValueError(f"LearningRateScaling: rule={rule!r}; expected linear, sqrt or none")
        self.rule = rule

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        k = trainer.world_size * trainer.accumulate_grad_batches
        factor = {"linear": float(k), "sqrt": k**0.5, "none": 1.0}[self.rule]
        if factor == 1.0 or trainer.ckpt_path:
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
        for config in trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]
        rank_zero_info(f"attnlab: learning rate × {factor:g} ({self.rule} in {k} = devices × nodes × accumulation)")
