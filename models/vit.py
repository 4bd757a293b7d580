"""Vision Transformer (Dosovitskiy et al. 2021) on the shared encoder.

An image is cut into non-overlapping patches (`PatchEmbed`), a class token is prepended,
learned positions are added, and the shared pre-norm encoder runs over the tokens; the head
reads the class token (or the mean of the patch tokens).
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from models.attention import Similarity
from models.transformer import TransformerEncoder


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, N, D) with a Conv2d whose kernel = stride = patch size."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"model.patch_size={patch_size} does not divide the image size {img_size}; choose a divisor of {img_size}")
        self.img_size, self.patch_size = img_size, patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"input images are {tuple(x.shape[-2:])}, the model expects {self.img_size}x{self.img_size}")
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, D)


class VisionTransformer(nn.Module):
    """ViT classifier.

    Args:
        img_size, patch_size, in_chans: input geometry; patch_size must divide img_size.
        num_classes: classes of the head (0 gives features only).
        embed_dim, depth, num_heads, mlp_ratio: width, layers, heads, MLP width / embed_dim.
        drop_rate, attn_drop_rate, drop_path_rate: dropout, attention dropout, stochastic depth.
        global_pool: "token" (class token) or "avg" (mean of patch tokens).
        similarity: attention similarity of the shared core.
    Shapes: images (B, C, H, W) -> logits (B, num_classes).
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        global_pool: Literal["token", "avg"] = "token",
        similarity: Similarity = "scaled_dot",
    ):
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"model.global_pool={global_pool!r}; expected 'token' or 'avg'")
        self.global_pool = global_pool
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.patch_embed.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.encoder = TransformerEncoder(
            depth, embed_dim, num_heads, final_norm=True, drop_path=drop_path_rate,
            dim_feedforward=int(embed_dim * mlp_ratio), dropout=drop_rate, attn_dropout=attn_drop_rate,
            activation="gelu", norm_first=True, similarity=similarity, layer_norm_eps=1e-6,
        )
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> normed tokens (B, 1 + N, D), class token first."""
        x = self.patch_embed(x)  # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.encoder(self.pos_drop(x))

    def forward_head(self, tokens: Tensor) -> Tensor:
        pooled = tokens[:, 0] if self.global_pool == "token" else tokens[:, 1:].mean(dim=1)
        return self.head(pooled)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))
