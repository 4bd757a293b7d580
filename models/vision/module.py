"""LightningModule that trains a `VisionTransformer` for image classification, from scratch or
fine-tuned from a local checkpoint (ours or timm's), a timm hub name, or a timm model by name (``timm:NAME``)."""

from __future__ import annotations

import inspect

import pytorch_lightning as pl
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from models import optim
from models.distributed import clip_gradients
from models.vision.pretrained import load_pretrained, read_init_from
from models.vision.timm_names import TIMM, fill_from_timm
from models.vision.vit import VisionTransformer

NETWORK_DEFAULTS = {name: p.default for name, p in inspect.signature(VisionTransformer).parameters.items()}


class ImageClassifier(pl.LightningModule):
    """ViT + cross-entropy with label smoothing, AdamW, linear warmup and cosine decay.

    Training labels may be class indices (B,) or soft targets (B, num_classes) from Mixup/CutMix; label
    smoothing applies to both (so Mixup itself runs without smoothing). A batch whose images are a list of images
    (C, H_i, W_i) of several sizes (``data.packing``) runs packed in one sequence (NaViT, `models.vision.packing`).

    Args:
        **network: the arguments of `VisionTransformer` (its docstring holds them, its signature their
            defaults); ``num_classes``, ``in_chans`` and ``img_size`` are linked from the DataModule.
        lr: AdamW's peak learning rate: it warms up linearly, then decays on a cosine.
        weight_decay: AdamW's decay, on matrices only.
        warmup_epochs: epochs of linear warmup (fractions allowed).
        min_lr_ratio: the final learning rate, as a fraction of ``lr``.
        label_smoothing: ε of the training loss.
        init_from: a local ``.ckpt`` of `attnlab fit`, a timm ViT ``.pth``/``.safetensors`` state dict, or
            a timm hub name (``timm/vit_small_patch16_224.augreg_in21k``, fetched when online); positions
            are resampled to this image size and the head is re-initialised when the class count differs
            (see `models.vision.pretrained.load_pretrained`). ``timm:NAME`` (timm's hub weights of that model) or
            ``timm:NAME=FILE`` (a local timm state dict) also sets the architecture from timm's registry: the
            network's settings left at their defaults take timm's values, others must equal them
            (`models.vision.timm_names.fill_from_timm`); the image size, channels and classes stay the data's.
        freeze_backbone: train the head only (a linear probe).
        layer_decay: layer-wise learning-rate decay (BEiT; timm's ``param_groups_layer_decay``):
            block i of L trains at ``lr * layer_decay ** (L + 1 - i)``, the head at ``lr``.
        eval_sizes: also evaluate with the images resized (bilinear, antialiased when shrinking) to each of these
            sides, e.g. [28, 42, 56] for a model trained at 28 px: a larger patch grid, whose positions the ViT
            resamples, resizes or computes (`models.vision.VisionTransformer`).
    Logged: ``train/loss``, ``train/acc``, ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc``; with
    ``eval_sizes``, also ``val/acc@42px``, ``val/loss@42px`` ... per size (and ``test/`` alike).
    """

    def __init__(
        self,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        warmup_epochs: float = 5.0,
        min_lr_ratio: float = 0.01,
        label_smoothing: float = 0.1,
        init_from: str | None = None,
        freeze_backbone: bool = False,
        layer_decay: float | None = None,
        eval_sizes: list[int] | None = None,
        **network,
    ):
        super().__init__()
        if layer_decay is not None and not 0 < layer_decay <= 1:
            raise ValueError(f"model.layer_decay={layer_decay} must be in (0, 1]")
        if init_from and init_from.startswith(TIMM):
            network = fill_from_timm(init_from, network, NETWORK_DEFAULTS)
        self.save_hyperparameters()  # with timm's settings
        self.model = VisionTransformer(**network)
        if init_from:
            load_pretrained(self.model, read_init_from(init_from), f"model.init_from={init_from}")
        if freeze_backbone:
            for name, p in self.model.named_parameters():
                p.requires_grad = name.startswith("head.")
        # top-1 over all images, as papers report it (torchmetrics' default is the mean over classes)
        classes = self.model.num_classes
        self.val_acc, self.test_acc = (MulticlassAccuracy(classes, average="micro") for _ in range(2))
        for size in eval_sizes or ():
            try:
                self.model.patch_embed.patch_grid(size, size)
            except ValueError as error:
                raise ValueError(f"model.eval_sizes={eval_sizes}: {error}") from None
        self.size_acc = nn.ModuleDict(
            {
                f"{stage}_{size}": MulticlassAccuracy(classes, average="micro")
                for stage in ("val", "test")
                for size in eval_sizes or ()
            }
        )

    def forward(self, images: Tensor | list[Tensor]) -> Tensor:
        """Images (B, C, H, W), or a packed batch: a list of images (C, H_i, W_i) of several sizes (NaViT,
        `models.vision.packing`) -> logits (B, num_classes)."""
        return self.model.forward_packed(images) if isinstance(images, (list, tuple)) else self.model(images)

    def training_step(self, batch: tuple[Tensor | list[Tensor], Tensor], batch_idx: int) -> Tensor:
        images, labels = batch  # labels (B,) class indices, or (B, K) soft targets from Mixup/CutMix
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        hits = logits.argmax(-1) == _class_indices(labels)  # (B,)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=len(labels))
        top1 = hits.float().mean()
        self.log("train/acc", top1, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(labels))
        return loss

    def _step(self, batch: tuple[Tensor | list[Tensor], Tensor], stage: str, metric: MulticlassAccuracy) -> None:
        images, labels = batch
        if self.hparams.eval_sizes and isinstance(images, (list, tuple)):
            raise ValueError("model.eval_sizes resizes batches of one image size; unset it with data.packing")
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        metric.update(logits, _class_indices(labels))
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=True, batch_size=len(labels))
        self.log(f"{stage}/acc", metric, prog_bar=True)
        for size in self.hparams.eval_sizes or ():
            resized = F.interpolate(images, size=(size, size), mode="bilinear", antialias=size < images.shape[-1])
            logits = self(resized)
            accuracy = self.size_acc[f"{stage}_{size}"]
            accuracy.update(logits, _class_indices(labels))
            loss = F.cross_entropy(logits, labels)
            self.log(f"{stage}/loss@{size}px", loss, sync_dist=True, batch_size=len(labels))
            self.log(f"{stage}/acc@{size}px", accuracy)

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx):
        self._step(batch, "test", self.test_acc)

    def predict_step(self, batch, batch_idx) -> dict[str, Tensor]:
        """Per image: predicted ``label`` and its probability ``score`` (and ``target`` when the batch has labels)."""
        labelled = isinstance(batch, (tuple, list))
        score, label = self(batch[0] if labelled else batch).softmax(-1).max(-1)
        return {"label": label, "score": score, **({"target": batch[1]} if labelled else {})}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = optim.adamw(self.model, hp.lr, hp.weight_decay, layer_decay=hp.layer_decay)
        schedule = optim.schedule(
            optimizer, self.trainer, "cosine", warmup_epochs=hp.warmup_epochs, min_ratio=hp.min_lr_ratio
        )
        return {"optimizer": optimizer, "lr_scheduler": schedule}


def _class_indices(labels: Tensor) -> Tensor:
    """(B,) class indices from class indices or (B, K) soft targets."""
    return labels if labels.ndim == 1 else labels.argmax(-1)
