"""The one optimizer and schedule builder: schedule values against hand computations, the horizon of each
limit, the trunk learning rate, and the time budget that fits the schedule to trainer.max_time."""

import math

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Timer
from torch import nn

from benchmarks.harness import quiet_trainer
from experiments.callbacks.time_budget import LearningRateLog, TimeBudget
from models import optim


def test_cosine_values_by_hand():
    f = optim.Schedule("cosine", warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway: 0.55
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_inverse_sqrt_values_by_hand():
    f = optim.Schedule("inverse_sqrt", warmup_steps=100, total_steps=None)
    assert f(0) == pytest.approx(1 / 100)  # step 1: 1 · 100^-1.5 · 100^0.5
    assert f(99) == pytest.approx(1.0)  # the peak at the end of warmup
    assert f(399) == pytest.approx(0.5)  # 400^-0.5 · 100^0.5


def test_step_drop_by_hand():
    f = optim.Schedule("step", warmup_steps=2, total_steps=30, drop_fraction=2 / 3)
    assert [f(0), f(1), f(2), f(19), f(20), f(29)] == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.1, 0.1])


def test_no_horizon_holds_the_peak():
    assert optim.Schedule("cosine", 2, None)(10**6) == 1.0


class Tiny(pl.LightningModule):
    """A linear model on 32 random rows, 8 per batch (4 optimizer steps per epoch)."""

    def __init__(self, name="cosine", warmup_epochs=None, warmup_steps=0, drop_epoch=None):
        super().__init__()
        self.net, self.trunk = nn.Linear(4, 1), nn.Linear(4, 4)
        self.args = dict(name=name, warmup_epochs=warmup_epochs, warmup_steps=warmup_steps, drop_epoch=drop_epoch)

    def training_step(self, batch, batch_idx):
        return self.net(self.trunk(batch[0])).pow(2).mean()

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=8)

    def configure_optimizers(self):
        optimizer = optim.adamw(self, 1e-3, 0.0, trunk=self.trunk, lr_trunk=0.0)
        return {
            "optimizer": optimizer,
            "lr_scheduler": optim.schedule(optimizer, self.trainer, min_ratio=0.0, **self.args),
        }


def fit(module, **trainer_args) -> pl.Trainer:
    trainer = quiet_trainer(**trainer_args)
    trainer.fit(module)
    return trainer


def schedule_of(trainer) -> optim.Schedule:
    return trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]


def test_horizon_with_max_steps_only():
    """The bug this fixes: with max_steps alone, ViT's warmup of 1 epoch (4 steps) became max_steps epochs long."""
    trainer = fit(Tiny(warmup_epochs=1.0), max_steps=10, max_epochs=-1)
    f = schedule_of(trainer)
    assert (f.warmup_steps, f.total_steps) == (4, 10)


def test_horizon_is_the_limit_that_ends_first():
    assert schedule_of(fit(Tiny(), max_steps=100, max_epochs=2)).total_steps == 8
    assert schedule_of(fit(Tiny(), max_steps=5, max_epochs=2)).total_steps == 5


def test_step_drop_is_placed_by_epoch():
    f = schedule_of(fit(Tiny(name="step", drop_epoch=2), max_epochs=3))
    assert f.drop_fraction * f.total_steps == pytest.approx(8)


def test_trunk_learning_rate_zero_freezes_the_trunk():
    module = Tiny()
    before = [p.clone() for p in module.trunk.parameters()]
    fit(module, max_steps=3)
    assert all(torch.equal(a, b) for a, b in zip(before, module.trunk.parameters()))
    assert not torch.equal(module.net.weight, Tiny().net.weight)


class FakeClock:
    """Timer.time_elapsed as 0.1 s per optimizer step of the trainer it serves."""

    def __init__(self, monkeypatch):
        self.trainer = None
        monkeypatch.setattr(Timer, "time_elapsed", lambda timer, stage="train": 0.1 * self.trainer.global_step)

    def callback(self):
        clock = self

        class Bind(pl.Callback):
            def setup(self, trainer, *args, **kwargs):
                clock.trainer = trainer

        return Bind()


def test_time_budget_fits_the_schedule_to_max_time(monkeypatch):
    """At 0.1 s/step, a 3-second budget is 30 steps: the cosine reaches its floor on the last one."""
    clock = FakeClock(monkeypatch)
    lrs = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = fit(
        Tiny(warmup_steps=2),
        max_time={"seconds": 3},
        max_epochs=-1,
        callbacks=[clock.callback(), TimeBudget(probe_steps=5, every_n_steps=5), Record()],
    )
    assert trainer.global_step == 30 and schedule_of(trainer).total_steps == 30
    assert lrs[-2] < 1e-5 and max(lrs) == pytest.approx(1e-3)


def test_time_budget_never_passes_the_step_limit(monkeypatch):
    clock = FakeClock(monkeypatch)
    trainer = fit(
        Tiny(),
        max_time={"seconds": 100},
        max_steps=12,
        callbacks=[clock.callback(), TimeBudget(probe_steps=5, every_n_steps=5)],
    )
    assert schedule_of(trainer).total_steps == 12


def test_a_budget_shorter_than_the_warmup_names_both(monkeypatch):
    clock = FakeClock(monkeypatch)
    with pytest.raises(ValueError, match=r"trainer.max_time \(3 s\) ends before the learning-rate warmup: 50 steps"):
        fit(Tiny(warmup_steps=50), max_time={"seconds": 3}, callbacks=[clock.callback(), TimeBudget(probe_steps=5)])


def test_learning_rate_log_is_silent_without_a_logger():
    fit(Tiny(), max_steps=2, callbacks=[LearningRateLog()])


def test_a_resumed_budget_keeps_its_horizon(monkeypatch, tmp_path):
    """Stopped at step 12 of a 30-step budget, then resumed: the schedule's horizon comes back from the checkpoint
    (Lightning's Timer restores the elapsed time; here the clock is the step count), so the resumed run ends on the
    same step at the schedule's floor."""
    clock = FakeClock(monkeypatch)
    common = dict(max_time={"seconds": 3}, max_epochs=-1, default_root_dir=tmp_path)

    class StopAt12(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 12:
                trainer.should_stop = True

    first = quiet_trainer(
        callbacks=[clock.callback(), TimeBudget(probe_steps=5, every_n_steps=5), StopAt12()],
        **common,
    )
    first.fit(Tiny(warmup_steps=2))
    path = tmp_path / "stopped.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["lr_schedulers"][0]["lr_lambdas"][0]["total_steps"] == 30
    second = quiet_trainer(
        callbacks=[clock.callback(), TimeBudget(probe_steps=5, every_n_steps=5)],
        **common,
    )
    second.fit(Tiny(warmup_steps=2), ckpt_path=path)
    assert second.global_step == 30 and schedule_of(second).total_steps == 30
    assert second.optimizers[0].param_groups[0]["lr"] < 1e-5


def test_a_step_limit_inside_the_warmup_is_not_the_budgets_fault(monkeypatch):
    """max_steps=12 with a 50-step warmup and an ample budget: a short run by choice, not an error."""
    clock = FakeClock(monkeypatch)
    trainer = fit(
        Tiny(warmup_steps=50),
        max_time={"seconds": 100},
        max_steps=12,
        callbacks=[clock.callback(), TimeBudget(probe_steps=5, every_n_steps=5)],
    )
    assert trainer.global_step == 12


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_gradient_clipping_with_the_fused_optimizer(precision, tmp_path):
    """Lightning refuses to clip for a fused optimizer under mixed precision; the modules' hook clips it."""
    from models.distributed import clip_gradients

    class Clipped(Tiny):
        def training_step(self, batch, batch_idx):
            return 1e3 * super().training_step(batch, batch_idx)

        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
            self.norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])

    module = Clipped()
    fit(module, max_steps=2, precision=precision, gradient_clip_val=0.5)
    assert module.norm <= 0.5 + 1e-4


class Endless(Tiny):
    """The same model on a loader with no length (an IterableDataset)."""

    def train_dataloader(self):
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                while True:
                    yield torch.randn(4)

        return torch.utils.data.DataLoader(Stream(), batch_size=8)

    def training_step(self, batch, batch_idx):
        return self.net(self.trunk(batch)).pow(2).mean()


def test_an_endless_loader_takes_its_horizon_from_max_steps():
    assert schedule_of(fit(Endless(), max_steps=6)).total_steps == 6


def test_epochs_of_an_endless_loader_are_refused_by_name():
    with pytest.raises(
        ValueError, match=r"model.warmup_epochs=1.0 counts epochs, but the training loader has no length"
    ):
        fit(Endless(warmup_epochs=1.0), max_steps=6)
