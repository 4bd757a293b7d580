"""Hungarian matching between DETR's predictions and the ground-truth boxes (Carion et al. 2020)."""
from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from models.box_ops import box_cxcywh_to_xyxy, generalized_box_iou


class HungarianMatcher(nn.Module):
    """One-to-one assignment of queries to targets that minimises the matching cost.

    cost = cost_class · (−p(target class)) + cost_bbox · L1(boxes) + cost_giou · (−GIoU(boxes)),
    with the paper's weights 1 / 5 / 2. The cost of every (query, target) pair of the whole batch is
    computed as one matrix; the assignment is then solved per image with
    ``scipy.optimize.linear_sum_assignment``. There are more queries than targets, so every target is
    matched and the unmatched queries are trained towards "no object".

    Targets are expected without crowd boxes: the data pipeline drops them, as DETR's does.

    Args:
        cost_class, cost_bbox, cost_giou: weights of the three terms (at least one non-zero).
    Shapes:
        outputs["pred_logits"] (B, Q, K + 1), outputs["pred_boxes"] (B, Q, 4) normalised cxcywh;
        targets: B dicts with "labels" (T_b,) and "boxes" (T_b, 4) normalised cxcywh.
    Returns: B pairs (query indices, target indices), each int64 of length min(Q, T_b).
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0):
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher: cost_class, cost_bbox and cost_giou are all 0; at least one must be non-zero")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def cost_matrix(self, outputs: dict[str, Tensor], targets: list[dict[str, Tensor]]) -> Tensor:
        """(B, Q, ΣT_b) matching cost of every query against every target of the batch."""
        bs, num_queries = outputs["pred_logits"].shape[:2]
        prob = outputs["pred_logits"].flatten(0, 1).softmax(-1)  # (B·Q, K + 1)
        out_bbox = outputs["pred_boxes"].flatten(0, 1)  # (B·Q, 4)
        tgt_ids = torch.cat([t["labels"] for t in targets])  # (ΣT,)
        tgt_bbox = torch.cat([t["boxes"] for t in targets]).to(out_bbox.dtype)  # (ΣT, 4)
        # 1 - p(class) is approximated by -p(class): the constant does not change the assignment
        cost_class = -prob[:, tgt_ids]  # (B·Q, ΣT)
        cost_bbox = torch.cdist(out_bbox, tgt_bbox, p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(out_bbox), box_cxcywh_to_xyxy(tgt_bbox))
        cost = self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou
        return cost.view(bs, num_queries, -1)

    @torch.no_grad()
    def forward(self, outputs: dict[str, Tensor], targets: list[dict[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        cost = self.cost_matrix(outputs, targets).cpu()
        sizes = [len(t["boxes"]) for t in targets]
        indices = []
        for b, c in enumerate(cost.split(sizes, dim=-1)):  # the columns of image b, rows of image b only
            rows, cols = linear_sum_assignment(c[b].numpy())
            indices.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
        return indices
