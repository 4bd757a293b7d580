"""NaViT packing (Dehghani et al. 2023, "Patch n' Pack"): images of several sizes in one sequence.

Each image's tokens (class token, registers, patches, with its own added positions: learned ones resampled to its
grid, sine-cosine ones computed for it) are concatenated into one sequence (1, sum L_i, D); a `Documents` mask keeps
each image's attention within its own tokens, RoPE rotates each image's tokens by its own grid's angles, and each image
is pooled from its own tokens (its class token, or the mean of its patches). The logits equal those of each image run
alone at its own size, without the padding a batch of one size would need. A "relpos" table is one grid's bias and is
refused here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from models.core.masks import Documents
from models.core.position import Rotation


def _concatenated(rotations: list[Rotation]) -> Rotation:
    """One `Rotation` of cos/sin (..., sum L_i, d) from the images' (..., L_i, d), in the images' order."""
    cos = torch.cat([r.cos for r in rotations], dim=-2)
    sin = torch.cat([r.sin for r in rotations], dim=-2)
    return Rotation(cos, sin, rotations[0].interleaved)


def _packed_positions(each: list[dict]) -> dict:
    """The images' positions inside attention (``rope``: a `Rotation`, or one per layer for mixed RoPE) as one
    sequence's; {} when the model has none there."""
    ropes = [positions.get("rope") for positions in each]
    if ropes[0] is None:
        return {}
    if isinstance(ropes[0], list):  # mixed: one per layer, (H, L_i, d) each
        return {"rope": [_concatenated(list(layer)) for layer in zip(*ropes)]}
    return {"rope": _concatenated(ropes)}


def _check_images(vit: nn.Module, images: Sequence[Tensor]) -> None:
    if vit.rel_pos_bias is not None:
        raise ValueError(
            "model.positions=relpos cannot pack images (one relative-position table per grid); use learned, sincos2d or rope"
        )
    if not images:
        raise ValueError("forward_packed: no images to pack")
    for image in images:
        if image.dim() != 3:
            raise ValueError(f"forward_packed takes images (C, H, W), got one of shape {tuple(image.shape)}")


def forward_packed(vit: nn.Module, images: Sequence[Tensor]) -> Tensor:
    """Images (C, H_i, W_i), each of a size the patches tile, -> logits (N, num_classes) of one packed sequence;
    ``vit``: a `models.vision.vit.VisionTransformer` (this module is below it: it calls the model's own steps)."""
    _check_images(vit, images)
    embedded = [vit.embed_tokens(image[None]) for image in images]  # (1, L_i, D), grid_i
    lengths = [tokens.shape[1] for tokens, _ in embedded]
    x = torch.cat([tokens for tokens, _ in embedded], dim=1)  # (1, L, D)
    ids = torch.repeat_interleave(torch.arange(len(images), device=x.device), torch.tensor(lengths, device=x.device))
    positions = _packed_positions([vit.attention_positions(grid) for _, grid in embedded])
    x = vit.encoder(vit.pos_drop(x), mask=Documents(ids[None]), **positions)  # (1, L, D)
    return torch.cat([vit.forward_head(tokens) for tokens in x.split(lengths, dim=1)])  # (N, num_classes)
