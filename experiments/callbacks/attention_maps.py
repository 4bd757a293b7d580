"""Where a ViT looks: the class token's attention per head, attention rollout (Abnar & Zuidema 2020), and a
callback that renders both over the input images during validation and prediction. The weights come from
`models.core.capture.capture_attention`, so any model on the shared core works unedited:

    with capture_attention(vit) as maps:
        vit(images)
    heads = cls_attention(maps)        # (B, H, g, g), last layer
    rollout = attention_rollout(maps)  # (B, g, g)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from matplotlib.figure import Figure
from pytorch_lightning.loggers import WandbLogger
from torch import Tensor

from experiments.callbacks.base import needs_weights
from models.core.capture import capture_attention
from models.distributed import full_weights

Maps = Mapping[str, Sequence[Tensor]] | Sequence[Tensor]


def layer_weights(maps: Maps) -> list[Tensor]:
    """`capture_attention`'s dict (module name -> weights per call) -> each layer's last weights (B, H, L, L), in
    the order the layers were registered (an encoder's forward order); a sequence of tensors as it is."""
    weights = [calls[-1] for calls in maps.values() if calls] if isinstance(maps, Mapping) else list(maps)
    if not weights:
        raise ValueError("no attention weights were captured; run the model inside capture_attention(model)")
    return weights


def _grid(weights: Tensor, num_prefix_tokens: int) -> int:
    n = weights.shape[-1] - num_prefix_tokens
    g = math.isqrt(n)
    if g * g != n:
        raise ValueError(f"{n} patch tokens after {num_prefix_tokens} prefix token(s) do not form a square grid")
    return g


def cls_attention(maps: Maps, layer: int = -1, num_prefix_tokens: int = 1) -> Tensor:
    """The class token's attention to every patch, per head, of one layer: (B, H, g, g). A head's map sums to 1
    minus what the class token gives to the prefix tokens."""
    w = layer_weights(maps)[layer]  # (B, H, L, L)
    g = _grid(w, num_prefix_tokens)
    return w[:, :, 0, num_prefix_tokens:].reshape(*w.shape[:2], g, g)


def attention_rollout(maps: Maps, num_prefix_tokens: int = 1, token: Literal["cls", "mean"] = "cls") -> Tensor:
    """Attention rollout over all captured layers -> (B, g, g): average each layer's heads, add the identity for
    the residual connection, renormalise the rows and multiply the layers' matrices, first to last.

    ``token="cls"`` reads the class token's row (a "token"-pooled ViT); ``"mean"`` the mean of the patch tokens'
    rows (an "avg"-pooled ViT). Each map sums to at most 1 (the rest flows from the prefix tokens)."""
    weights = layer_weights(maps)
    rollout = None
    for w in weights:
        a = w.mean(1)  # (B, L, L): heads averaged
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)  # the residual path
        a = a / a.sum(-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # (B, L, L): later layers on the left
    g = _grid(weights[0], num_prefix_tokens)
    rows = rollout[:, 0] if token == "cls" else rollout[:, num_prefix_tokens:].mean(1)  # (B, L)
    return rows[:, num_prefix_tokens:].reshape(-1, g, g)


def draw_map(ax: Any, image: Tensor, heat: Tensor | None) -> None:
    """The image (C, H, W), any scale, min-max normalised, on ``ax``; over it the map ``heat`` (g, g), coloured from
    0 to its own maximum: it shows where, not how much."""
    image = image.detach().float().cpu()
    image = (image - image.min()) / (image.max() - image.min()).clamp_min(1e-8)
    shown = image[0] if image.shape[0] == 1 else image.permute(1, 2, 0)  # (H, W) or (H, W, 3)
    extent = (0, image.shape[-1], image.shape[-2], 0)
    ax.imshow(shown, cmap="gray" if image.shape[0] == 1 else None, extent=extent)
    if heat is not None:
        heat = heat.detach().float().cpu()
        ax.imshow(heat, cmap="inferno", alpha=0.6, extent=extent, interpolation="bilinear", vmin=0)


def render_attention(image: Tensor, rollout: Tensor, heads: Tensor, title: str = "") -> Figure:
    """One figure: the image (C, H, W), the rollout (g, g) and each head's class-token map (H, g, g) over it
    (`draw_map`)."""
    panels = [("input", None), ("rollout", rollout)] + [(f"head {h}", m) for h, m in enumerate(heads)]
    fig = Figure(figsize=(1.6 * len(panels), 1.9))
    axes = fig.subplots(1, len(panels))
    for ax, (name, heat) in zip(axes, panels):
        draw_map(ax, image, heat)
        ax.set_title(name, fontsize=7)
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=8)
    return fig


class AttentionMapLogger(pl.Callback):
    """Render the attention maps of the first ``num_images`` images of the first validation batch (the same
    across epochs) every ``every_n_epochs`` epochs, and of the first predicted ones (``predict=True``): per image
    one PNG of the input, the rollout (of the patch mean for ``global_pool="avg"``) and the class token's map per
    head of ``layer``, under ``<log dir>/attention_maps/epoch_<N>/`` (or ``predict/``), logged to W&B as
    ``val/attention_maps``. Every process runs the forward pass on its own images (FSDP); rank 0 draws its own.
    """

    def __init__(self, num_images: int = 8, every_n_epochs: int = 1, layer: int = -1, predict: bool = True):
        if num_images < 1 or every_n_epochs < 1:
            raise ValueError(
                f"AttentionMapLogger: num_images={num_images} and every_n_epochs={every_n_epochs} must be >= 1"
            )
        self.num_images, self.every_n_epochs, self.layer, self.predict = num_images, every_n_epochs, layer, predict

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        needs_weights(pl_module, self)
        # trainer.log_dir broadcasts from rank 0: resolve it here, on every rank, never in rank-0-only hooks
        self._root = Path(trainer.log_dir or trainer.default_root_dir) / "attention_maps"

    @torch.no_grad()
    def render(
        self, trainer, pl_module, images: Tensor, labels: Tensor | None, folder: str, first: int = 0
    ) -> list[str]:
        """Run ``pl_module`` on ``images`` (B, C, H, W) with weights captured, on every process; on rank 0,
        write one PNG per image, numbered from ``first``; return the paths (none on the other ranks)."""
        model = getattr(pl_module, "model", pl_module)
        with full_weights(trainer.model), capture_attention(model) as maps:
            logits = model(images)
        if not trainer.is_global_zero:
            return []
        token = "mean" if getattr(model, "global_pool", "token") == "avg" else "cls"
        prefix = getattr(model, "num_prefix_tokens", 1)  # the class token and the registers
        rollout, heads = attention_rollout(maps, prefix, token), cls_attention(maps, self.layer, prefix)
        names = getattr(trainer.datamodule, "class_names", None)
        name = (lambda k: names[k]) if names else str
        out = self._root / folder
        out.mkdir(parents=True, exist_ok=True)
        paths = [str(out / f"image_{first + i}.png") for i in range(len(images))]
        for i, pred in enumerate(logits.argmax(-1).tolist()):
            title = f"pred {name(pred)}" + ("" if labels is None else f", label {name(int(labels[i]))}")
            render_attention(images[i], rollout[i], heads[i], title).savefig(paths[i], dpi=100, bbox_inches="tight")
        return paths

    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if batch_idx or dataloader_idx or trainer.sanity_checking or trainer.current_epoch % self.every_n_epochs:
            return
        images, labels = batch[0][: self.num_images], batch[1][: self.num_images]
        labels = labels if labels.ndim == 1 else labels.argmax(-1)
        paths = self.render(trainer, pl_module, images, labels, f"epoch_{trainer.current_epoch}")
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="val/attention_maps", images=paths, step=trainer.global_step)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._predicted = 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self.predict or self._predicted >= self.num_images:
            return
        labelled = isinstance(batch, (tuple, list))
        images = (batch[0] if labelled else batch)[: self.num_images - self._predicted]
        labels = batch[1][: len(images)] if labelled else None
        self.render(trainer, pl_module, images, labels, "predict", first=self._predicted)
        self._predicted += len(images)  # on every rank: each renders as many batches

    def on_predict_end(self, trainer, pl_module) -> None:
        if self.predict and self._predicted and trainer.is_global_zero:
            folder = self._root / "predict"
            print(f"attnlab: attention maps of {self._predicted} images written to {folder}", file=sys.stderr)
