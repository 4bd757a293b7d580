"""experiments/lightning_compat.py: each Lightning internal it uses still exists and still does what attnlab relies
on. A failure names the internal: the installed Lightning changed it, and the function of that module needs a
new route (the guarantee it serves is in its docstring)."""

import inspect

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from benchmarks.harness import quiet_trainer
from experiments import lightning_compat as compat


def _changed(internal: str, function: str) -> str:
    return (
        f"pytorch_lightning {pl.__version__} changed {internal}, which experiments/lightning_compat.py:{function} "
        "relies on; find the new route there"
    )


class _Tiny(pl.LightningModule):
    def __init__(self, batches: int = 4):
        super().__init__()
        self.layer, self.batches = torch.nn.Linear(2, 1), batches

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.layer(x).pow(2).mean()
        self.log_dict({"train/a": loss, "train/b": 2 * loss}, on_step=True, on_epoch=True)
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(2 * self.batches, 2)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module: pl.LightningModule, callback: pl.Callback, **trainer) -> pl.Trainer:
    fit = quiet_trainer(max_epochs=1, callbacks=[callback], **trainer)
    fit.fit(module)
    return fit


def test_stop_as_on_sigterm_raises_sigterm_after_the_batch():
    assert hasattr(pl.Trainer(logger=False)._signal_connector, "received_sigterm"), _changed(
        "Trainer._signal_connector.received_sigterm", "stop_as_on_sigterm"
    )

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                compat.stop_as_on_sigterm(trainer)
                assert trainer.received_sigterm, _changed("Trainer.received_sigterm", "stop_as_on_sigterm")

    trainer = quiet_trainer(max_epochs=1)
    trainer.callbacks.append(Stop())
    with pytest.raises(SIGTERMException):
        trainer.fit(_Tiny())
    assert trainer.global_step == 2, _changed(
        "the loop's stop on received_sigterm (after the batch)", "stop_as_on_sigterm"
    )


def test_with_sampler_rebuilds_the_loader_around_the_sampler():
    from pytorch_lightning.utilities import data

    assert list(inspect.signature(data._update_dataloader).parameters)[:3] == ["dataloader", "sampler", "mode"], (
        _changed("pytorch_lightning.utilities.data._update_dataloader(dataloader, sampler, mode)", "with_sampler")
    )
    dataset = TensorDataset(torch.arange(10))
    loader = DataLoader(dataset, batch_size=3, shuffle=True, drop_last=True)
    order = SequentialSampler(dataset)
    rebuilt = compat.with_sampler(loader, order)
    assert rebuilt.sampler is order and rebuilt.batch_size == 3 and rebuilt.drop_last, _changed(
        "_update_dataloader", "with_sampler"
    )
    assert [b[0].tolist() for b in rebuilt] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_batch_ends_optimizer_step_under_accumulation_and_at_the_epochs_end():
    ends = []

    class Record(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            ends.append(compat.batch_ends_optimizer_step(trainer))

    _fit(_Tiny(batches=7), Record(), accumulate_grad_batches=3)
    # batches 0..6, steps end after batches 2, 5 and 6 (the epoch's last)
    assert ends == [False, False, True, False, False, True, True], _changed(
        "fit_loop.epoch_loop._should_accumulate()", "batch_ends_optimizer_step"
    )


def test_logged_step_values_are_the_values_training_step_logged_before_backward():
    seen = []

    class Record(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen.append((compat.logged_step_values(trainer), loss.detach()))

    _fit(_Tiny(batches=2), Record())
    assert len(seen) == 2
    for values, loss in seen:
        assert set(values) == {"train/a", "train/b"}, _changed(
            "Trainer._results (its entries' meta and _forward_cache)", "logged_step_values"
        )
        assert torch.equal(values["train/a"], loss) and torch.equal(values["train/b"], 2 * loss)


def test_set_wandb_mode_reaches_wandb_init():
    pytest.importorskip("wandb")
    from experiments.tracking import WandbLogger

    logger = WandbLogger(mode="online")
    assert isinstance(getattr(logger, "_wandb_init", None), dict), _changed(
        "WandbLogger._wandb_init (the keyword arguments of wandb.init)", "set_wandb_mode"
    )
    assert logger._wandb_init["mode"] == "online", _changed("WandbLogger._wandb_init['mode']", "set_wandb_mode")
    compat.set_wandb_mode(logger, "offline")
    assert logger._wandb_init["mode"] == "offline"
