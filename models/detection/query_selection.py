"""Two-stage query selection (Deformable DETR's two-stage variant, Zhu et al. 2021; DINO, Zhang et al. 2022;
RT-DETR, Zhao et al. 2024): DETR's queries chosen among the encoder's own dense proposals.

Every feature cell of the encoder output proposes a class and a box, the box predicted relative to the cell
itself (``sigmoid(inverse_sigmoid(cell) + delta)``). The proposals are trained with the same set loss as a
decoder layer (`models.detection.criterion.SetCriterion`, terms ``_enc``), so every cell, and through it the trunk,
is supervised from the first step, where DETR's learned queries pass the trunk a signal only through the
few matched queries' cross-attention. The N unpadded cells with the most probable real class become the
decoder's queries: their memory, detached (RT-DETR), is the content and their boxes, detached, the anchors
that the decoder refines layer by layer as DAB-DETR's anchors (`models.detection.DETR`, ``query_type="encoder"``).
A padded cell is neither a query nor a candidate of the matcher.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from models.detection.box_ops import inverse_sigmoid


def cell_boxes(mask: Tensor) -> Tensor:
    """Each feature cell as a box in normalised cxcywh of the valid (unpadded) image region, the frame of
    the targets: mask (B, h, w) True at padding -> (B, h·w, 4); padded cells lie outside [0, 1]."""
    valid = ~mask
    valid_h, valid_w = valid[:, :, 0].sum(1), valid[:, 0, :].sum(1)  # (B,)
    h, w = mask.shape[-2:]
    ys = torch.arange(h, device=mask.device, dtype=torch.float32) + 0.5
    xs = torch.arange(w, device=mask.device, dtype=torch.float32) + 0.5
    size = torch.stack([1 / valid_w, 1 / valid_h], dim=-1).float()  # (B, 2): one cell's width and height
    cy, cx = torch.meshgrid(ys, xs, indexing="ij")  # (h, w)
    centres = torch.stack([cx, cy], dim=-1).flatten(0, 1)[None] * size[:, None]  # (B, h·w, 2)
    return torch.cat([centres, size[:, None].expand_as(centres)], dim=-1)


class EncoderProposals(nn.Module):
    """Per-cell class and box proposals, and the N best cells as queries.

    Args:
        box_head: the cells' box MLP, D -> 4 (DETR's ``MLP``); its last layer starts at zero, so that the
            first proposals are the cells themselves.
        d_model: D.
        num_classes: K; the classifier has K sigmoid outputs (``focal``) or K + 1 softmax outputs, the last
            "no object", like the decoder's.
        focal: sigmoid classes, the bias starting at a 1% prior (as the decoder's).
    Shapes: memory (B, h·w, D), mask (B, h·w) True at padding, cells (B, h·w, 4), see `cell_boxes` ->
        content (B, N, D), anchors (B, N, 4), proposals {``pred_logits`` (B, h·w, C), ``pred_boxes`` (B, h·w, 4),
        ``padding`` (B, h·w): the mask, for the matcher}.
    """

    def __init__(self, box_head: nn.Module, d_model: int, num_classes: int, focal: bool):
        super().__init__()
        self.focal = focal
        self.enc_output = nn.Sequential(nn.Linear(d_model, d_model), nn.LayerNorm(d_model))  # Deformable DETR's
        self.enc_class_embed = nn.Linear(d_model, num_classes if focal else num_classes + 1)
        self.enc_bbox_embed = box_head
        nn.init.zeros_(box_head.layers[-1].weight)
        nn.init.zeros_(box_head.layers[-1].bias)
        if focal:
            nn.init.constant_(self.enc_class_embed.bias, -math.log((1 - 0.01) / 0.01))

    def forward(
        self, memory: Tensor, mask: Tensor, cells: Tensor, num_queries: int
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        valid = (~mask).sum(1).tolist()  # unpadded cells per image; one wait for the device
        if min(valid) < num_queries:
            image = valid.index(min(valid))
            raise ValueError(
                f"model.num_queries={num_queries} exceeds the {min(valid)} feature cells of image {image} of this "
                "batch (its unpadded part): query_type='encoder' selects each image's queries among its unpadded "
                "cells; use fewer queries or larger images"
            )
        out = self.enc_output(memory.masked_fill(mask[..., None], 0.0))  # (B, h·w, D)
        logits = self.enc_class_embed(out)  # (B, h·w, C)
        boxes = (inverse_sigmoid(cells.clamp(max=1.0)).to(out.dtype) + self.enc_bbox_embed(out)).sigmoid()
        # the best real class's probability ranks a cell; sigmoid is monotone, so focal logits rank as they are,
        # while softmax's no-object share lowers a cell whatever its largest real logit
        score = logits.amax(-1) if self.focal else logits.softmax(-1)[..., :-1].amax(-1)  # (B, h·w)
        score = score.masked_fill(mask, float("-inf"))
        top = score.topk(num_queries, dim=1).indices[..., None]  # (B, N, 1)
        content = out.gather(1, top.expand(-1, -1, out.shape[-1])).detach()
        anchors = boxes.gather(1, top.expand(-1, -1, 4)).detach()
        # a padded cell is no candidate for the matcher (``padding``), and its class, no probability and (softmax)
        # certainly "no object", is no loss
        blocked = torch.full_like(logits, -1e4)
        if not self.focal:
            blocked[..., -1] = 1e4
        logits = torch.where(mask[..., None], blocked, logits)
        return content, anchors, {"pred_logits": logits, "pred_boxes": boxes, "padding": mask}
