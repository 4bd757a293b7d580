"""The data section of `python -m benchmarks`: for each experiment config, samples/s of the DataModule's
training loader alone, of the training step alone (Lightning fit on batches already in memory), and of the
real fit, for several ``num_workers``; "model busy" is the step's share of the fit's time per batch."""

from __future__ import annotations

import importlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.harness import bare_trainer
from experiments.links import LINKED_ATTRIBUTES, init_options


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (tuples, lists and dicts searched in order)."""
    if isinstance(batch, Tensor):
        return batch.size(0)
    values = batch.values() if isinstance(batch, dict) else batch
    for value in values:
        if isinstance(value, (Tensor, dict, list, tuple)):
            return batch_size_of(value)
    raise ValueError("no tensor in the batch")


def _instantiate(spec: dict[str, Any], **extra: Any) -> Any:
    module, _, name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(**{**spec.get("init_args", {}), **extra})


def from_config(path: str | Path, num_workers: int) -> tuple[Any, Any]:
    """The DataModule (with ``num_workers``) and the LightningModule of an experiment YAML, the
    DataModule's facts linked into the model as `attnlab` links them."""
    import yaml

    config = yaml.safe_load(Path(path).read_text())
    data = _instantiate(config["data"], num_workers=num_workers)
    module, _, name = config["model"]["class_path"].rpartition(".")
    model_cls_args = init_options(getattr(importlib.import_module(module), name))
    linked = {name: getattr(data, name) for name in LINKED_ATTRIBUTES if name in model_cls_args and hasattr(data, name)}
    return data, _instantiate(config["model"], **linked)


class BatchTimer:
    """A Lightning callback recording, per training batch, the time from one batch's start to the next
    (the loop's time per batch, data loading included) and from start to end (the step alone)."""

    def __init__(self):
        self.starts: list[float] = []
        self.steps: list[float] = []
        self.samples: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())
        self.samples.append(batch_size_of(batch))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self.starts[-1])

    def rates(self, skip: int) -> tuple[float, float]:
        """(samples/s of the loop, samples/s of the step alone), leaving out the first ``skip`` batches."""
        intervals = [b - a for a, b in zip(self.starts[skip:], self.starts[skip + 1 :])]
        per_batch = statistics.mean(self.samples[skip:])
        return per_batch / statistics.median(intervals), per_batch / statistics.median(self.steps[skip:])


class InMemory:
    """Batches held in memory, iterated like a DataLoader (a plain list would be taken by Lightning for
    a collection of loaders)."""

    def __init__(self, batches: list[Any]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _fit(model: Any, loader: Any, batches: int, device: torch.device) -> BatchTimer:
    from pytorch_lightning.callbacks import Callback

    timer = BatchTimer()
    callback = type(
        "Timer",
        (Callback,),
        {"on_train_batch_start": timer.on_train_batch_start, "on_train_batch_end": timer.on_train_batch_end},
    )()
    trainer = bare_trainer(device.type, "runs/benchmark", max_steps=batches, callbacks=[callback])
    trainer.fit(model, train_dataloaders=loader)
    return timer


def loader_rate(loader: Any, batches: int) -> float:
    """samples/s of iterating ``loader`` for ``batches`` batches after the first (wall time)."""
    iterator = iter(loader)
    next(iterator)  # workers start, first batch
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        try:
            samples += batch_size_of(next(iterator))
        except StopIteration:
            iterator = iter(loader)
    return samples / (time.perf_counter() - start)


def data_pipeline_rows(config: str, workers: tuple[int, ...], batches: int, device: torch.device) -> list[list[str]]:
    """Rows: config, num_workers, loader alone, step alone, fit, model busy (all samples/s, wall time)."""
    import pytorch_lightning as pl

    rows = []
    for num_workers in workers:
        pl.seed_everything(0, verbose=False)
        data, model = from_config(config, num_workers)
        data.prepare_data()
        data.setup("fit")
        alone = loader_rate(data.train_dataloader(), batches)
        cached = InMemory([b for b, _ in zip(data.train_dataloader(), range(batches + 3))])
        step_rate = _fit(model, cached, len(cached), device).rates(skip=3)[1]
        data, model = from_config(config, num_workers)
        fit_rate, _ = _fit(model, data, batches + 3, device).rates(skip=3)
        rows.append(
            [
                config,
                str(num_workers),
                f"{alone:,.0f}",
                f"{step_rate:,.0f}",
                f"{fit_rate:,.0f}",
                f"{100 * fit_rate / step_rate:.0f}%",
            ]
        )
    return rows
