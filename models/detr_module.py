"""LightningModule that trains DETR, evaluates COCO mAP, and writes detections.

Batches are (images (B, 3, H, W), mask (B, H, W) True at padding, targets: B dicts) as the
detection DataModules make them. COCO evaluation and drawing read the ground truth and image
files from the dataset of the running dataloader (``coco``, ``category_ids``, ``class_names``,
``image_path(image_id)``), so the model never imports a DataModule.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.callbacks import BasePredictionWriter
from torch import Tensor
from torchvision.utils import draw_bounding_boxes

from models.attention import Similarity, capture_attention
from models.backbone import Backbone, BackboneNorm
from models.coco_eval import Detections, coco_evaluate, gather_detections, to_coco_results
from models.criterion import SetCriterion
from models.detr import DETR, ClassLoss, QueryType, post_process
from models.matcher import HungarianMatcher
from models.optim import param_groups, warmup_cosine

def draw_detections(image: Image.Image, det: dict[str, Tensor], class_names: list[str], score_threshold: float) -> Image.Image:
    """The image with the boxes scoring at least ``score_threshold``, labelled "name score"; small
    images are enlarged (pixels repeated) so that the labels stay readable."""
    scale = max(1, 256 // min(image.size))
    image = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.NEAREST)
    keep = det["scores"] >= score_threshold
    if not keep.any():
        return image
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (3, H, W) uint8
    labels = [f"{class_names[l]} {s:.2f}" for l, s in zip(det["labels"][keep].tolist(), det["scores"][keep].tolist())]
    drawn = draw_bounding_boxes(pixels, det["boxes"][keep].float() * scale, labels=labels, colors="yellow", width=2)
    return Image.fromarray(drawn.permute(1, 2, 0).numpy())


class ObjectDetector(pl.LightningModule):
    """DETR trained with the Hungarian set loss; COCO mAP on the validation and test splits.

    Defaults are the reference's (Carion et al. 2020, facebookresearch/detr main.py): ResNet-50 with
    frozen BatchNorm, D = 256, 8 heads, 6 + 6 layers, FFN 2048, dropout 0.1, 100 queries, matcher and
    loss weights 1 / 5 / 2, eos_coef 0.1, AdamW lr 1e-4 (backbone 1e-5), weight decay 1e-4, lr ×0.1
    after epoch 200. Put ``gradient_clip_val: 0.1`` in the trainer (the reference clips at 0.1).
    Weight decay applies to matrices only (project convention; the reference decays every tensor).

    Args (beyond the DETR ones documented in models.detr / models.backbone):
        num_classes: linked from the DataModule.
        backbone_weights: local state dict for the trunk; nothing is downloaded.
        lr_backbone: the trunk's learning rate; 0 freezes the trunk (as the reference does).
        schedule: "step" (the reference: ×0.1 after ``lr_drop_epoch``) or "cosine" (warmup + cosine).
        coco_backend: "pycocotools" or "faster_coco_eval".
        num_log_images: validation images drawn with predictions and the top queries' decoder
            cross-attention, each evaluation, under <log dir>/val_images/ (and to W&B when used).
        query_type, class_loss, dn_number, dn_label_noise, dn_box_noise: the convergence techniques
            (DAB-DETR anchor queries, focal classes, DN-DETR denoising; see models.detr); the defaults
            are the paper's DETR. focal_alpha: the focal loss's α, in the loss and the matcher.
    Logged: train/loss (weighted total), train/loss_ce, train/loss_bbox, train/loss_giou,
    train/class_error, train/cardinality_error, the same under val/, and val/AP, val/AP50, val/AP75,
    val/AP_small, val/AP_medium, val/AP_large, val/AR100 (test/ likewise).
    """

    def __init__(
        self,
        num_classes: int = 91,
        backbone: str = "resnet50",
        backbone_out_index: int = 4,
        backbone_norm: BackboneNorm = "frozen_bn",
        trainable_backbone_layers: int = 3,
        backbone_weights: str | None = None,
        backbone_kwargs: dict[str, Any] | None = None,
        d_model: int = 256,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        similarity: Similarity = "scaled_dot",
        num_queries: int = 100,
        aux_loss: bool = True,
        cost_class: float = 1.0,
        cost_bbox: float = 5.0,
        cost_giou: float = 2.0,
        ce_loss_coef: float = 1.0,
        bbox_loss_coef: float = 5.0,
        giou_loss_coef: float = 2.0,
        eos_coef: float = 0.1,
        lr: float = 1e-4,
        lr_backbone: float = 1e-5,
        weight_decay: float = 1e-4,
        schedule: Literal["step", "cosine"] = "step",
        lr_drop_epoch: int = 200,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.01,
        coco_backend: Literal["pycocotools", "faster_coco_eval"] = "pycocotools",
        num_log_images: int = 4,
        log_score_threshold: float = 0.5,
        query_type: QueryType = "vanilla",
        class_loss: ClassLoss = "ce",
        focal_alpha: float = 0.25,
        dn_number: int = 0,
        dn_label_noise: float = 0.2,
        dn_box_noise: float = 0.4,
    ):
        super().__init__()
        self.save_hyperparameters()
        trunk = Backbone(backbone, backbone_out_index, backbone_norm, trainable_backbone_layers if lr_backbone > 0 else 0,
                         backbone_weights, **(backbone_kwargs or {}))
        self.model = DETR(trunk, num_classes, num_queries, d_model, nhead, num_encoder_layers, num_decoder_layers,
                          dim_feedforward, dropout, similarity=similarity, aux_loss=aux_loss, query_type=query_type, class_loss=class_loss,
                          dn_number=dn_number, dn_label_noise=dn_label_noise, dn_box_noise=dn_box_noise)
        focal = class_loss == "focal"
        matcher = HungarianMatcher(cost_class, cost_bbox, cost_giou, focal=focal, focal_alpha=focal_alpha)
        weights = {"loss_ce": ce_loss_coef, "loss_bbox": bbox_loss_coef, "loss_giou": giou_loss_coef}
        self.criterion = SetCriterion(num_classes, matcher, eos_coef, weights, num_aux=num_decoder_layers - 1 if aux_loss else 0,
                                      focal_alpha=focal_alpha if focal else None, denoising=dn_number > 0)
        self._detections: Detections = {}
        self._log_batch: tuple[Tensor, Tensor, list[dict]] | None = None

    def forward(self, images: Tensor, mask: Tensor | None = None, targets: list[dict] | None = None) -> dict:
        return self.model(images, mask, targets)

    def _losses(self, batch, stage: str) -> tuple[dict, Tensor]:
        images, mask, targets = batch
        outputs = self(images, mask, targets)  # targets feed the denoising queries, in training only
        losses = self.criterion(outputs, targets)
        total = self.criterion.total(losses)
        on_step = stage == "train"
        logged = {f"{stage}/{k}": v.detach() for k, v in losses.items() if not k[-1].isdigit()}  # aux terms stay out of the logs
        self.log(f"{stage}/loss", total, on_step=on_step, on_epoch=True, prog_bar=True, sync_dist=not on_step, batch_size=len(targets))
        self.log_dict(logged, on_step=on_step, on_epoch=True, sync_dist=not on_step, batch_size=len(targets))
        return outputs, total

    def training_step(self, batch, batch_idx):
        return self._losses(batch, "train")[1]

    def _eval_step(self, batch, batch_idx: int, stage: str) -> None:
        outputs, _ = self._losses(batch, stage)
        targets = batch[2]
        results = post_process(outputs, torch.stack([t["orig_size"] for t in targets]))
        for t, r in zip(targets, results):
            self._detections[int(t["image_id"])] = {k: v.cpu() for k, v in r.items()}
        n = self.hparams.num_log_images
        if batch_idx == 0 and stage == "val" and n > 0:
            self._log_batch = (batch[0][:n], batch[1][:n], targets[:n])

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, batch_idx, "test")

    def on_validation_epoch_start(self) -> None:
        self._detections, self._log_batch = {}, None

    on_test_epoch_start = on_validation_epoch_start

    def _evaluate(self, stage: str, dataset) -> None:
        """COCOeval on rank 0 over the detections of every process, then the numbers broadcast."""
        detections = gather_detections(self._detections)
        stats = None
        if self.trainer.is_global_zero:
            results = to_coco_results(detections, dataset.category_ids)
            stats = coco_evaluate(dataset.coco, results, list(detections), self.hparams.coco_backend, verbose=stage == "test")
        stats = self.trainer.strategy.broadcast(stats, src=0)
        for key in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR100"):
            self.log(f"{stage}/{key}", stats[key], sync_dist=False)

    def setup(self, stage: str) -> None:
        # trainer.log_dir broadcasts from rank 0: resolve it on every rank, not in the rank-0-only image logging
        self._image_dir = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "val_images"

    def on_validation_epoch_end(self) -> None:
        dataset = self.trainer.val_dataloaders.dataset
        if self.trainer.sanity_checking or getattr(dataset, "coco", None) is None:
            return
        self._evaluate("val", dataset)
        if self.trainer.is_global_zero and self._log_batch is not None and hasattr(dataset, "image_path"):
            self._log_images(dataset)

    def on_test_epoch_end(self) -> None:
        dataset = self.trainer.test_dataloaders.dataset
        if getattr(dataset, "coco", None) is not None:
            self._evaluate("test", dataset)

    @torch.no_grad()
    def _log_images(self, dataset) -> None:
        """Predictions and the last decoder layer's cross-attention (head mean) of the 3 best queries."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        images, mask, targets = self._log_batch
        cross_attn = self.model.transformer.decoder.layers[-1].multihead_attn
        with capture_attention(cross_attn) as maps:
            outputs = self(images, mask)
        weights = maps[""][0].mean(1)  # (B, N, h·w)
        feat_mask = torch.nn.functional.interpolate(mask[None].float(), size=self.model.backbone(images).shape[-2:]).bool()[0]  # (B, h, w)
        results = post_process(outputs, torch.stack([t["orig_size"] for t in targets]))
        folder = self._image_dir
        folder.mkdir(parents=True, exist_ok=True)
        paths = []
        for b, (t, r) in enumerate(zip(targets, results)):
            image_id = int(t["image_id"])
            with Image.open(dataset.image_path(image_id)) as raw:
                image = raw.convert("RGB")
            top = r["scores"].topk(min(3, len(r["scores"]))).indices
            h, w = int((~feat_mask[b, :, 0]).sum()), int((~feat_mask[b, 0, :]).sum())
            fig, axes = plt.subplots(1, 1 + len(top), figsize=(3 * (1 + len(top)), 3))
            axes[0].imshow(draw_detections(image, {k: v.cpu() for k, v in r.items()}, dataset.class_names, self.hparams.log_score_threshold))
            axes[0].set_title(f"image {image_id}")
            for ax, q in zip(axes[1:], top.tolist()):
                attn = weights[b, q].view(feat_mask.shape[1:])[:h, :w].cpu()  # the image's cells, padding cut off
                ax.imshow(image)
                ax.imshow(attn, cmap="viridis", alpha=0.6, extent=(0, image.width, image.height, 0), interpolation="bilinear")
                ax.set_title(f"query {q}: {dataset.class_names[int(r['labels'][q])]} {float(r['scores'][q]):.2f}", fontsize=8)
            for ax in axes:
                ax.axis("off")
            path = folder / f"epoch{self.current_epoch:04d}_image{image_id}.png"
            fig.savefig(path, dpi=80, bbox_inches="tight")
            plt.close(fig)
            paths.append(str(path))
        for logger in self.loggers:
            if hasattr(logger, "log_image"):  # W&B
                logger.log_image(key="val/detections", images=paths, step=self.global_step)

    def predict_step(self, batch, batch_idx) -> list[dict[str, Any]]:
        images, mask, targets = batch
        results = post_process(self(images, mask), torch.stack([t["orig_size"] for t in targets]))
        return [{"image_id": int(t["image_id"]), **{k: v.cpu() for k, v in r.items()}} for t, r in zip(targets, results)]

    def configure_optimizers(self):
        hp = self.hparams
        trunk = {id(p) for p in self.model.backbone.parameters()}
        groups = []
        for group in param_groups(self.model, hp.weight_decay, self.model.no_weight_decay()):
            for lr, params in ((hp.lr, [p for p in group["params"] if id(p) not in trunk]), (hp.lr_backbone, [p for p in group["params"] if id(p) in trunk])):
                if params:
                    groups.append({"params": params, "weight_decay": group["weight_decay"], "lr": lr})
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, weight_decay=hp.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        if hp.schedule == "cosine":
            factor = warmup_cosine(hp.warmup_steps, total, hp.min_lr_ratio)
        else:
            epochs = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else None
            drop_step = math.ceil(hp.lr_drop_epoch * total / epochs) if epochs else total
            factor = _step_drop(hp.warmup_steps, drop_step)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _step_drop(warmup_steps: int, drop_step: int, gamma: float = 0.1):
    """The reference's StepLR as a per-step multiplier: optional linear warmup, ×gamma from ``drop_step``."""

    def factor(step: int) -> float:
        warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
        return warm * (gamma if step >= drop_step else 1.0)

    return factor


class DetectionWriter(BasePredictionWriter):
    """`attnlab predict` output: a COCO results JSON of every query's detection and, per image, a PNG
    with the detections scoring at least ``score_threshold``.

    Args:
        output_dir: folder for ``results.json`` and ``images/``; relative to trainer.default_root_dir.
        score_threshold: the lowest score drawn (the JSON keeps all, as COCO evaluation expects).
        max_images: how many images to draw (None: all).
    """

    def __init__(self, output_dir: str = "predictions", score_threshold: float = 0.5, max_images: int | None = None):
        super().__init__(write_interval="batch")
        self.output_dir, self.score_threshold, self.max_images = output_dir, score_threshold, max_images
        self._detections: Detections = {}

    def _folder(self, trainer: pl.Trainer) -> Path:
        folder = Path(self.output_dir)
        return folder if folder.is_absolute() else Path(trainer.default_root_dir) / folder

    def on_predict_start(self, trainer, pl_module) -> None:
        self._detections = {}
        (self._folder(trainer) / "images").mkdir(parents=True, exist_ok=True)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx) -> None:
        dataset = trainer.predict_dataloaders.dataset
        for det in prediction:
            image_id = det.pop("image_id")
            self._detections[image_id] = det
            if self.max_images is None or len(self._detections) <= self.max_images:
                with Image.open(dataset.image_path(image_id)) as raw:
                    drawn = draw_detections(raw, det, dataset.class_names, self.score_threshold)
                drawn.save(self._folder(trainer) / "images" / f"{Path(dataset.image_path(image_id)).stem}.png")

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        detections = gather_detections(self._detections)
        if trainer.is_global_zero:
            dataset = trainer.predict_dataloaders.dataset
            path = self._folder(trainer) / "results.json"
            path.write_text(json.dumps(to_coco_results(detections, dataset.category_ids)))
            print(f"attnlab: {len(detections)} images, detections written to {path} and {path.parent / 'images'}/")
