"""W8A8 at the end of a run: its validation or test metrics in fp32 and with every linear layer fake-quantised to 8
bits (`experiments.callbacks.w8a8`), on the same batches with the same weights."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback
from pytorch_lightning.utilities import move_data_to_device, rank_zero_warn

from experiments.callbacks.summary import RunSummary
from experiments.callbacks.w8a8 import freeze, w8a8
from experiments.runfolder import SUMMARY, Summary


class _NetworkRan(Exception):
    """Raised by a forward hook once the network has run: the rest of the training step is not needed."""


class W8A8(Callback):
    """Score the model once in fp32 and once in simulated W8A8 when a fit, validate or test has completed (its
    ``teardown``; an interrupted or failed run is not scored):

    1. fp32: the module's validation loop (after ``fit`` or ``validate``) or test loop (after ``test``), run by a fresh
       one-device Trainer on the run's batches (its ``limit_val_batches`` / ``limit_test_batches``) and weights (a
       fit's final weights; the checkpoint's in test and validate);
    2. calibration: the first ``calibration_batches`` training batches, in eval mode, through the module's
       ``training_step`` as far as its network (``model``) runs, observers on: nothing is logged, no metric or optimizer
       moves. Training data, as Bondarenko et al.'s code estimates its ranges, so no scored batch sets a range;
    3. W8A8: the same loop as in 1, the ranges frozen.

    Each metric is logged to the run's loggers as ``<key>@fp32`` and ``<key>@w8a8`` (``val/acc@w8a8``), printed, and
    written into the summary.json of the run whose weights were scored (a fit's own; after test or validate, the
    checkpoint's run) under ``quantization``: {"scheme": "w8a8", "calibration_batches", "layers", "val"|"test":
    {"fp32": {...}, "w8a8": {...}}}. The loss, accuracy and AP keys are the module's own.

    Args:
        calibration_batches: training batches that set the activation ranges (fast_dev_run: 1).
    """

    def __init__(self, calibration_batches: int = 16):
        if calibration_batches < 1:
            raise ValueError(
                f"trainer.callbacks: W8A8.calibration_batches={calibration_batches}: expected a positive number of "
                "training batches"
            )
        self.calibration_batches = calibration_batches

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size > 1:
            raise ValueError(
                f"trainer.callbacks: W8A8 scores on one device, this run has {trainer.world_size} processes; "
                "leave it out here and run `attnlab test` with it on one device"
            )

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "predict":
            return
        split = "test" if stage == "test" else "val"
        fp32 = _evaluate(trainer, pl_module, split)
        device = trainer.strategy.root_device
        batches = _training_batches(trainer, stage)
        n = 1 if trainer.fast_dev_run else self.calibration_batches
        with w8a8(pl_module.to(device)) as layers:
            used = _calibrate(pl_module, itertools.islice(batches, n), device)
            freeze(pl_module)
            quantized = _evaluate(trainer, pl_module, split)
        record = {
            "scheme": "w8a8",
            "calibration_batches": used,
            "layers": layers,
            split: {"fp32": fp32, "w8a8": quantized},
        }
        _report(trainer, stage, record)


def _evaluate(trainer: pl.Trainer, pl_module: pl.LightningModule, split: str) -> dict[str, float]:
    """The module's validation or test loop on ``trainer``'s batches, by a Trainer of its own (no logger, no
    callbacks); ``pl_module`` and the DataModule are given back to ``trainer``."""
    evaluator = _trainer_like(trainer)
    loop = evaluator.test if split == "test" else evaluator.validate
    datamodule = trainer.datamodule
    try:
        if datamodule is not None:
            metrics = loop(pl_module, datamodule=datamodule, verbose=False)
        else:
            loaders = trainer.test_dataloaders if split == "test" else trainer.val_dataloaders
            metrics = loop(pl_module, dataloaders=loaders, verbose=False)
    finally:
        pl_module.trainer = trainer
        if datamodule is not None:
            datamodule.trainer = trainer
    return {key: float(value) for key, value in metrics[0].items()}


def _trainer_like(trainer: pl.Trainer) -> pl.Trainer:
    """A Trainer on ``trainer``'s device, precision and evaluation batches, without logger, checkpoints or callbacks."""
    device = trainer.strategy.root_device
    notes = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    level = notes.level
    notes.setLevel(logging.WARNING)  # its device and batch-limit lines: the run printed its own
    try:
        return pl.Trainer(
            accelerator=device.type,
            devices=[device.index] if device.type == "cuda" else 1,
            precision=trainer.precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=trainer.limit_val_batches,
            limit_test_batches=trainer.limit_test_batches,
            default_root_dir=trainer.default_root_dir,
        )
    finally:
        notes.setLevel(level)


def _training_batches(trainer: pl.Trainer, stage: str):
    """The training batches: the fit's own loader, else the DataModule's (set up for fitting)."""
    datamodule = trainer.datamodule
    if stage == "fit" and trainer.train_dataloader is not None:
        return trainer.train_dataloader
    if datamodule is None:
        raise ValueError("trainer.callbacks: W8A8 calibrates on training batches; this run has no DataModule to ask")
    datamodule.setup("fit")
    return datamodule.train_dataloader()


def _calibrate(pl_module: pl.LightningModule, batches, device: torch.device) -> int:
    """Run each batch through ``training_step`` in eval mode as far as the network; the number of batches run."""
    network = getattr(pl_module, "model", pl_module)

    def stop(module, args, output) -> None:
        raise _NetworkRan

    handle = network.register_forward_hook(stop)
    was_training = pl_module.training
    pl_module.eval()
    used = 0
    try:
        with torch.no_grad():
            for batch in batches:
                try:
                    pl_module.training_step(move_data_to_device(batch, device), used)
                except _NetworkRan:
                    used += 1
                else:
                    raise ValueError(
                        f"trainer.callbacks: W8A8 calibrates through {type(pl_module).__name__}.training_step, which "
                        f"did not call its network ({type(network).__name__})"
                    )
    finally:
        handle.remove()
        pl_module.train(was_training)
    return used


def _report(trainer: pl.Trainer, stage: str, record: dict[str, Any]) -> None:
    """Log, print and write into summary.json what `W8A8.teardown` measured."""
    split = "test" if stage == "test" else "val"
    fp32, quantized = record[split]["fp32"], record[split]["w8a8"]
    values = {f"{k}@fp32": v for k, v in fp32.items()} | {f"{k}@w8a8": v for k, v in quantized.items()}
    for logger in trainer.loggers:
        logger.log_metrics(values, step=trainer.global_step)
    changes = ", ".join(f"{k} {fp32[k]:.4f} -> {quantized[k]:.4f}" for k in fp32 if k in quantized)
    print(
        f"attnlab: W8A8 ({record['layers']} linear layers; ranges from {record['calibration_batches']} training "
        f"batches), fp32 -> w8a8: {changes}"
    )
    path = _summary_path(trainer, stage)
    if path is None:
        if not trainer.fast_dev_run:
            rank_zero_warn("W8A8: no summary.json beside the scored weights; the metrics are only logged")
        return
    summary = Summary.read(path)
    summary.update(quantization={**(summary.quantization or {}), **record})
    summary.write(path)


def _summary_path(trainer: pl.Trainer, stage: str) -> Path | None:
    """The summary.json of the run whose weights were scored: the one a fit's `RunSummary` wrote, or the one in the
    checkpoint's run folder (``<run>/checkpoints/best.ckpt``)."""
    if stage == "fit":
        path = next((cb.path for cb in trainer.callbacks if isinstance(cb, RunSummary) and cb.path), None)
    else:
        path = Path(trainer.ckpt_path).parent.parent / SUMMARY if trainer.ckpt_path else None
    return path if path is not None and path.is_file() else None
