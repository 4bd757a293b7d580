"""ViT case: our training step vs timm's VisionTransformer holding the same weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.peers.bench import Bench, Settings, max_diff, train_step
from models.vision.pretrained import load_timm_state_dict
from models.vision.vit import VisionTransformer

VIT_SHAPES = {  # timm's vit_tiny/small/base_patch16_224, and one for dispatch overhead
    "vit_tiny": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # timm's depth and heads on tensors so small that dispatch, Python and (on a GPU) kernel launches set the time
    "vit_dispatch": dict(img_size=32, patch_size=8, embed_dim=24, depth=12, num_heads=3),
}
QUICK_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def vit_pair(shape: dict, device: torch.device, num_classes: int = 1000) -> tuple[VisionTransformer, nn.Module]:
    """Our ViT and timm's of the same config, ours holding timm's weights."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    torch.manual_seed(0)
    theirs = TimmViT(num_classes=num_classes, **shape)
    ours = VisionTransformer(num_classes=num_classes, **shape)
    load_timm_state_dict(ours, theirs.state_dict())
    return ours.to(device), theirs.to(device)


def vit_bench(name: str, s: Settings, batch: int | None = None) -> Bench:
    """ViT training step (cross-entropy, AdamW) at timm's ``name`` shape: ours vs timm's VisionTransformer."""
    shape = QUICK_VIT if s.quick else VIT_SHAPES[name]
    batch = batch or (2 if s.quick else 8)
    ours, theirs = vit_pair(shape, s.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, shape["img_size"], shape["img_size"], generator=g).to(s.device)
    labels = torch.randint(0, 1000, (batch,), generator=g).to(s.device)
    with torch.no_grad():
        check = (
            f"batch {batch}, {shape['img_size']} px, patch {shape['patch_size']}, width {shape['embed_dim']}, {shape['depth']} blocks; "
            f"same weights, eval logits max |Δ| {max_diff(ours.eval()(images), theirs.eval()(images)):.1e}"
        )
    ours.train(), theirs.train()
    steps = {
        side: train_step(s.maybe_compile(m), lambda m: F.cross_entropy(m(images), labels), s)
        for side, m in (("ours", ours), ("timm", theirs))
    }
    return Bench(steps, items=batch, unit="images", check=check)
