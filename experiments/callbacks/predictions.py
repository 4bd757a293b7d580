"""`PredictionWriter`: ``attnlab predict``'s samples as JSON lines."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Write every sample that ``predict_step`` returns (a dict of equal-length tensors or lists) as one JSON line
    to ``output``, under ``trainer.default_root_dir`` when relative; under DDP each rank writes ``<output>.rank<N>``.
    The lines go to ``.<name>.tmp`` beside it, renamed to ``output`` once every sample is written: a failed or
    stopped predict leaves the previous file (or none), never an empty or partial one.
    """

    def __init__(self, output: str = "predictions.jsonl"):
        super().__init__(write_interval="batch")
        self.output = output
        self._file = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(trainer.default_root_dir) / self.output  # an absolute output stays as it is
        if trainer.world_size > 1:
            path = path.with_name(f"{path.name}.rank{trainer.global_rank}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._path = path
        self._file = path.with_name(f".{path.name}.tmp").open("w")

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        columns = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in prediction.items()}
        for i in range(len(next(iter(columns.values()), []))):
            self._file.write(json.dumps({k: v[i] for k, v in columns.items()}) + "\n")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._file.close()
        os.replace(self._file.name, self._path)
        self._file = None
        print(f"attnlab: predictions written to {self._path}", file=sys.stderr)  # stdout carries the predictions

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._file is not None:
            self._file.close()
            Path(self._file.name).unlink(missing_ok=True)
            self._file = None
