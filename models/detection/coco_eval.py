"""COCO evaluation of detections: results records and COCOeval (pycocotools or faster-coco-eval)."""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

from torch import Tensor

from models.detection.box_ops import box_xyxy_to_xywh

Detections = dict[int, dict[str, Tensor]]  # image id -> {"boxes" (N, 4) xyxy, "scores" (N,), "labels" (N,)}
COCO_STATS = (
    "AP",
    "AP50",
    "AP75",
    "AP_small",
    "AP_medium",
    "AP_large",
    "AR1",
    "AR10",
    "AR100",
    "AR_small",
    "AR_medium",
    "AR_large",
)


def to_coco_results(detections: Detections, category_ids: list[int]) -> list[dict[str, Any]]:
    """Detections -> COCO results records (``image_id``, ``category_id``, ``bbox`` xywh, ``score``)."""
    records = []
    for image_id, det in sorted(detections.items()):
        for box, score, label in zip(
            box_xyxy_to_xywh(det["boxes"]).tolist(), det["scores"].tolist(), det["labels"].tolist()
        ):
            records.append(
                {
                    "image_id": int(image_id),
                    "category_id": category_ids[label],
                    "bbox": [round(v, 2) for v in box],
                    "score": round(score, 5),
                }
            )
    return records


def coco_evaluate(
    coco_gt, results: list[dict[str, Any]], image_ids: list[int], backend: str = "pycocotools", verbose: bool = False
) -> dict[str, float]:
    """COCO bbox metrics (AP, AP50, ..., AR100; -1 where the split has no such boxes) over ``image_ids``.

    ``backend``: "pycocotools" (the reference) or "faster_coco_eval" (same numbers, faster; used when
    installed, otherwise pycocotools with a warning). ``verbose`` prints COCOeval's table.
    """
    if not results:
        return {k: 0.0 for k in COCO_STATS}
    if backend == "faster_coco_eval":
        try:
            from faster_coco_eval import COCO
            from faster_coco_eval import COCOeval_faster as COCOeval
        except ImportError:
            warnings.warn(
                "coco_backend='faster_coco_eval' is not installed (pip install faster-coco-eval); using pycocotools, the same numbers, slower",
                stacklevel=2,
            )
            backend = "pycocotools"
        else:
            gt = COCO()
            gt.dataset = coco_gt.dataset
            gt.createIndex()
            coco_gt = gt
    if backend == "pycocotools":
        from pycocotools.cocoeval import COCOeval
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        evaluator = COCOeval(coco_gt, coco_gt.loadRes(results), "bbox")
        evaluator.params.imgIds = sorted(image_ids)
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    if verbose:
        print("\n".join(line for line in out.getvalue().splitlines() if line.startswith(" Average")))
    return {k: float(v) for k, v in zip(COCO_STATS, evaluator.stats)}
