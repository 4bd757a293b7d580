"""Box conversions and (generalised) IoU, as in DETR's ``util/box_ops.py``.

Formats: ``cxcywh`` (centre x, centre y, width, height; DETR predicts these, normalised to [0, 1])
and ``xyxy`` (corners; torchvision, evaluation). COCO files store ``xywh`` (top-left corner, size).
"""

from __future__ import annotations

import torch
from torch import Tensor


def box_cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """(..., 4) cx, cy, w, h -> (..., 4) x0, y0, x1, y1."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack((cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h), dim=-1)


def box_xyxy_to_cxcywh(boxes: Tensor) -> Tensor:
    """(..., 4) x0, y0, x1, y1 -> (..., 4) cx, cy, w, h."""
    x0, y0, x1, y1 = boxes.unbind(-1)
    return torch.stack(((x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0), dim=-1)


def box_xywh_to_xyxy(boxes: Tensor) -> Tensor:
    """(..., 4) COCO x, y, w, h -> (..., 4) x0, y0, x1, y1."""
    x, y, w, h = boxes.unbind(-1)
    return torch.stack((x, y, x + w, y + h), dim=-1)


def box_xyxy_to_xywh(boxes: Tensor) -> Tensor:
    """(..., 4) x0, y0, x1, y1 -> (..., 4) COCO x, y, w, h."""
    x0, y0, x1, y1 = boxes.unbind(-1)
    return torch.stack((x0, y0, x1 - x0, y1 - y0), dim=-1)


def box_area(boxes: Tensor) -> Tensor:
    """(..., 4) xyxy -> (...) areas."""
    return (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])


def box_iou(boxes1: Tensor, boxes2: Tensor) -> tuple[Tensor, Tensor]:
    """Pairwise IoU and union of xyxy boxes: (..., N, 4), (..., M, 4) -> iou (..., N, M), union (..., N, M).

    Leading dims broadcast (a batch of images, each with its own boxes). A pair of zero-area boxes
    has union 0 and IoU 0 (not NaN).
    """
    area1, area2 = box_area(boxes1), box_area(boxes2)
    lt = torch.max(boxes1[..., :, None, :2], boxes2[..., None, :, :2])  # (..., N, M, 2)
    rb = torch.min(boxes1[..., :, None, 2:], boxes2[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]  # (..., N, M)
    union = area1[..., :, None] + area2[..., None, :] - inter
    return inter / union.clamp(min=torch.finfo(union.dtype).tiny), union


def generalized_box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise generalised IoU (Rezatofighi et al. 2019) of xyxy boxes: (..., N, 4), (..., M, 4) ->
    (..., N, M) in [-1, 1], leading dims broadcast as in `box_iou`.

    GIoU = IoU - (|C| - |A ∪ B|) / |C|, with C the smallest box enclosing A and B. Boxes must
    have x1 >= x0 and y1 >= y0 (DETR's sigmoid outputs and the data pipeline guarantee it);
    unlike the reference there is no assert, so a diverging run reports NaN losses instead of dying.
    """
    iou, union = box_iou(boxes1, boxes2)
    lt = torch.min(boxes1[..., :, None, :2], boxes2[..., None, :, :2])
    rb = torch.max(boxes1[..., :, None, 2:], boxes2[..., None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    enclosing = wh[..., 0] * wh[..., 1]  # (..., N, M)
    return iou - (enclosing - union) / enclosing.clamp(min=torch.finfo(enclosing.dtype).tiny)


def inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    """logit(x) = log(x / (1 - x)), with x and 1 - x kept >= ``eps`` so that boxes touching the image
    border (0 or 1) stay finite; the anchor refinement of DAB-DETR adds box deltas in this space."""
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))
