"""DETR's set prediction loss: Hungarian matching, then class and box losses on the matched pairs."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import sigmoid_focal_loss

from models.detection.box_ops import box_cxcywh_to_xyxy, generalized_box_iou
from models.detection.denoising import denoising_indices
from models.detection.matcher import HungarianMatcher


def num_boxes_across_processes(targets: list[dict[str, Tensor]], device: torch.device) -> Tensor:
    """Mean number of target boxes per process (at least 1), all-reduced over the process group.

    The box losses are summed over this process's matched pairs and divided by it. DDP averages the
    gradients of the processes, so N processes then train exactly like one process with the whole
    batch: (1/N) Σ_p S_p / (Σ_p n_p / N) = Σ_p S_p / Σ_p n_p.
    """
    num_boxes = torch.full(
        (), float(sum(len(t["labels"]) for t in targets)), device=device
    )  # a fill: no copy that waits for the GPU
    world_size = 1
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(num_boxes)
        world_size = dist.get_world_size()
    return (num_boxes / world_size).clamp(min=1)


class SetCriterion(nn.Module):
    """Losses of DETR (Carion et al. 2020), computed after `HungarianMatcher` pairs queries with targets.

    ``loss_ce``: cross-entropy over K + 1 classes, every unmatched query labelled "no object", whose
    weight is ``eos_coef`` (0.1) to offset its abundance. ``loss_bbox`` (L1) and ``loss_giou``
    (1 − GIoU) on the matched boxes, normalised by the number of target boxes averaged over all
    processes. With ``aux_outputs`` the same losses are added for every intermediate decoder layer
    (suffix ``_<layer>``), each with its own matching (all layers matched in one pass).
    ``class_error`` (top-1 error in percent of the matched queries) and ``cardinality_error``
    (|#predicted objects − #targets|) are for logging.

    With ``focal_alpha`` set, ``loss_ce`` is instead the sigmoid focal loss (Lin et al. 2017) over the K
    classes, summed and normalised by the number of target boxes (Deformable DETR, DAB-DETR); a query
    with no object has all-zero targets. Outputs with ``dn_outputs`` (denoising training, see
    models.detection.denoising) add the same three losses over the denoising slots, suffix ``_dn`` (and
    ``_dn_<layer>``), each slot against its own target without matching, normalised by the number of
    target boxes times the number of groups.

    Args:
        num_classes: K, the object classes (the no-object class is index K).
        matcher: the `HungarianMatcher`.
        eos_coef: relative weight of the no-object class (softmax cross-entropy only).
        weight_dict: loss name -> weight for the total (None: 1 each; the paper's 1 / 5 / 2 are
            `ObjectDetector`'s defaults); aux and denoising copies are added automatically.
        num_aux: the intermediate decoder layers whose losses are added.
        focal_alpha, focal_gamma: the focal loss's α (None: softmax cross-entropy, the paper) and γ.
        denoising: weigh the ``_dn`` losses too.
        encoder: weigh the ``_enc`` losses too: the encoder's per-cell proposals (two-stage query
            selection), matched and weighed like a decoder layer.
    Shapes: see `HungarianMatcher`; ``forward`` returns a dict of scalar tensors.
    """

    def __init__(
        self,
        num_classes: int,
        matcher: HungarianMatcher,
        eos_coef: float = 0.1,
        weight_dict: dict[str, float] | None = None,
        num_aux: int = 0,
        focal_alpha: float | None = None,
        focal_gamma: float = 2.0,
        denoising: bool = False,
        encoder: bool = False,
    ):
        super().__init__()
        self.num_classes, self.matcher, self.eos_coef = num_classes, matcher, eos_coef
        self.focal_alpha, self.focal_gamma = focal_alpha, focal_gamma
        base = weight_dict if weight_dict is not None else dict.fromkeys(("loss_ce", "loss_bbox", "loss_giou"), 1.0)
        layers = ["", *(f"_{i}" for i in range(num_aux))]  # the suffixes of `_losses`
        suffixes = layers + ["_enc"] * encoder + [f"_dn{s}" for s in layers] * denoising
        self.weight_dict = {k + s: v for s in suffixes for k, v in base.items()}
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    @staticmethod
    def _src_permutation(indices: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)])
        return batch_idx, torch.cat([src for src, _ in indices])

    def loss_labels(self, outputs, targets, indices, num_boxes, log: bool = True) -> dict[str, Tensor]:
        logits = outputs["pred_logits"]  # (B, Q, K + 1)
        idx = self._src_permutation(indices)
        target_classes_o = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices)])
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes[idx] = target_classes_o
        if self.focal_alpha is None:
            losses = {"loss_ce": F.cross_entropy(logits.transpose(1, 2), target_classes, self.empty_weight)}
        else:  # one-hot over K + 1, the no-object column dropped: a query with no object has all-zero targets
            onehot = F.one_hot(target_classes, self.num_classes + 1)[..., :-1].to(logits.dtype)  # (B, Q, K)
            focal = sigmoid_focal_loss(logits, onehot, self.focal_alpha, self.focal_gamma, reduction="sum")
            losses = {"loss_ce": focal / num_boxes}
        if log:
            matched = logits[idx]
            correct = (
                (matched.argmax(-1) == target_classes_o).float().mean() if len(matched) else logits.new_tensor(1.0)
            )
            losses["class_error"] = 100 * (1 - correct.detach())
        return losses

    @torch.no_grad()
    def loss_cardinality(self, outputs, targets, indices, num_boxes) -> dict[str, Tensor]:
        logits = outputs["pred_logits"]
        tgt_lengths = torch.as_tensor([len(t["labels"]) for t in targets], device=logits.device, dtype=torch.float)
        if self.focal_alpha is None:
            card_pred = (logits.argmax(-1) != self.num_classes).sum(1).float()  # predicted objects per image
        else:
            card_pred = (logits.amax(-1) > 0).sum(1).float()  # some class above probability 0.5
        return {"cardinality_error": F.l1_loss(card_pred, tgt_lengths)}

    def loss_boxes(self, outputs, targets, indices, num_boxes) -> dict[str, Tensor]:
        idx = self._src_permutation(indices)
        src_boxes = outputs["pred_boxes"][idx]  # (ΣT, 4)
        target_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices)]).to(src_boxes.dtype)
        loss_bbox = F.l1_loss(src_boxes, target_boxes, reduction="none").sum() / num_boxes
        giou = generalized_box_iou(
            box_cxcywh_to_xyxy(src_boxes)[:, None], box_cxcywh_to_xyxy(target_boxes)[:, None]
        ).flatten()  # pairs, not all ΣT x ΣT
        return {"loss_bbox": loss_bbox, "loss_giou": (1 - giou).sum() / num_boxes}

    def _losses(self, outputs, targets, indices, num_boxes, log: bool = False, suffix: str = "") -> dict[str, Tensor]:
        """One prediction set's losses, named with ``suffix`` (``_<layer>``, ``_enc``, ``_dn``, ``_dn_<layer>``)."""
        losses = self.loss_labels(outputs, targets, indices, num_boxes, log=log)
        losses.update(self.loss_boxes(outputs, targets, indices, num_boxes))
        if log:
            losses.update(self.loss_cardinality(outputs, targets, indices, num_boxes))
        return {k + suffix: v for k, v in losses.items()}

    def forward(self, outputs: dict, targets: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        num_boxes = num_boxes_across_processes(targets, outputs["pred_logits"].device)
        aux_outputs = outputs.get("aux_outputs", [])
        final_indices, *aux_indices = self.matcher.match_layers(
            [outputs, *aux_outputs], targets
        )  # one matching pass for all layers
        losses = self._losses(outputs, targets, final_indices, num_boxes, log=True)
        for i, (aux, indices) in enumerate(zip(aux_outputs, aux_indices)):
            losses.update(self._losses(aux, targets, indices, num_boxes, suffix=f"_{i}"))
        if "dn_outputs" in outputs:
            losses.update(self.denoising_losses(outputs["dn_outputs"], targets, num_boxes))
        if "enc_outputs" in outputs:
            enc = outputs["enc_outputs"]
            losses.update(self._losses(enc, targets, self.matcher(enc, targets), num_boxes, suffix="_enc"))
        return losses

    def denoising_losses(
        self, dn_outputs: dict, targets: list[dict[str, Tensor]], num_boxes: Tensor
    ) -> dict[str, Tensor]:
        """The losses of the denoising slots (B, G·P, ·): slot g·P + j against target j, no matching."""
        groups = dn_outputs["num_groups"]
        indices = denoising_indices(targets, groups, dn_outputs["pred_boxes"].shape[1] // groups)
        losses = self._losses(dn_outputs, targets, indices, num_boxes * groups, suffix="_dn")
        for i, aux in enumerate(dn_outputs["aux_outputs"]):
            losses.update(self._losses(aux, targets, indices, num_boxes * groups, suffix=f"_dn_{i}"))
        return losses

    def total(self, losses: dict[str, Tensor]) -> Tensor:
        """The weighted sum that is trained: Σ weight_dict[k] · losses[k]."""
        return sum(losses[k] * w for k, w in self.weight_dict.items() if k in losses)
