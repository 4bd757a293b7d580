"""The largest attention logit during training (Dehghani et al. 2023; Wortsman et al. 2023): its growth is the
instability that QK-norm removes."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from experiments.callbacks.base import close_scores, needs_weights, open_scores


class MaxAttentionLogit(Callback):
    """Log ``train/max_attn_logit``: the largest attention logit (q·k scaled, before the softmax, blocked keys left
    out) over every attention layer, head and query of the training batch, at Lightning's logging steps. Only those
    batches are recorded (`models.core.capture.capture_attention`, the reference path, shared with the other callbacks
    that read it: `open_scores`); the others run as without it.
    """

    def __init__(self):
        self._maps: dict | None = None  # the step's capture, held from batch start to batch end

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        needs_weights(pl_module, self)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        every = trainer.log_every_n_steps
        if every and (trainer.global_step + 1) % every == 0:  # the steps Lightning writes to the loggers
            self._maps = open_scores(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self._maps is None:
            return
        largest = [
            (call.logits if call.blocked is None else call.logits.masked_fill(call.blocked, float("-inf"))).amax()
            for calls in self._maps.values()
            for call in calls
        ]
        self._maps = None
        close_scores(pl_module)
        if largest:
            pl_module.log("train/max_attn_logit", torch.stack(largest).max().float(), on_step=True, on_epoch=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._maps is not None:
            self._maps = None
            close_scores(pl_module)
