"""The learning-rate schedule's callbacks: its time budget, and its log."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.callbacks import LearningRateMonitor, Timer

from models.optim import Schedule, horizon


class TimeBudget(pl.Callback):
    """With ``trainer.max_time`` set, the learning-rate schedule ends when the time does.

    Sets the horizon of every `models.optim.Schedule` to the step at which the budget runs out at rank 0's
    measured time per optimizer step (validation and logging included), or to the step/epoch limit if that comes
    first; after ``probe_steps``, then every ``every_n_steps``. The horizon is in the scheduler's state and
    Lightning's Timer restores the elapsed time, so a resumed run keeps its budget and its place in the schedule.
    """

    def __init__(self, probe_steps: int = 20, every_n_steps: int = 50):
        self.probe_steps, self.every_n_steps = probe_steps, every_n_steps

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step < self.probe_steps or (step - self.probe_steps) % self.every_n_steps:
            return
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer) and c.time_remaining() is not None), None)
        if timer is None:
            return
        elapsed, remaining = timer.time_elapsed("train"), timer.time_remaining("train")
        estimate = trainer.strategy.broadcast(step + int(max(0.0, remaining) * step / max(elapsed, 1e-9)), src=0)
        limit = horizon(trainer)
        total = estimate if limit is None else min(limit, estimate)
        # at the probe, refuse a budget that ends inside the warmup (a step limit there is the user's choice)
        check_warmup = step == self.probe_steps and (limit is None or estimate < limit)
        lambdas = [f for config in trainer.lr_scheduler_configs for f in getattr(config.scheduler, "lr_lambdas", [])]
        for schedule in filter(lambda f: isinstance(f, Schedule), lambdas):
            if check_warmup and schedule.name != "inverse_sqrt" and schedule.warmup_steps >= total:
                raise ValueError(
                    f"trainer.max_time ({elapsed + remaining:.0f} s) ends before the learning-rate warmup: {schedule.warmup_steps} "
                    f"steps need about {schedule.warmup_steps * elapsed / step:.0f} s at the measured "
                    f"{elapsed / step:.3f} s/step; shorten the model's warmup or lengthen trainer.max_time"
                )
            schedule.total_steps = total


class LearningRateLog(LearningRateMonitor):
    """Lightning's ``LearningRateMonitor`` (``lr-AdamW``, ``lr-AdamW/pg2``, ... in metrics.csv and W&B), silent in a
    run without a logger instead of stopping it."""

    def on_train_start(self, trainer: pl.Trainer, *args, **kwargs) -> None:
        self.enabled = bool(trainer.loggers)
        if self.enabled:
            super().on_train_start(trainer, *args, **kwargs)

    def on_train_batch_start(self, trainer: pl.Trainer, *args, **kwargs) -> None:
        if self.enabled:
            super().on_train_batch_start(trainer, *args, **kwargs)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args, **kwargs) -> None:
        if self.enabled:
            super().on_train_epoch_start(trainer, *args, **kwargs)
