"""LightningModule that trains DETR and evaluates COCO mAP.

Batches are (images (B, 3, H, W), mask (B, H, W) True at padding, targets: B dicts) as the
detection DataModules make them. COCO evaluation reads the ground truth from the dataset of the
running dataloader (``coco``, ``category_ids``), so the model never imports a DataModule. Drawings
and `attnlab predict`'s files are callbacks (`experiments.callbacks.detection`).
"""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor

from models import optim
from models.detection.coco_eval import Detections, coco_evaluate, to_coco_results
from models.detection.criterion import SetCriterion
from models.detection.detr import build_detr, post_process
from models.detection.matcher import HungarianMatcher
from models.detection.pretrained import load_detr_weights
from models.distributed import clip_gradients, gather_objects


class ObjectDetector(pl.LightningModule):
    """DETR trained with the Hungarian set loss; COCO mAP on the validation and test splits.

    Defaults are the reference's (Carion et al. 2020, facebookresearch/detr main.py): the network's are
    `models.detection.detr.build_detr`'s and `DETR`'s; matcher and loss weights 1 / 5 / 2, eos_coef 0.1, AdamW lr
    1e-4 (backbone 1e-5), weight decay 1e-4, lr ×0.1 after epoch 200 are here. Put
    ``gradient_clip_val: 0.1`` in the trainer (the reference clips at 0.1). Weight decay applies to
    matrices only (project convention; the reference decays every tensor).

    Args:
        **network: the arguments of `models.detection.detr.build_detr`: the backbone's (``backbone``,
            ``backbone_out_index``, ...) and `DETR`'s (``d_model``, ``num_queries``, ``query_type``,
            ``class_loss``, ``dn_number``, ...; its docstring holds them, its signature their defaults);
            ``num_classes`` is linked from the DataModule.
        lr, weight_decay: AdamW's, for everything but the trunk.
        lr_backbone: the trunk's learning rate; 0 freezes the trunk (as the reference does).
        schedule: "step" (the reference: ×0.1 after ``lr_drop_epoch``) or "cosine" (``warmup_steps`` of
            linear warmup, then a cosine down to ``min_lr_ratio`` · lr).
        cost_class, cost_bbox, cost_giou: the `HungarianMatcher`'s weights.
        ce_loss_coef, bbox_loss_coef, giou_loss_coef, eos_coef: the `SetCriterion`'s weights.
        focal_alpha: the focal loss's α, in the loss and the matcher (with ``class_loss="focal"``).
        coco_backend: "pycocotools" or "faster_coco_eval".
        init_from: weights of a whole pretrained detector for the architecture set here: a
            facebookresearch/detr ``.pth``, a Hugging Face ``save_pretrained`` folder or hub name
            (``facebook/detr-resnet-50``), or an attnlab ``.ckpt`` (see models.detection.pretrained). The class
            head and the queries are re-initialised when their counts differ from the file's.
    Logged: train/loss (weighted total), train/loss_ce, train/loss_bbox, train/loss_giou,
    train/class_error, train/cardinality_error, the same under val/, and val/AP, val/AP50, val/AP75,
    val/AP_small, val/AP_medium, val/AP_large, val/AR100 (test/ likewise).
    """

    def __init__(
        self,
        lr: float = 1e-4,
        lr_backbone: float = 1e-5,
        weight_decay: float = 1e-4,
        schedule: Literal["step", "cosine"] = "step",
        lr_drop_epoch: int = 200,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.01,
        cost_class: float = 1.0,
        cost_bbox: float = 5.0,
        cost_giou: float = 2.0,
        ce_loss_coef: float = 1.0,
        bbox_loss_coef: float = 5.0,
        giou_loss_coef: float = 2.0,
        eos_coef: float = 0.1,
        focal_alpha: float = 0.25,
        coco_backend: Literal["pycocotools", "faster_coco_eval"] = "pycocotools",
        init_from: str | None = None,
        **network,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = model = build_detr(**network)
        if lr_backbone == 0:  # no learning rate: the trunk is frozen, as the reference does
            model.backbone.requires_grad_(False)
        if init_from:
            load_detr_weights(model, init_from)
        matcher = HungarianMatcher(cost_class, cost_bbox, cost_giou, focal=model.focal, focal_alpha=focal_alpha)
        weights = {"loss_ce": ce_loss_coef, "loss_bbox": bbox_loss_coef, "loss_giou": giou_loss_coef}
        self.criterion = SetCriterion(
            model.num_classes,
            matcher,
            eos_coef,
            weights,
            num_aux=len(model.transformer.decoder.layers) - 1 if model.aux_loss else 0,
            focal_alpha=focal_alpha if model.focal else None,
            denoising=model.dn_number > 0,
            encoder=model.query_type == "encoder",
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
            self.log("train/loss", total, on_step=True, on_epoch=False, prog_bar=True)
            self.log_dict(logged, on_step=True, on_epoch=False)
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
            self.log(f"{stage}/{key}", stats[key], sync_dist=True)  # equal on every rank: the mean changes nothing

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
