"""Hungarian matching between DETR's predictions and the ground-truth boxes (Carion et al. 2020)."""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from models.detection.box_ops import box_cxcywh_to_xyxy, generalized_box_iou


class HungarianMatcher(nn.Module):
    """One-to-one assignment of queries to targets that minimises the matching cost.

    cost = cost_class · (−p(target class)) + cost_bbox · L1(boxes) + cost_giou · (−GIoU(boxes)),
    with the paper's weights 1 / 5 / 2 as `ObjectDetector`'s defaults. The costs of all images (and,
    with `match_layers`, of all decoder layers) are computed together, each image's queries against
    its own targets only; the assignment is then solved per image with ``scipy.optimize.linear_sum_assignment``. There are more
    queries than targets, so every target is matched and the unmatched queries are trained towards
    "no object".

    Targets are expected without crowd boxes: the data pipeline drops them, as DETR's does.

    With ``focal=True`` (sigmoid classes, Deformable DETR / DAB-DETR) the class term is the focal
    loss of calling the query positive minus that of calling it negative, for the target class:
    α(1 − p)^γ(−log p) − (1 − α)p^γ(−log(1 − p)), with p the class's sigmoid probability.

    Args:
        cost_class, cost_bbox, cost_giou: weights of the three terms (at least one non-zero).
        focal, focal_alpha, focal_gamma: the focal class cost and its α, γ (0.25 and 2, as the papers).
    Shapes:
        outputs["pred_logits"] (B, Q, K + 1), outputs["pred_boxes"] (B, Q, 4) normalised cxcywh, and
        optionally outputs["padding"] (B, Q) True at queries that no target may take (the encoder's padded
        cells, `models.detection.query_selection`);
        targets: B dicts with "labels" (T_b,) and "boxes" (T_b, 4) normalised cxcywh.
    Returns: B pairs (query indices, target indices), each int64 of length min(Q, T_b) (Q counting the
    queries that may be taken), on the predictions' device.
    """

    def __init__(
        self,
        cost_class: float,
        cost_bbox: float,
        cost_giou: float,
        focal: bool = False,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
    ):
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError(
                "HungarianMatcher: cost_class, cost_bbox and cost_giou are all 0; at least one must be non-zero"
            )
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.focal, self.focal_alpha, self.focal_gamma = focal, focal_alpha, focal_gamma

    @torch.no_grad()
    def cost_matrix(self, outputs: dict[str, Tensor], targets: list[dict[str, Tensor]]) -> Tensor:
        """(..., B, Q, T) matching cost of every query of image b against every target of image b.

        T is the largest target count of the batch: image b's own targets are columns ``:T_b``, the
        rest is padding. Only these per-image blocks are computed, not the cost of each query against
        the targets of other images. Leading dims of the predictions (stacked decoder layers) carry
        through, so that every layer of a step is matched from one computation.
        """
        logits, boxes = (
            outputs["pred_logits"].float(),
            outputs["pred_boxes"].float(),
        )  # (..., B, Q, K + 1), (..., B, Q, 4)
        labels = pad_sequence([t["labels"] for t in targets], batch_first=True)  # (B, T)
        tgt_boxes = pad_sequence([t["boxes"] for t in targets], batch_first=True).to(boxes.dtype)  # (B, T, 4)
        index = labels[:, None, :].expand(*logits.shape[:-1], -1)  # (..., B, Q, T)
        if self.focal:
            p = logits.sigmoid().gather(-1, index)
            a, g = self.focal_alpha, self.focal_gamma
            cost_class = a * (1 - p) ** g * -(p + 1e-8).log() - (1 - a) * p**g * -(1 - p + 1e-8).log()
        else:
            # 1 - p(class) is approximated by -p(class): the constant does not change the assignment
            cost_class = -logits.softmax(-1).gather(-1, index)
        cost_bbox = torch.cdist(boxes, tgt_boxes.expand(*boxes.shape[:-2], -1, -1), p=1)
        cost_giou = -generalized_box_iou(box_cxcywh_to_xyxy(boxes), box_cxcywh_to_xyxy(tgt_boxes))
        return self.cost_bbox * cost_bbox + self.cost_class * cost_class + self.cost_giou * cost_giou

    @torch.no_grad()
    def forward(self, outputs: dict[str, Tensor], targets: list[dict[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        return self.match_layers([outputs], targets)[0]

    @torch.no_grad()
    def match_layers(
        self, layers: list[dict[str, Tensor]], targets: list[dict[str, Tensor]]
    ) -> list[list[tuple[Tensor, Tensor]]]:
        """Match several prediction sets against the same targets (DETR's final and auxiliary decoder
        outputs): one cost computation and one copy to the CPU for all of them, rather than one per layer,
        which on a GPU are a few dozen kernel launches and a synchronisation each.
        Returns, per layer, what ``forward`` returns."""
        stacked = {key: torch.stack([o[key] for o in layers]) for key in ("pred_logits", "pred_boxes")}  # (L, B, Q, ·)
        cost = self.cost_matrix(stacked, targets).cpu()  # (L, B, Q, T)
        sizes = [len(t["boxes"]) for t in targets]
        # a padded cell's cost is finite (its blocked class, its box beside the image), so it could still win
        # a target at the image's edge; it is left out of the assignment instead
        padding = layers[0].get("padding")  # (B, Q)
        free = [None] * len(targets) if padding is None else [(~p).nonzero()[:, 0] for p in padding.cpu()]
        pairs = [[self._assign(c[b, :, : sizes[b]], free[b]) for b in range(len(targets))] for c in cost]
        # one copy of every index to the predictions' device: the losses then index there without
        # waiting for a copy of their own (from pageable memory, each such copy waits for the GPU)
        flat = [t for layer in pairs for pair in layer for t in pair]
        parts = iter(torch.cat(flat).to(stacked["pred_logits"].device).split([len(t) for t in flat]))
        return [[(next(parts), next(parts)) for _ in layer] for layer in pairs]

    @staticmethod
    def _assign(cost: Tensor, free: Tensor | None) -> tuple[Tensor, Tensor]:
        """cost (Q, T) -> (query indices, target indices); only the queries ``free`` (None: all) are assigned."""
        rows, cols = linear_sum_assignment((cost if free is None else cost[free]).numpy())
        rows = torch.as_tensor(rows, dtype=torch.int64)
        return (rows if free is None else free[rows]), torch.as_tensor(cols, dtype=torch.int64)
