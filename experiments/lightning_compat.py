"""The few Lightning internals attnlab uses, each where no public API gives a guarantee the README promises; every
other module uses the public API only. Each function names the missing public route; tests/test_lightning_compat.py
fails naming the internal when an installed Lightning changes it.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import RunningStage
from pytorch_lightning.utilities.data import _update_dataloader
from torch import Tensor
from torch.utils.data import DataLoader, Sampler


def stop_as_on_sigterm(trainer: pl.Trainer) -> None:
    """Make Lightning raise ``SIGTERMException`` on this process once the current batch (or the validation under
    way) is done; `LastCheckpoint` calls it on every process at the same batch.

    Missing public route: ``Trainer.received_sigterm`` is read-only, and ``trainer.should_stop`` waits for
    ``min_steps``/``min_epochs`` and ends the fit normally (no ``on_exception``, so no SIGTERM save and status)."""
    trainer._signal_connector.received_sigterm = True


def with_sampler(loader: DataLoader, sampler: Sampler) -> DataLoader:
    """The training ``loader`` rebuilt around ``sampler`` as Lightning rebuilds loaders for a DistributedSampler,
    keeping every argument of the loader's class, subclasses included.

    Missing public route: Lightning re-instantiates loaders only with its own samplers, not with a callback's."""
    return _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)


def batch_ends_optimizer_step(trainer: pl.Trainer) -> bool:
    """Whether the training batch under way ends an optimizer step (the epoch's last batch included), so that DDP
    processes agree on a non-finite loss before that step's gradient all-reduce.

    Missing public route: hooks get ``batch_idx`` but not whether the batch is the epoch's last when the loader's
    length is unknown."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


def logged_step_values(trainer: pl.Trainer) -> dict[str, Tensor]:
    """The scalars ``training_step`` logged with ``self.log`` at the batch under way (on the device), so that a
    non-finite loss is named by its terms before backward (DETR's ``train/loss_ce`` ...).

    Missing public route: ``trainer.callback_metrics`` is filled only after the optimizer stepped. Read
    defensively: without it the error names the loss alone."""
    terms = {}
    for metric in (getattr(trainer, "_results", None) or {}).values():
        value, meta = getattr(metric, "_forward_cache", None), getattr(metric, "meta", None)
        if getattr(meta, "fx", None) == "training_step" and isinstance(value, Tensor) and value.numel() == 1:
            terms[meta.name] = value.detach().reshape(())
    return terms


def set_wandb_mode(logger: Any, mode: str) -> None:
    """Make a WandbLogger whose run has not started start it in ``mode``, for this logger only (``WANDB_MODE``
    stays as the user set it).

    Missing public route: WandbLogger takes the run's settings in its constructor only."""
    logger._wandb_init["mode"] = mode
