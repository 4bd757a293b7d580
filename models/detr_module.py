"""LightningModule that trains DETR and evaluates COCO mAP.

Batches are (images (B, 3, H, W), mask (B, H, W) True at padding, targets: B dicts) as the
detection DataModules make them. COCO evaluation reads the ground truth from the dataset of the
running dataloader (``coco``, ``category_ids``), so the model never imports a DataModule. Drawings
and `attnlab predict`'s files are callbacks (`experiments.detection_callbacks`).
"""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor

from models import optim
from models.attention import Similarity
from models.backbone import Backbone, BackboneNorm
from models.coco_eval import Detections, coco_evaluate, to_coco_results
from models.criterion import SetCriterion
from models.detr import DETR, ClassLoss, QueryType, post_process
from models.detr_init import load_detr_weights
from models.distributed import clip_gradients, gather_objects
from models.matcher import HungarianMatcher
from models.training_log import log_training_step


class ObjectDetector(pl.LightningModule):
    """DETR trained with the Hungarian set loss; COCO mAP on the validation and test splits.

    Defaults are the reference's (Carion et al. 2020, facebookresearch/detr main.py): ResNet-50 with
    frozen BatchNorm, D = 256, 8 heads, 6 + 6 layers, FFN 2048, dropout 0.1, 100 queries, matcher and
    loss weights 1 / 5 / 2, eos_coef 0.1, AdamW lr 1e-4 (backbone 1e-5), weight decay 1e-4, lr ×0.1
    after epoch 200. Put ``gradient_clip_val: 0.1`` in the trainer (the reference clips at 0.1).
    Weight decay applies to matrices only (project convention; the reference decays every tensor).

    Args (beyond the DETR ones documented in models.detr / models.backbone):
        num_classes: linked from the DataModule.
        backbone_weights: local state dict for the trunk (ImageNet weights, say); never downloaded.
        backbone_pretrained: timm's ImageNet weights for ``backbone`` through timm's hub and cache
            (online, or offline once cached); offline and not cached, use ``backbone_weights``.
        init_from: weights of a whole pretrained detector for the architecture set here: a
            facebookresearch/detr ``.pth``, a Hugging Face ``save_pretrained`` folder or hub name
            (``facebook/detr-resnet-50``), or an attnlab ``.ckpt`` (see models.detr_init). The class
            head and the queries are re-initialised when their counts differ from the file's.
        lr_backbone: the trunk's learning rate; 0 freezes the trunk (as the reference does).
        schedule: "step" (the reference: ×0.1 after ``lr_drop_epoch``) or "cosine" (warmup + cosine).
        coco_backend: "pycocotools" or "faster_coco_eval".
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
        backbone_pretrained: bool = False,
        backbone_kwargs: dict[str, Any] | None = None,
        init_from: str | None = None,
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
        query_type: QueryType = "vanilla",
        class_loss: ClassLoss = "ce",
        focal_alpha: float = 0.25,
        dn_number: int = 0,
        dn_label_noise: float = 0.2,
        dn_box_noise: float = 0.4,
    ):
        super().__init__()
        self.save_hyperparameters()
        trunk = Backbone(
            backbone,
            backbone_out_index,
            backbone_norm,
            trainable_backbone_layers if lr_backbone > 0 else 0,
            backbone_weights,
            backbone_pretrained,
            **(backbone_kwargs or {}),
        )
        self.model = DETR(
            trunk,
            num_classes,
            num_queries,
            d_model,
            nhead,
            num_encoder_layers,
            num_decoder_layers,
            dim_feedforward,
            dropout,
            similarity=similarity,
            aux_loss=aux_loss,
            query_type=query_type,
            class_loss=class_loss,
            dn_number=dn_number,
            dn_label_noise=dn_label_noise,
            dn_box_noise=dn_box_noise,
        )
        if init_from:
            load_detr_weights(self.model, init_from)
        focal = class_loss == "focal"
        matcher = HungarianMatcher(cost_class, cost_bbox, cost_giou, focal=focal, focal_alpha=focal_alpha)
        weights = {"loss_ce": ce_loss_coef, "loss_bbox": bbox_loss_coef, "loss_giou": giou_loss_coef}
        self.criterion = SetCriterion(
            num_classes,
            matcher,
            eos_coef,
            weights,
            num_aux=num_decoder_layers - 1 if aux_loss else 0,
            focal_alpha=focal_alpha if focal else None,
            denoising=dn_number > 0,
        )
        self._detections: Detections = {}

    def forward(self, images: Tensor, mask: Tensor | None = None, targets: list[dict] | None = None) -> dict:
        return self.model(images, mask, targets)

    def _losses(self, batch, stage: str) -> tuple[dict, Tensor]:
        images, mask, targets = batch
        outputs = self(images, mask, targets)  # targets feed the denoising queries, in training only
        losses = self.criterion(outputs, targets)
        total = self.criterion.total(losses)
        logged = {
            f"{stage}/{k}": v.detach() for k, v in losses.items() if not k[-1].isdigit()
        }  # aux terms stay out of the logs
        if stage == "train":
            log_training_step(self, {"train/loss": total}, len(targets))
            log_training_step(self, logged, len(targets), prog_bar=False)
            return outputs, total
        self.log(f"{stage}/loss", total, prog_bar=True, sync_dist=True, batch_size=len(targets))
        self.log_dict(logged, sync_dist=True, batch_size=len(targets))
        return outputs, total

    def training_step(self, batch, batch_idx):
        return self._losses(batch, "train")[1]

    def _eval_step(self, batch, batch_idx: int, stage: str) -> None:
        outputs, _ = self._losses(batch, stage)
        targets = batch[2]
        results = post_process(outputs, torch.stack([t["orig_size"] for t in targets]))
        for t, r in zip(targets, results):
            self._detections[int(t["image_id"])] = {k: v.cpu() for k, v in r.items()}

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, batch_idx, "test")

    def on_validation_epoch_start(self) -> None:
        self._detections = {}

    on_test_epoch_start = on_validation_epoch_start

    def _evaluate(self, stage: str, dataset) -> None:
        """COCOeval on rank 0 over the detections of every process, then the numbers broadcast."""
        # an image the distributed sampler repeated to even out the ranks is counted once
        detections = {i: d for part in gather_objects(self._detections) for i, d in part.items()}
        stats = None
        if self.trainer.is_global_zero:
            results = to_coco_results(detections, dataset.category_ids)
            stats = coco_evaluate(
                dataset.coco, results, list(detections), self.hparams.coco_backend, verbose=stage == "test"
            )
        stats = self.trainer.strategy.broadcast(stats, src=0)
        for key in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR100"):
            self.log(f"{stage}/{key}", stats[key], sync_dist=False)

    def on_validation_epoch_end(self) -> None:
        dataset = self.trainer.val_dataloaders.dataset
        if self.trainer.sanity_checking or getattr(dataset, "coco", None) is None:
            return
        self._evaluate("val", dataset)

    def on_test_epoch_end(self) -> None:
        dataset = self.trainer.test_dataloaders.dataset
        if getattr(dataset, "coco", None) is not None:
            self._evaluate("test", dataset)

    def predict_step(self, batch, batch_idx) -> list[dict[str, Any]]:
        images, mask, targets = batch
        results = post_process(self(images, mask), torch.stack([t["orig_size"] for t in targets]))
        return [
            {"image_id": int(t["image_id"]), **{k: v.cpu() for k, v in r.items()}} for t, r in zip(targets, results)
        ]

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = optim.adamw(self.model, hp.lr, hp.weight_decay, trunk=self.model.backbone, lr_trunk=hp.lr_backbone)
        schedule = optim.schedule(
            optimizer,
            self.trainer,
            hp.schedule,
            hp.warmup_steps,
            min_ratio=hp.min_lr_ratio,
            drop_epoch=hp.lr_drop_epoch,
        )
        return {"optimizer": optimizer, "lr_scheduler": schedule}
