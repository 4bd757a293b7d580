"""The ViT's [CLS] attention with and without registers, as Darcet et al. (2024) show it: per cell, the last layer's
attention from the class token to the patches, averaged over heads, on the same few validation images.

Each cell's map comes from its first run (its first seed in a sweep): the network of ``checkpoints/best.ckpt``, built
by the LightningModule class the checkpoint's hyper-parameters name, run inside `models.core.capture.capture_attention`
and read by `experiments.callbacks.attention_maps.cls_attention`. The images are the first validation images of the data in the
run's ``config.yaml``, built as the CLI builds it (relative paths there resolve from the current folder, as they did
for the run): those that `experiments.callbacks.AttentionMapLogger` draws during training.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import yaml
from matplotlib.figure import Figure
from pytorch_lightning.cli import instantiate_class
from torch import Tensor

from experiments.callbacks.attention_maps import cls_attention, draw_map
from experiments.checkpoints import saved_hyperparameters
from experiments.compare.plots import flat_label
from models.core.capture import capture_attention

NUM_IMAGES = 4


def _hparams(cell: dict[str, Any]) -> dict[str, Any]:
    return cell["runs"][0]["summary"].hparams or {}


def _plain_softmax(cell: dict[str, Any]) -> bool:
    """Softmax attention without a gate, a kernel of one's own or registers: the row the others are read against."""
    attention = _hparams(cell).get("attention") or {}
    plain = attention.get("normalization", "softmax") == "softmax" and not (
        attention.get("gate") or attention.get("kernel")
    )
    return plain and not _hparams(cell).get("register_tokens")


def best_module(run_dir: Path) -> pl.LightningModule:
    """The LightningModule of ``run_dir/checkpoints/best.ckpt`` on the CPU in eval mode, built by the class its
    hyper-parameters name (``_class_path``, saved by the CLI)."""
    path = run_dir / "checkpoints" / "best.ckpt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no best checkpoint (ModelCheckpoint with filename: best saves it)")
    class_path = saved_hyperparameters(path).get("_class_path")
    if not class_path:
        raise ValueError(f"{path}: its hyper-parameters name no LightningModule class (_class_path, saved by the CLI)")
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name).load_from_checkpoint(path, map_location="cpu").eval()


def validation_images(run_dir: Path, n: int = NUM_IMAGES) -> Tensor:
    """The first ``n`` images (n, C, H, W) of the first validation batch of the data in ``run_dir/config.yaml``."""
    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else None
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict):
        raise ValueError(f"{path}: no data section (class_path, init_args) to take the validation images from")
    datamodule = instantiate_class((), config["data"])
    datamodule.setup("validate")
    return next(iter(datamodule.val_dataloader()))[0][:n]


@torch.no_grad()
def cls_maps(module: pl.LightningModule, images: Tensor) -> Tensor:
    """The last layer's [CLS] -> patch attention averaged over heads: images (B, C, H, W) -> (B, g, g)."""
    vit = getattr(module, "model", module)
    with capture_attention(vit) as maps:
        vit(images)
    return cls_attention(maps, -1, vit.num_prefix_tokens).mean(1)  # (B, H, g, g) -> (B, g, g)


def registers_figure(cells: list[dict[str, Any]]) -> Figure:
    """One row per cell of ViT classifiers (plain softmax first), one column per validation image: each image with
    the cell's [CLS] map over it."""
    cells = sorted(cells, key=lambda c: not _plain_softmax(c))  # stable: the others keep their order
    images = validation_images(cells[0]["runs"][0]["dir"])
    rows = [(c["label"], cls_maps(best_module(c["runs"][0]["dir"]), images)) for c in cells]
    fig = Figure(figsize=(1.5 + 1.8 * len(images), 0.4 + 1.8 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(images), squeeze=False)
    for axes_row, (label, heats) in zip(axes, rows):
        for ax, image, heat in zip(axes_row, images, heats):
            draw_map(ax, image, heat)
            ax.set(xticks=[], yticks=[])
        axes_row[0].set_ylabel(flat_label(label).rpartition("/")[2], fontsize=7)
    for k, ax in enumerate(axes[0]):
        ax.set_title(f"image {k}", fontsize=7)
    fig.suptitle("last layer: [CLS] -> patches, mean over heads", fontsize=8)
    return fig
