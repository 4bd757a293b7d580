"""Faults a run must survive: checkpoints holding pickled code, damaged files, a NaN loss, an unwritable
output folder and a full disk. Each ends in one `attnlab: error:` line and leaves earlier checkpoints whole."""

import collections
import csv
import errno
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from builders import CallCounter
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness import quiet_trainer
from experiments import tracking
from experiments.callbacks import guards
from experiments.callbacks.guards import NonFiniteLoss, RunError, SafeCheckpointIO
from models.core.attention import MultiHeadAttention
from models.detection.backbone import load_backbone_weights
from models.vision.module import ImageClassifier
from models.vision.pretrained import read_checkpoint

DIGITS = "configs/vision/digits.yaml"
THREE_BATCHES = (
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_model_summary=false",
)


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``: what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def malicious(tmp_path):
    """(a checkpoint whose unpickling would create the marker, the marker)."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.ckpt"
    torch.save(
        {"state_dict": {"model.head.weight": torch.zeros(10, 64)}, "hyper_parameters": {"lr": _Payload(marker)}}, path
    )
    return path, marker


def test_a_checkpoint_holding_code_is_refused_by_ckpt_path(attnlab, tmp_path, malicious):
    path, marker = malicious
    code, _, err = attnlab(
        "test", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path", str(path)
    )
    assert code == 2 and not marker.exists()
    assert err.strip().splitlines()[-1] == (
        f"attnlab: error: ckpt_path: {path} was refused: it holds pickled code or objects other than tensors (posix.system); "
        "attnlab never unpickles arbitrary objects: give a state dict of tensors, a .safetensors file or a checkpoint written by `attnlab fit`"
    )


def test_a_saved_checkpoint_holding_code_is_refused_on_resume(attnlab, tmp_path, malicious):
    """`--ckpt_path last` finds the file after parsing: Lightning's restore reads it through SafeCheckpointIO."""
    path, marker = malicious
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    path.rename(last)
    code, _, err = attnlab(
        "fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path", "last", *THREE_BATCHES
    )
    assert code == 2 and not marker.exists()
    assert (
        err.strip().splitlines()[-1].startswith(f"attnlab: error: ckpt_path: {last} was refused: it holds pickled code")
    )


@pytest.mark.parametrize("protocol", ["torch.save", "pickle"])
def test_weights_files_holding_code_are_refused_by_the_model_loaders(tmp_path, protocol):
    marker = tmp_path / "code-ran"
    path = tmp_path / "weights.pth"
    payload = {"conv1.weight": torch.zeros(1), "evil": _Payload(marker)}
    if protocol == "torch.save":
        torch.save(payload, path)
    else:  # a bare pickle (protocol 2), as torch.save wrote before its zip format
        path.write_bytes(pickle.dumps(payload, protocol=2))
    with pytest.raises(ValueError, match=f"model.init_from: {path} (was refused|cannot be read)"):
        read_checkpoint(path)
    with pytest.raises(ValueError, match=f"model.backbone_weights: {path} (was refused|cannot be read)"):
        load_backbone_weights(torch.nn.Conv2d(1, 1, 1), path)
    assert not marker.exists()


def test_damaged_files_are_named_in_one_line(attnlab, tmp_path):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:1500])
    code, _, err = attnlab(
        "validate", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path", str(truncated)
    )
    assert code == 2
    assert re.fullmatch(
        rf"attnlab: error: ckpt_path: {truncated} cannot be read as weights \(.+\): it is truncated, corrupt or not a weights file",
        err.strip().splitlines()[-1],
    )
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":')
    with pytest.raises(
        ValueError, match=f"model.init_from: {broken} cannot be read as weights \\(Error while deserializing header"
    ):
        read_checkpoint(broken)
    empty = tmp_path / "empty.pth"
    empty.touch()
    with pytest.raises(ValueError, match=r"cannot be read as weights \(it ends early\)"):
        read_checkpoint(empty)


def test_checkpoints_are_read_as_tensors_by_default(attnlab):
    code, out, _ = attnlab("fit", "--config", DIGITS, "--print_config")
    assert code == 0 and "\nweights_only: true\n" in out


def test_our_own_checkpoint_reads_safely_and_initialises_a_vit(attnlab, tmp_path):
    code, _, err = attnlab(
        "fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=1", *THREE_BATCHES
    )
    assert code == 0, err
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)  # Lightning's loops, optimizer and callback states are plain data
    assert saved["global_step"] == 3 and not list(last.parent.glob(".*.tmp"))
    hp = saved["hyper_parameters"]
    tuned = ImageClassifier(
        **{
            k: hp[k]
            for k in (
                "num_classes",
                "in_chans",
                "img_size",
                "patch_size",
                "embed_dim",
                "depth",
                "num_heads",
                "mlp_ratio",
            )
        },
        init_from=str(last),
    )
    torch.testing.assert_close(tuned.model.pos_embed, saved["state_dict"]["model.pos_embed"])


# --- non-finite loss ---------------------------------------------------------------------------------


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(attnlab, tmp_path, monkeypatch):
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    at_failure = {}
    forward = ImageClassifier.forward

    def diverging(self, images):
        logits = forward(self, images)
        if self.training and self.global_step >= 3:  # the first step of epoch 1, after epoch 0's checkpoints
            at_failure.setdefault("last", (last.read_bytes(), last.stat().st_mtime_ns))
            return logits * float("nan")
        return logits

    monkeypatch.setattr(ImageClassifier, "forward", diverging)
    code, _, err = attnlab(
        "fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=3", *THREE_BATCHES
    )
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        "attnlab: error: training stopped at global step 3 (epoch 1): non-finite loss (train/loss=nan); "
        "the weights were not updated with it; the last good checkpoint "
    ), line
    assert re.search(rf"checkpoint {last.parent}/(last|best)\.ckpt was kept", line)
    assert (last.read_bytes(), last.stat().st_mtime_ns) == at_failure["last"]  # nothing wrote it after the failure
    assert torch.load(last, weights_only=True)["global_step"] == 3
    assert json.loads((last.parent.parent / "summary.json").read_text())["status"] == "failed"


class _TwoTerms(pl.LightningModule):
    """Logs two loss terms as DETR does (`self.log_dict`); from global step ``diverge_at`` on, one of them is
    infinite."""

    def __init__(self, diverge_at: int = 10**9, samples: int = 8, optimizer: str = "sgd"):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.diverge_at, self.samples, self.optimizer = diverge_at, samples, optimizer

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss_ce, loss_giou = self.layer(x).pow(2).mean(), self.layer(x).abs().mean()
        if self.global_step >= self.diverge_at:
            loss_giou = loss_giou * float("inf")
        self.log_dict({"train/loss_ce": loss_ce, "train/loss_giou": loss_giou}, on_step=True, on_epoch=True)
        return loss_ce + loss_giou

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(self.samples, 4)), batch_size=4)  # 2 steps per epoch by default

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=0.1, fused=self.optimizer == "fused adamw")


def _fit(module: pl.LightningModule, folder: Path) -> None:
    # save_on_exception would write the failed state over last.ckpt: the guard must keep it from doing so
    checkpoints = ModelCheckpoint(dirpath=folder, save_last=True, save_on_exception=True)
    trainer = quiet_trainer(
        max_epochs=3, enable_checkpointing=True, callbacks=[NonFiniteLoss(), checkpoints], default_root_dir=folder
    )
    trainer.fit(module)


def test_the_guard_names_the_non_finite_terms_and_nothing_saves_after_it(tmp_path):
    with pytest.raises(
        RunError, match=r"global step 3 \(epoch 1\): non-finite loss \(train/loss_giou=inf\)"
    ) as stopped:
        _fit(_TwoTerms(diverge_at=3), tmp_path)
    assert "train/loss_ce" not in str(stopped.value) and f"{tmp_path}/last.ckpt was kept" in str(stopped.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


class _Overflowing(_TwoTerms):
    """At the end of epoch 1 a weight turns NaN while every loss was finite (an overflowing gradient)."""

    def on_train_epoch_end(self):
        if self.current_epoch == 1:
            with torch.no_grad():
                self.layer.weight[0, 0] = float("nan")


def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path):
    with pytest.raises(
        RunError, match=r"the weights became non-finite \(layer.weight\).*that checkpoint was not written"
    ):
        _fit(_Overflowing(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 2


class _WeightsAt(pl.Callback):
    """Keep a copy of the weights as they are when the batch of global step ``step`` starts."""

    def __init__(self, step: int):
        self.step, self.weights = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["fused adamw", "sgd", "adamw"])
def test_a_non_finite_loss_never_reaches_the_weights_and_stops_at_the_next_logging_step(tmp_path, optimizer):
    """No per-step read of the loss: from the bad step on the updates are skipped on the device (fused optimizers
    take AMP's found_inf; others get zero gradients), and the run stops at the next logging step naming the bad one."""
    module, before = _TwoTerms(diverge_at=3, samples=40, optimizer=optimizer), _WeightsAt(3)  # 10 steps an epoch
    trainer = quiet_trainer(
        max_epochs=1,
        enable_checkpointing=True,
        log_every_n_steps=6,
        callbacks=[NonFiniteLoss(), before, ModelCheckpoint(dirpath=tmp_path)],
        default_root_dir=tmp_path,
    )
    with pytest.raises(
        RunError,
        match=r"global step 3 \(epoch 0\): non-finite loss \(train/loss_giou=inf\); the weights were not updated",
    ):
        trainer.fit(module)
    assert trainer.global_step == 6  # steps 3, 4 and 5 ran on the device; the host read the flag at the logging step
    assert not list(tmp_path.glob("*.ckpt"))
    weights, state = module.state_dict(), trainer.optimizers[0].state_dict()["state"]
    assert all(v.isfinite().all() for v in weights.values())
    assert all(
        v.isfinite().all() for s in state.values() for v in s.values() if torch.is_tensor(v)
    )  # nothing non-finite in the moments
    if (
        optimizer != "adamw"
    ):  # a skipped update (fused) or a zero gradient without momentum (SGD): the weights of step 3
        assert all(torch.equal(weights[k], before.weights[k]) for k in weights)
    if optimizer == "fused adamw":
        assert all(int(s["step"]) == 3 for s in state.values())  # the skipped steps did not count


_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


class _Reads(CallCounter):
    """Count the host's reads of tensor values (and CUDA synchronizations) between the ends of consecutive training batches."""

    def __init__(self, monkeypatch):
        self.per_batch, self.logged = [], []
        self.count(torch.Tensor, _READS, monkeypatch.setattr)
        self.count(torch.cuda, ["synchronize"], monkeypatch.setattr)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(trainer.global_step % trainer.log_every_n_steps == 0)  # Lightning logs this step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.per_batch.append(self.calls)  # reads since the previous batch started: that batch's
        self.calls = 0


class _Attending(pl.LightningModule):
    """One attention layer on random tokens, so that every default callback acts (tokens counted, norms taken); logs
    its loss with `self.log`, as our modules do."""

    def __init__(self):
        super().__init__()
        self.attn, self.head = MultiHeadAttention(8, 2), torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch  # (B, L, 8)
        loss = self.head(self.attn(x, x, x)[0]).pow(2).mean()
        self.log("train/loss", loss, on_step=True, on_epoch=True, batch_size=len(x))
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(32, 5, 8)), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)  # its step count stays on the device


def test_the_default_callbacks_read_nothing_back_from_the_device_between_logging_steps(tmp_path, monkeypatch):
    """Over 16 steps logged every 8, the default callbacks (and Lightning) read no tensor value on the host and never
    synchronize, except at the logging steps and at the epoch's first batch (where Throughput starts timing)."""
    reads = _Reads(monkeypatch)
    trainer = pl.Trainer(
        max_steps=16,
        log_every_n_steps=8,
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*tracking.default_callbacks(), ModelCheckpoint(dirpath=tmp_path), reads],
        default_root_dir=tmp_path,
    )
    trainer.fit(_Attending())
    per_batch = reads.per_batch[1:] + [reads.calls]  # per_batch[k]: the reads of batch k
    assert len(per_batch) == len(reads.logged) == 16 and reads.logged.count(True) == 2
    assert [n for n, logged in zip(per_batch[1:], reads.logged[1:]) if not logged] == [0] * 13
    assert max(per_batch) > 0  # the counting works: the logging steps read their values back
    rows = list(csv.DictReader(next(tmp_path.glob("**/metrics.csv")).open()))
    grad_norms = {int(r["step"]): float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")}
    assert len(grad_norms) == 2 and all(g > 0 for g in grad_norms.values())  # logged at the logging steps only
    assert set(grad_norms) == {int(r["step"]) for r in rows if r.get("train/loss_step")}  # at Lightning's step numbers


# --- output folders and disk space -----------------------------------------------------------------------


def test_an_unwritable_output_folder_is_refused_before_training(attnlab, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, out, err = attnlab("fit", "--config", DIGITS, f"--trainer.default_root_dir={blocker}/runs", *THREE_BATCHES)
    assert code == 2 and "Epoch" not in out + err
    assert err.strip().splitlines()[-1] == (
        f"attnlab: error: trainer.default_root_dir: cannot write to {blocker}/runs "
        f"(Not a directory: {blocker}/runs); choose a folder you can write to"
    )


def test_a_disk_without_room_for_the_checkpoints_is_refused_before_training(attnlab, tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(guards.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 5 * 2**20, 5 * 2**20))
    code, _, err = attnlab("fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", *THREE_BATCHES)
    assert code == 2 and not (tmp_path / "lightning_logs").exists()
    line = err.strip().splitlines()[-1]
    # digits' ViT: 1.7 MB checkpoints; best + last + one being rewritten, and the room for logs
    assert re.fullmatch(
        rf"attnlab: error: {tmp_path} has 5.0 MiB free, but this fit needs about 6\d\.\d MiB: 3 checkpoints of "
        r"1\.\d MiB \(weights and AdamW's two moments\) and 64\.0 MiB for logs; free space or choose another "
        r"trainer.default_root_dir",
        line,
    ), line


def test_a_disk_that_fills_during_training_keeps_the_previous_checkpoint(attnlab, tmp_path, monkeypatch):
    """The disk fills while last.ckpt is rewritten at the end of epoch 1 (by the default LastCheckpoint, before
    ModelCheckpoint saves epoch 1): the epoch-0 files stay whole."""
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    save, at_failure = torch.save, {}

    def filling(obj, f, *args, **kwargs):
        if Path(f).name != ".last.ckpt.tmp" or not last.exists():
            return save(obj, f, *args, **kwargs)
        at_failure.setdefault("last", last.read_bytes())
        Path(f).write_bytes(b"the first megabytes of a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", filling)
    every_epoch = (
        "--trainer.callbacks=[{class_path: pytorch_lightning.callbacks.ModelCheckpoint, init_args: {save_last: true}}]"
    )
    code, _, err = attnlab(
        "fit",
        "--config",
        DIGITS,
        f"--trainer.default_root_dir={tmp_path}",
        every_epoch,
        "--trainer.max_epochs=3",
        *THREE_BATCHES,
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"attnlab: error: no space left on the disk while writing {last}; the previous checkpoint {last.parent}/epoch=0-step=3.ckpt is intact "
        "(checkpoints are renamed into place only once complete); free space, then resume with --ckpt_path last"
    )
    assert last.read_bytes() == at_failure["last"] and torch.load(last, weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in last.parent.iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]  # no partial file left


def test_safe_checkpoint_io_round_trip_and_explicit_trust(tmp_path):
    io = SafeCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, tmp_path / "sub" / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "sub" / "a.ckpt")["epoch"] == 1
    torch.save({"where": Path("/data")}, tmp_path / "b.ckpt")  # a Path object: not plain data
    with pytest.raises(ValueError, match="was refused"):
        io.load_checkpoint(tmp_path / "b.ckpt")
    assert io.load_checkpoint(tmp_path / "b.ckpt", weights_only=False)["where"] == Path(
        "/data"
    )  # the user's explicit choice
