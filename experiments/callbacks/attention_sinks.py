"""Attention sinks and attention-output outliers during training (Gu et al. 2025; Bondarenko et al. 2023): how
they grow with the steps."""

from __future__ import annotations

import contextlib

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback

from experiments.callbacks import sinks
from experiments.callbacks.attention_stats import layer_calls
from experiments.callbacks.base import close_scores, needs_weights, open_scores

# `experiments.callbacks.sinks.model_summary`'s keys -> the logged keys
KEYS = {
    "sink_mass": "train/sink_mass",
    "sink_heads": "train/sink_heads",
    "register_mass": "train/register_mass",
    "out_max": "train/attn_out_max",
    "out_kurtosis": "train/attn_out_kurtosis",
}


class AttentionSinks(Callback):
    """Log, on the training batch at Lightning's logging steps, `experiments.callbacks.sinks`' model summary: the mean weight
    on the first key (``train/sink_mass``), Sink^ε_1 (``train/sink_heads``), the mean weight on the registers
    (``train/register_mass``, for a model with ``register_keys``), and the attention layers' largest max |x|
    (``train/attn_out_max``) and mean kurtosis (``train/attn_out_kurtosis``), padded queries left out. Only those
    batches are recorded (the reference path, the capture shared with `MaxAttentionLogit`); the others run as
    without it.
    """

    def __init__(self):
        # the step's capture and the layers' outputs, held from batch start to batch end
        self._maps: dict | None = None
        self._hooks, self._outputs = contextlib.ExitStack(), {}
        self._registers: dict[str, slice] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        needs_weights(pl_module, self)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        net = getattr(pl_module, "model", pl_module)  # the nn.Module that names its registers
        prefix = next((f"{name}." for name, m in pl_module.named_modules() if m is net and name), "")
        self._registers = {prefix + name: keys for name, keys in sinks.register_keys(net).items()}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        every = trainer.log_every_n_steps
        if every and (trainer.global_step + 1) % every == 0:  # the steps Lightning writes to the loggers
            self._maps = open_scores(pl_module)
            self._outputs = self._hooks.enter_context(sinks.attention_outputs(pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if self._maps is None:
            return
        with torch.no_grad():
            layers = [
                {
                    **sinks.sink_stats(scores.weights, blocked, valid_q, self._registers.get(name)),
                    **sinks.output_outliers(self._outputs[name], valid_q),
                }
                for name, scores, blocked, valid_q in layer_calls(self._maps)
            ]
        self._release(pl_module)
        for key, value in sinks.model_summary(layers).items():
            if value is not None:
                pl_module.log(KEYS[key], float(value), on_step=True, on_epoch=False)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._maps is not None:
            self._release(pl_module)

    def _release(self, pl_module: pl.LightningModule) -> None:
        self._maps, self._outputs = None, {}
        self._hooks.close()
        close_scores(pl_module)
