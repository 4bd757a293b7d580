"""What a detection run shows and writes: validation images with DETR's predictions and decoder cross-attention
(`DetectionImages`), and `attnlab predict`'s COCO results and drawings (`DetectionWriter`). Both read the images,
class names and COCO ids from the running dataloader's dataset (``image_path(image_id)``, ``class_names``,
``category_ids``), as `models.detection.module` does.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.callbacks import BasePredictionWriter
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor
from torchvision.utils import draw_bounding_boxes

from experiments.runfolder import write_json
from models.core.capture import capture_attention, kernel_without_weights
from models.detection.coco_eval import Detections, to_coco_results
from models.detection.detr import post_process
from models.distributed import full_weights, gather_objects


def draw_detections(
    image: Image.Image, det: dict[str, Tensor], class_names: list[str], score_threshold: float
) -> Image.Image:
    """The image with the boxes scoring at least ``score_threshold``, labelled "name score"; small images are
    enlarged (pixels repeated) so that the labels stay readable."""
    scale = max(1, 256 // min(image.size))
    image = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.NEAREST)
    keep = det["scores"] >= score_threshold
    if not keep.any():
        return image
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (3, H, W) uint8
    labels = [f"{class_names[l]} {s:.2f}" for l, s in zip(det["labels"][keep].tolist(), det["scores"][keep].tolist())]
    drawn = draw_bounding_boxes(pixels, det["boxes"][keep].float() * scale, labels=labels, colors="yellow", width=2)
    return Image.fromarray(drawn.permute(1, 2, 0).numpy())


class DetectionImages(pl.Callback):
    """At each validation (not the sanity check), the first ``num_images`` images of the first batch with the
    predictions scoring at least ``score_threshold``, and the last decoder layer's cross-attention (head mean) of
    the 3 best queries over the image: one PNG per image, ``<log dir>/val_images/epoch<E>_image<id>.png``, also
    logged to W&B as ``val/detections``. The forward pass runs on every process, which FSDP needs; rank 0 draws.
    A kernel of one's own that returns no attention weights (``attention.kernel``) gets the detections alone.
    """

    def __init__(self, num_images: int = 4, score_threshold: float = 0.5):
        if num_images < 1:
            raise ValueError(f"DetectionImages: num_images={num_images} must be >= 1 (leave the callback out for none)")
        self.num_images, self.score_threshold = num_images, score_threshold

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # trainer.log_dir broadcasts from rank 0: resolve it on every rank, never in rank-0-only code
        self._folder = Path(trainer.log_dir or trainer.default_root_dir) / "val_images"
        self._no_weights = kernel_without_weights(pl_module)
        if self._no_weights:
            rank_zero_warn(f"DetectionImages draws the detections without attention: {self._no_weights}")

    @torch.no_grad()
    def on_validation_batch_end(
        self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        dataset = trainer.val_dataloaders.dataset
        if batch_idx or dataloader_idx or trainer.sanity_checking or not hasattr(dataset, "image_path"):
            return
        images, mask, targets = (part[: self.num_images] for part in batch)
        model = pl_module.model
        feature_hw: list[tuple[int, int]] = []
        handle = model.backbone.register_forward_hook(lambda m, args, out: feature_hw.append(tuple(out.shape[-2:])))
        layer = model.transformer.decoder.layers[-1].multihead_attn
        capture = nullcontext({"": []}) if self._no_weights else capture_attention(layer, scores=True)
        try:
            with full_weights(trainer.model), capture as maps:
                outputs = model(images, mask)
        finally:
            handle.remove()
        if trainer.is_global_zero:
            hw, attention = feature_hw[0][0] * feature_hw[0][1], [(None, None)] * len(targets)
            if maps[""]:  # the memory's registers come after the h·w cells
                scores = maps[""][0]
                padded = scores.blocked[:, 0, 0, :hw].view(-1, *feature_hw[0])  # (B, h, w) True at the padding
                attention = list(zip(scores.weights.mean(1)[..., :hw], padded))  # weights (N, h·w)
            results = post_process(outputs, torch.stack([t["orig_size"] for t in targets]))
            paths = [
                self._draw(dataset, t, r, *cells, trainer.current_epoch)
                for t, r, cells in zip(targets, results, attention)
            ]
            for logger in trainer.loggers:
                if hasattr(logger, "log_image"):  # W&B
                    logger.log_image(key="val/detections", images=paths, step=trainer.global_step)

    def _draw(
        self,
        dataset,
        target: dict,
        result: dict[str, Tensor],
        weights: Tensor | None,
        padded: Tensor | None,
        epoch: int,
    ) -> str:
        """One image's PNG: the detections, then one panel per best query with its attention over the image (none
        when ``weights`` is None)."""
        from matplotlib.figure import Figure  # no pyplot: no global backend, nothing to close

        image_id = int(target["image_id"])
        with Image.open(dataset.image_path(image_id)) as raw:
            image = raw.convert("RGB")
        top = result["scores"].topk(0 if weights is None else min(3, len(result["scores"]))).indices
        fig = Figure(figsize=(3 * (1 + len(top)), 3))
        axes = fig.subplots(1, 1 + len(top), squeeze=False)[0]
        axes[0].imshow(
            draw_detections(image, {k: v.cpu() for k, v in result.items()}, dataset.class_names, self.score_threshold)
        )
        axes[0].set_title(f"image {image_id}")
        extent = (0, image.width, image.height, 0)
        for ax, q in zip(axes[1:], top.tolist()):
            h, w = int((~padded[:, 0]).sum()), int((~padded[0, :]).sum())  # the image's cells, padding cut off
            attn = weights[q].view(padded.shape)[:h, :w].cpu()
            ax.imshow(image)
            ax.imshow(attn, cmap="viridis", alpha=0.6, extent=extent, interpolation="bilinear")
            label = f"{dataset.class_names[int(result['labels'][q])]} {float(result['scores'][q]):.2f}"
            ax.set_title(f"query {q}: {label}", fontsize=8)
        for ax in axes:
            ax.axis("off")
        self._folder.mkdir(parents=True, exist_ok=True)
        path = self._folder / f"epoch{epoch:04d}_image{image_id}.png"
        fig.savefig(path, dpi=80, bbox_inches="tight")
        return str(path)


class DetectionWriter(BasePredictionWriter):
    """`attnlab predict` output in ``output_dir`` (under ``trainer.default_root_dir`` when relative): ``results.json``
    with every query's detection, as COCO evaluation expects, and for the first ``max_images`` images (None: all)
    a PNG in ``images/`` with the detections scoring at least ``score_threshold``.
    """

    def __init__(self, output_dir: str = "predictions", score_threshold: float = 0.5, max_images: int | None = None):
        super().__init__(write_interval="batch")
        self.output_dir, self.score_threshold, self.max_images = output_dir, score_threshold, max_images
        self._detections: Detections = {}

    def on_predict_start(self, trainer, pl_module) -> None:
        self._detections = {}
        self._images = Path(trainer.default_root_dir) / self.output_dir / "images"  # an absolute output_dir stays
        self._images.mkdir(parents=True, exist_ok=True)

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        dataset = trainer.predict_dataloaders.dataset
        for det in prediction:
            image_id = det.pop("image_id")
            self._detections[image_id] = det
            if self.max_images is None or len(self._detections) <= self.max_images:
                with Image.open(dataset.image_path(image_id)) as raw:
                    drawn = draw_detections(raw, det, dataset.class_names, self.score_threshold)
                drawn.save(self._images / f"{Path(dataset.image_path(image_id)).stem}.png")

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        # an image the distributed sampler repeated to even out the ranks is counted once
        detections = {i: d for part in gather_objects(self._detections) for i, d in part.items()}
        if trainer.is_global_zero:
            dataset = trainer.predict_dataloaders.dataset
            path = self._images.parent / "results.json"
            write_json(path, to_coco_results(detections, dataset.category_ids), indent=None)
            print(f"attnlab: {len(detections)} images, detections written to {path} and {self._images}/")
