"""Value tests against hand computations on tiny examples: the learning-rate scaling with the global batch, and
the parameter count and FLOPs that summary.json reports."""

import json

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from benchmarks.harness import quiet_trainer
from experiments.callbacks import LearningRateScaling, RunSummary
from models import optim


class Linear(pl.LightningModule):
    """y = Wx + b with W (3, 4): 15 parameters and 2·4·3 = 24 FLOPs per sample (a multiply and an add per weight)."""

    def __init__(self):
        super().__init__()
        self.model = nn.Linear(4, 3)
        self.seen_lrs = []

    def training_step(self, batch, batch_idx):
        self.seen_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return self.model(batch[0]).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=2)

    def configure_optimizers(self):
        optimizer = optim.adamw(self.model, 0.01, 0.0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": optim.schedule(optimizer, self.trainer, "cosine", warmup_steps=0),
        }


def fit(module, tmp_path, **kwargs) -> pl.Trainer:
    trainer = quiet_trainer(default_root_dir=tmp_path, **kwargs)
    trainer.fit(module)
    return trainer


@pytest.mark.parametrize("rule,factor", [("linear", 4.0), ("sqrt", 2.0), ("none", 1.0)])
def test_learning_rate_scaling_with_accumulation(tmp_path, rule, factor):
    """4 accumulated batches on one device: k = 4, so linear gives 4 × 0.01 and sqrt 2 × 0.01 at the first step
    (cosine over 2 steps is still at its peak), and the schedule's base moves with it."""
    module = Linear()
    trainer = fit(module, tmp_path, max_steps=2, accumulate_grad_batches=4, callbacks=[LearningRateScaling(rule)])
    assert module.seen_lrs[0] == pytest.approx(0.01 * factor)
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs[0] == pytest.approx(0.01 * factor)


def test_summary_counts_parameters_and_flops_by_hand(tmp_path):
    fit(Linear(), tmp_path, max_steps=2, callbacks=[RunSummary()])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["params"] == {"total": 15, "trainable": 15}
    assert summary["flops_per_sample"] == 24
