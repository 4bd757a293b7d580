"""The training step's scalars, logged at Lightning's logging steps instead of at every step.

`LightningModule.log` costs about 0.75 ms of host time a call (Lightning moves its result entry to the
value's device at each call), a few percent of a small model's step. `log_training_step` gives the same
logs for a fraction of that: each scalar goes into a running batch-size-weighted sum on its device, and
`LightningModule.log` is called only at the steps whose metrics Lightning writes (every
``trainer.log_every_n_steps``, or when the trainer is to stop) and at the first step of each epoch. The
loggers get what ``self.log(name, value, on_step=on_step, on_epoch=True, batch_size=batch_size)`` at every
step gives them: ``<name>_step``, the step's value, at each logging step, and ``<name>_epoch`` (``<name>``
for an epoch-only value), the batch-size-weighted mean over every step of the epoch, per process (as
``sync_dist=False``). Nothing is read from the device between logging steps.

Between logging steps the callback metrics and the progress bar hold the last logged step value, not the
latest; a stop decided after ``training_step`` (``trainer.max_time``) writes that value as its step's.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import Tensor
from torchmetrics import Metric


class RunningMean(Metric):
    """A scalar's batch-size-weighted mean over the updates since the last reset; ``forward`` also returns the
    value it was given (Lightning logs that as the step's value)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__(sync_on_compute=False)  # per process, as `self.log(..., sync_dist=False)` logs it
        self.add_state("total", torch.zeros(()), dist_reduce_fx="sum")  # float32, as Lightning's own sum
        self.add_state("weight", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: int) -> None:
        self.total.add_(value.detach().float() * weight)  # Lightning's own arithmetic: the same epoch means
        self.weight.add_(weight)

    def forward(self, value: Tensor, weight: int) -> Tensor:
        """Add the step's value and return it as it is: Lightning logs a metric's ``_forward_cache`` as the step's
        value (torchmetrics' own forward would return total / weight of this step, rounded twice)."""
        self.update(value, weight)
        self._forward_cache = value.detach().float()
        return self._forward_cache

    def compute(self) -> Tensor:
        return self.total / self.weight


class TrainingLog:
    """The running means of one LightningModule's training scalars, and the values of the latest step."""

    def __init__(self) -> None:
        self.means: dict[str, RunningMean] = {}
        self.registered: dict[str, tuple[int, int]] = {}  # name -> (trainer, epoch) it was last handed to Lightning
        self.terms: dict[str, Tensor] = {}  # the values given during `batch`
        self.batch: tuple[int, int] | None = None  # (trainer, batch number)

    def add(
        self, module: pl.LightningModule, values: dict[str, Tensor], batch_size: int, on_step: bool, prog_bar: bool
    ) -> None:
        trainer = module.trainer
        batch = (id(trainer), _batch_number(trainer))
        if batch != self.batch:
            self.batch, self.terms = batch, {}
        self.terms.update(values)
        logging = on_step and trainer._logger_connector.should_update_logs  # Lightning writes this step's metrics
        epoch = (id(trainer), trainer.current_epoch)
        for name, value in values.items():
            mean = self.means.get(name)
            if mean is None:
                mean = self.means[name] = RunningMean().to(value.device)
            first = self.registered.get(name) != epoch  # Lightning resets what it was handed at each epoch's end
            if not (logging or first):
                mean.update(value, batch_size)
                continue
            mean(value, batch_size)
            # the progress bar reads its step values back from the device at every step: only when there is one
            bar = prog_bar and (not on_step or trainer.progress_bar_callback is not None)
            module.log(name, mean, on_step=on_step, on_epoch=True, prog_bar=bar, metric_attribute=name)
            self.registered[name] = epoch


def log_training_step(
    module: pl.LightningModule,
    values: dict[str, Tensor],
    batch_size: int,
    on_step: bool = True,
    prog_bar: bool = True,
) -> None:
    """From ``training_step``: log each scalar (0-dim tensor) as ``module.log(name, value, on_step=on_step,
    on_epoch=True, prog_bar=prog_bar, batch_size=batch_size)`` would, at a fraction of the cost (see the
    module's docstring). Step values go on the progress bar only when there is one."""
    log = module.__dict__.get("_training_log")
    if log is None:
        log = module._training_log = TrainingLog()
    log.add(module, values, batch_size, on_step, prog_bar)


def step_terms(module: pl.LightningModule) -> dict[str, Tensor]:
    """The scalars `log_training_step` was given during the current training batch (none: empty)."""
    log = module.__dict__.get("_training_log")
    if log is None or log.batch != (id(module.trainer), _batch_number(module.trainer)):
        return {}
    return log.terms


def _batch_number(trainer: pl.Trainer) -> int:
    """The training batches started in this fit: one number per batch."""
    return trainer.fit_loop.epoch_loop.batch_progress.total.ready
