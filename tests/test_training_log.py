"""models/training_log.py: the training scalars reach metrics.csv as `self.log` at every step would write them."""

import csv

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from models.training_log import log_training_step


class _Regression(pl.LightningModule):
    """A linear model on 10 samples in batches of 4, 4 and 2; logs its loss (step and epoch) and an epoch-only
    score, through `log_training_step` or, as the reference, through `self.log` at every step."""

    def __init__(self, through: str):
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.through = torch.nn.Linear(3, 1), through
        self.steps: list[tuple[int, float, int]] = []  # (global step, loss, batch size) of every training step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = (self.layer(x).squeeze(-1) - y).pow(2).mean()
        score = loss.detach().sqrt()
        self.steps.append((self.global_step, loss.item(), len(y)))
        if self.through == "log_training_step":
            log_training_step(self, {"train/loss": loss}, len(y))
            log_training_step(self, {"train/score": score}, len(y), on_step=False)
        else:
            self.log("train/loss", loss, on_step=True, on_epoch=True, batch_size=len(y))
            self.log("train/score", score, on_step=False, on_epoch=True, batch_size=len(y))
        return loss

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(10, 3, generator=generator), torch.randn(10, generator=generator))
        return DataLoader(data, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(through: str, folder) -> tuple[_Regression, pl.Trainer, list[dict[str, str]]]:
    module = _Regression(through)
    trainer = pl.Trainer(
        max_epochs=2,
        log_every_n_steps=2,
        logger=CSVLogger(folder, name="", version=""),
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return module, trainer, list(csv.DictReader((folder / "metrics.csv").open()))


def test_step_values_at_the_logging_interval_and_batch_weighted_epoch_means(tmp_path):
    module, trainer, rows = _fit("log_training_step", tmp_path)
    loss = {step: (value, size) for step, value, size in module.steps}
    logged = {int(r["step"]): float(r["train/loss_step"]) for r in rows if r["train/loss_step"]}
    assert sorted(logged) == [1, 3, 5]  # every log_every_n_steps=2 optimizer steps (0-based: 2nd, 4th, 6th)
    assert all(logged[step] == pytest.approx(loss[step][0], rel=1e-6) for step in logged)  # that step's value
    epochs = [
        (int(r["epoch"]), float(r["train/loss_epoch"]), float(r["train/score"])) for r in rows if r["train/loss_epoch"]
    ]
    assert [e for e, _, _ in epochs] == [0, 1]
    for epoch, mean, score in epochs:
        steps = [loss[s] for s in range(3 * epoch, 3 * epoch + 3)]  # batches of 4, 4 and 2
        assert [size for _, size in steps] == [4, 4, 2]
        weighted = sum(value * size for value, size in steps) / 10
        assert mean == pytest.approx(weighted, rel=1e-6) and mean != pytest.approx(sum(v for v, _ in steps) / 3)
        assert score == pytest.approx(sum(value**0.5 * size for value, size in steps) / 10, rel=1e-6)
    assert "train/loss" in trainer.callback_metrics and "train/loss_epoch" in trainer.callback_metrics


def test_the_logs_equal_those_of_self_log_at_every_step(tmp_path):
    (tmp_path / "ours").mkdir(), (tmp_path / "self.log").mkdir()
    _, ours, our_rows = _fit("log_training_step", tmp_path / "ours")
    _, theirs, their_rows = _fit("self.log", tmp_path / "self.log")
    assert our_rows == their_rows  # the same columns, rows and values in metrics.csv
    assert set(ours.callback_metrics) == set(theirs.callback_metrics)
