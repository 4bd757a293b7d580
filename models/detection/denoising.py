"""Denoising training (DN-DETR, Li et al. 2022): noised ground truth as extra decoder queries.

Each of ``num_groups`` groups holds one noised copy of every ground-truth object of an image: its
label flipped to a random class with probability ``label_noise``, its centre shifted by up to
``box_noise``·(w/2, h/2) and its width and height scaled by a factor in [1 - box_noise, 1 + box_noise]
(DN-DETR's noise, in cxcywh, clamped to [0, 1]). The decoder reconstructs every copy's own box and
class, without matching, so that the box regression learns from the first step instead of waiting for
the Hungarian matching to settle.

Queries are laid out [N matching | group 0 | group 1 | ...], each group padded to the batch's largest
object count P. The decoder self-attention mask (True = blocked, the core's convention) keeps the
matching queries from seeing any group (at inference there are none) and each group from seeing the
others (a group would otherwise copy the answers of another); groups see the matching queries.
Padding slots are blocked as keys by ``padding`` and are trained as "no object", as in DN-DETR.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


def check_denoising(num_groups: int, label_noise: float, box_noise: float) -> None:
    """One-line errors for settings that cannot work, raised when the model is built."""
    if not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(
            f"model.dn_number={num_groups!r}: the number of denoising groups must be an integer >= 0 (0 turns denoising off)"
        )
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"model.dn_label_noise={label_noise}: the label flip probability must be in [0, 1]")
    if not 0.0 <= box_noise <= 1.0:
        raise ValueError(
            f"model.dn_box_noise={box_noise}: the box noise scale must be in [0, 1] (1 shifts a centre by up to half the box)"
        )


@dataclass
class DenoisingQueries:
    """The denoising part of one batch's decoder queries (G groups of P slots each).

    labels (B, G·P) noised classes (``num_classes`` at padding); boxes (B, G·P, 4) noised normalised
    cxcywh (0 at padding); padding (B, G·P) True at slots without an object; attn_mask
    (N + G·P, N + G·P) for the decoder self-attention over [matching | groups], True = blocked.
    """

    labels: Tensor
    boxes: Tensor
    padding: Tensor
    attn_mask: Tensor
    num_groups: int


def denoising_attn_mask(num_queries: int, num_groups: int, pad_size: int, device: torch.device | None = None) -> Tensor:
    """(N + G·P, N + G·P) boolean, True where query i may not see key j: matching queries do not see the
    groups, a group does not see another group; groups see the matching queries and themselves."""
    group = torch.cat(
        [
            torch.full((num_queries,), -1, device=device),
            torch.arange(num_groups, device=device).repeat_interleave(pad_size),
        ]
    )
    return (group[:, None] != group[None, :]) & (group[None, :] >= 0)


def denoising_queries(
    targets: list[dict[str, Tensor]],
    num_groups: int,
    label_noise: float,
    box_noise: float,
    num_classes: int,
    num_queries: int,
) -> DenoisingQueries | None:
    """Noised copies of the targets (labels (T_b,), boxes (T_b, 4) normalised cxcywh); None when there is
    nothing to denoise (no groups, or no image of the batch has an object)."""
    sizes = [len(t["labels"]) for t in targets]
    pad = max(sizes, default=0)
    if num_groups == 0 or pad == 0:
        return None
    device = targets[0]["boxes"].device
    batch = len(targets)
    valid = torch.arange(pad, device=device)[None] < torch.tensor(sizes, device=device)[:, None]  # (B, P)
    valid = valid[:, None].expand(batch, num_groups, pad)  # (B, G, P)
    labels = pad_sequence([t["labels"] for t in targets], batch_first=True, padding_value=num_classes)  # (B, P)
    labels = labels[:, None].expand(batch, num_groups, pad)
    flip = (torch.rand(labels.shape, device=device) < label_noise) & valid
    labels = torch.where(flip, torch.randint_like(labels, num_classes), labels)
    boxes = pad_sequence([t["boxes"] for t in targets], batch_first=True).float()  # (B, P, 4)
    boxes = boxes[:, None].expand(batch, num_groups, pad, 4)
    wh = boxes[..., 2:]
    scale = torch.cat([wh / 2, wh], dim=-1)  # centres move by up to half the size, sizes change by up to all of it
    noised = (boxes + (torch.rand_like(boxes) * 2 - 1) * scale * box_noise).clamp(0.0, 1.0)
    noised = torch.where(valid[..., None], noised, 0.0)
    return DenoisingQueries(
        labels.flatten(1),
        noised.flatten(1, 2),
        ~valid.flatten(1),
        denoising_attn_mask(num_queries, num_groups, pad, device),
        num_groups,
    )


def denoising_indices(targets: list[dict[str, Tensor]], num_groups: int, pad_size: int) -> list[tuple[Tensor, Tensor]]:
    """The fixed assignment that replaces matching for the denoising queries: per image b, slot g·P + j
    of group g reconstructs target j. Returns B pairs (slot indices, target indices) of length G·T_b."""
    pairs = []
    for t in targets:
        device = t["labels"].device
        j = torch.arange(len(t["labels"]), device=device)
        slots = (torch.arange(num_groups, device=device)[:, None] * pad_size + j[None]).flatten()  # (G·T_b,)
        pairs.append((slots, j.repeat(num_groups)))
    return pairs
