"""`PredictionWriter`: ``attnlab predict``'s samples as JSON lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter


def _rows(output: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn one batch of ``predict_step`` output (a dict of equal-length tensors/lists) into per-sample rows."""
    columns = {k: (v.tolist() if isinstance(v, torch.Tensor) else list(v)) for k, v in output.items()}
    n = len(next(iter(columns.values()), []))
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


class PredictionWriter(BasePredictionWriter):
    """Write every sample that ``predict_step`` returns as one JSON line.

    Args:
        output: file to write; relative paths are placed under ``trainer.default_root_dir``.
    Under DDP each rank writes ``<output>.rank<N>``.
    """

    def __init__(self, output: str = "predictions.jsonl"):
        super().__init__(write_interval="batch")
        self.output = output
        self._file = None

    def _path(self, trainer: pl.Trainer) -> Path:
        path = Path(self.output)
        if not path.is_absolute():
            path = Path(trainer.default_root_dir) / path
        return path.with_name(f"{path.name}.rank{trainer.global_rank}") if trainer.world_size > 1 else path

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self._path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        for row in _rows(prediction):
            self._file.write(json.dumps(row) + "\n")

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = self._path(trainer)
        self._file.close()
        print(f"attnlab: predictions written to {path}", file=sys.stderr)  # stdout carries the predictions
