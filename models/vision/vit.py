"""Vision Transformer (Dosovitskiy et al. 2021) on the shared encoder.

An image is cut into non-overlapping patches (`PatchEmbed`), a class token is prepended,
learned positions are added (or positions act inside attention: ``positions``), and the shared
pre-norm encoder runs over the tokens; the head
reads the class token after the final norm ("token"), or the mean of the patch tokens followed
by ``fc_norm`` ("avg", as timm and MAE do). Weights from elsewhere load through `models.vision.pretrained`.
Images of several sizes run packed in one sequence through `VisionTransformer.forward_packed` (NaViT,
`models.vision.packing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Literal

import torch
from timm.layers import ConvNormAct, resample_abs_pos_embed
from torch import Tensor, nn

from models.core.attention import DEFAULT_ATTENTION, AttentionConfig
from models.core.position import PositionEmbeddingSine2D, RelativePositionBias2D, RotaryEmbedding2D
from models.core.registers import WithRegisters, insert_registers, learned_registers, unplaced
from models.core.transformer import TransformerEncoder
from models.vision.packing import forward_packed


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, N, D) with a Conv2d whose kernel = stride = patch size.

    With ``stem_channels``, a convolutional stem (Xiao et al. 2021, "Early Convolutions Help Transformers See
    Better") runs first: one 3x3 stride-2 convolution, BatchNorm and ReLU per entry (timm's ``ConvNormAct``), and
    the patches are cut from its feature map, as in timm's hybrid ViTs (``patch_size: 1`` is the paper's final
    1x1 convolution). Each stride-2 layer halves the side, rounding up: 28 -> 14 -> 7 -> 4.
    """

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        stem_channels: Sequence[int] = (),
    ):
        super().__init__()
        widths = (in_chans, *stem_channels)
        self.stem = nn.Sequential(*(ConvNormAct(c_in, c_out, 3, stride=2) for c_in, c_out in zip(widths, widths[1:])))
        self.img_size, self.patch_size = img_size, patch_size
        self.grid_size = self.patch_grid(img_size, img_size)[0]
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(widths[-1], embed_dim, kernel_size=patch_size, stride=patch_size)

    def patch_grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) of images of ``height`` x ``width``; a ValueError when the patch size
        does not divide the side (of the stem's feature map)."""
        sides = [height, width]
        for _ in self.stem:
            sides = [(side + 1) // 2 for side in sides]
        for side in sides:
            if side % self.patch_size:
                where = f"the stem's {sides[0]}x{sides[1]} feature map" if len(self.stem) else "the image size"
                raise ValueError(
                    f"model.patch_size={self.patch_size} does not divide {where} {side}; choose a divisor of {side}"
                )
        return sides[0] // self.patch_size, sides[1] // self.patch_size

    def forward(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) of any size the patches tile (`patch_grid`) -> tokens (B, N, D), rows first."""
        self.patch_grid(*x.shape[-2:])
        return self.proj(self.stem(x)).flatten(2).transpose(1, 2)  # (B, N, D)


def _check_settings(positions: str, global_pool: str, class_token: bool, embed_dim: int, num_heads: int) -> None:
    """Settings of the ViT that cannot work (together), refused with their keys."""
    if positions not in VisionTransformer.POSITIONS:
        known = ", ".join(VisionTransformer.POSITIONS)
        raise ValueError(f"model.positions={positions!r} is not known for the ViT; choose one of {known}")
    if global_pool not in ("token", "avg"):
        raise ValueError(f"model.global_pool={global_pool!r}; expected 'token' or 'avg'")
    if global_pool == "token" and not class_token:
        raise ValueError("model.class_token=false leaves nothing for model.global_pool=token to read; set it to avg")
    if num_heads < 1 or embed_dim % num_heads:
        raise ValueError(
            f"model.num_heads={num_heads} does not divide model.embed_dim={embed_dim}; choose a divisor of {embed_dim}"
        )
    if positions == "sincos2d" and embed_dim % 4:
        raise ValueError(f"model.positions=sincos2d needs model.embed_dim divisible by 4, got {embed_dim}")
    if positions.startswith("rope") and (embed_dim // num_heads) % 4:
        raise ValueError(
            f"model.positions={positions} needs a head size divisible by 4, "
            f"got model.embed_dim/model.num_heads = {embed_dim // num_heads}"
        )


def _positions_of(
    a: SimpleNamespace, grid: tuple[int, int], rope_theta: float | None
) -> tuple[PositionEmbeddingSine2D | None, RotaryEmbedding2D | None, nn.ModuleList | None]:
    """The position modules of ``a.positions`` (``a``: the architecture keys) other than learned ones: (sine-cosine,
    RoPE, per-layer relative position tables over the class token and the ``grid`` of patches), None where unused."""
    sincos = rope = tables = None
    width, heads = a.embed_dim, a.num_heads
    if a.positions == "sincos2d":
        sincos = PositionEmbeddingSine2D(width // 2, normalize=False)  # integer row and column
    if a.positions.startswith("rope"):
        mode = a.positions.removeprefix("rope_")
        rope = RotaryEmbedding2D(width // heads, heads, mode, rope_theta, a.depth, a.rope_grid_indexing)
    if a.positions == "relpos":
        tables = nn.ModuleList(RelativePositionBias2D(grid, heads, int(a.class_token)) for _ in range(a.depth))
    return sincos, rope, tables


# what an architecture key left unset (None) means: ViT-B/16 (Dosovitskiy et al. 2021). A key that timm's model fixes
# (`models.vision.timm_names.fill_from_timm`) takes timm's value only where it is unset, not where it is written.
VIT_B16 = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, global_pool="token")
VIT_B16 |= dict(positions="learned", register_tokens=0, class_token=True, rope_grid_indexing="xy")


def _unset_as_vit_b16(arguments: dict) -> SimpleNamespace:
    return SimpleNamespace(**{k: default if arguments[k] is None else arguments[k] for k, default in VIT_B16.items()})


def _init_linear(layer: nn.Linear) -> None:
    nn.init.trunc_normal_(layer.weight, std=0.02)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class VisionTransformer(nn.Module, WithRegisters):
    """ViT classifier.

    Args (the architecture keys, from ``patch_size`` to ``rope_grid_indexing``, left None are ViT-B/16's, `VIT_B16`;
    with ``init_from: timm:NAME`` they are timm's):
        img_size: height and width of the (square) images.
        patch_size: side of the square patches; it must divide img_size (or the stem's feature map).
        in_chans: image channels.
        num_classes: classes of the head (0 gives features only).
        embed_dim: width; ``num_heads`` must divide it.
        depth: encoder layers.
        num_heads: attention heads.
        mlp_ratio: MLP width / embed_dim.
        drop_rate: dropout on the tokens, in the MLP, and after attention and MLP.
        attn_drop_rate: dropout on the attention weights.
        drop_path_rate: stochastic depth, rising linearly to this rate in the last layer.
        global_pool: "token" (class token after the final norm) or "avg" (mean of the patch
            tokens, then ``fc_norm``; the class token is kept, as in timm, but unread).
        fc_norm: the norm after pooling (``fc_norm``) instead of the final norm over the tokens; None: with "avg"
            pooling (timm's ``fc_norm=None``). false with "avg": the mean of the finally normed patch tokens
            (timm's ``*_gap_*`` ViTs).
        attention: the attention block of the shared core (similarity, qk_norm, normalization, gate; see
            `models.core.attention`).
        stem_channels: widths of a convolutional stem before the patch projection (see `PatchEmbed`);
            ``patch_size`` then applies to the stem's feature map. Empty: the plain ViT.
        positions: "learned" (ViT: ``pos_embed`` added to the tokens), "sincos2d" (fixed 2D sine-cosine added to
            the patch tokens, MAE's: half of the channels encode the row, half the column), or inside attention, without
            ``pos_embed`` (the class token unrotated / with its own bias entries): "rope_axial" or
            "rope_mixed" (2D RoPE, Heo et al. 2024, timm's RoPE ViTs), "relpos" (a Swin/BEiT relative
            position table per layer). See `models.core.position`.
        rope_theta: the 2D RoPE frequency base; None: the RoPE ViTs' (100 axial, 10 mixed).
        register_tokens: N learned registers (Darcet et al. 2024, `models.core.registers`) in timm's layout: tokens
            [class, reg_1 .. reg_N, patches]; they have no position (learned or sine-cosine positions cover the
            class token and the patches, RoPE leaves them unrotated, a "relpos" table gives them no bias), and
            the head never reads them.
        init_values: LayerScale (Touvron et al. 2021) on every residual branch, ``gamma`` started at this
            value (timm's ``init_values``: 1e-5 in its RoPE and DINOv2 ViTs); None: none.
        class_token: false: no class token (timm's ``class_token=False``: its ``*_gap`` ViTs, "avg" pooling only).
        rope_grid_indexing: "xy" (the RoPE ViTs of Heo et al.) or "ij" (timm's ``*_rope_reg*`` ViTs: the row
            takes the first half of the rotated channels), see `models.core.position.RotaryEmbedding2D`.
    Shapes: images (B, C, H, W) -> logits (B, num_classes). Images of another size than ``img_size`` (trained
    small, evaluated large) give another patch grid: learned positions are resampled to it (bicubic, timm's
    ``resample_abs_pos_embed``), sine-cosine and RoPE positions are computed for it, and "relpos" tables are resized
    to it (BEiT's geometric interpolation, timm's ``resize_rel_pos_bias_table``).
    """

    POSITIONS = ("learned", "sincos2d", "rope_axial", "rope_mixed", "relpos")

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int | None = None,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int | None = None,
        depth: int | None = None,
        num_heads: int | None = None,
        mlp_ratio: float | None = None,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        global_pool: Literal["token", "avg"] | None = None,
        attention: AttentionConfig = DEFAULT_ATTENTION,
        stem_channels: Sequence[int] = (),
        positions: Literal["learned", "sincos2d", "rope_axial", "rope_mixed", "relpos"] | None = None,
        rope_theta: float | None = None,
        register_tokens: int | None = None,
        init_values: float | None = None,
        class_token: bool | None = None,
        rope_grid_indexing: Literal["xy", "ij"] | None = None,
        fc_norm: bool | None = None,
    ):
        super().__init__()
        a = _unset_as_vit_b16(locals())  # the architecture keys, None where unset
        _check_settings(a.positions, a.global_pool, a.class_token, a.embed_dim, a.num_heads)
        self.global_pool, self.num_classes, self.embed_dim = a.global_pool, num_classes, a.embed_dim
        fc_norm = a.global_pool == "avg" if fc_norm is None else fc_norm
        self.patch_embed = PatchEmbed(img_size, a.patch_size, in_chans, a.embed_dim, stem_channels)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, a.embed_dim)) if a.class_token else None
        self.reg_token = learned_registers(a.register_tokens, a.embed_dim)
        self.num_prefix_tokens = int(a.class_token) + a.register_tokens  # before the patches: [class, registers]
        num_placed, grid = int(a.class_token) + self.patch_embed.num_patches, self.patch_embed.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, num_placed, a.embed_dim)) if a.positions == "learned" else None
        self.sincos, self.rope, self.rel_pos_bias = _positions_of(a, (grid, grid), rope_theta)
        self.pos_drop = nn.Dropout(drop_rate)
        self.encoder = TransformerEncoder(
            a.depth,
            a.embed_dim,
            a.num_heads,
            final_norm=not fc_norm,
            drop_path=drop_path_rate,
            dim_feedforward=int(a.embed_dim * a.mlp_ratio),
            dropout=drop_rate,
            attn_dropout=attn_drop_rate,
            activation="gelu",
            norm_first=True,
            attention=attention,
            layer_norm_eps=1e-6,
            init_values=init_values,
        )
        self.fc_norm = nn.LayerNorm(a.embed_dim, eps=1e-6) if fc_norm else nn.Identity()
        self.head = nn.Linear(a.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self) -> None:
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                _init_linear(m)

    def reset_head(self) -> None:
        """A fresh head (new task, same class count)."""
        if isinstance(self.head, nn.Linear):
            _init_linear(self.head)

    def no_weight_decay(self) -> set[str]:
        named = {"pos_embed": self.pos_embed, "rope.freqs": getattr(self.rope, "freqs", None)}
        named |= {"cls_token": self.cls_token, "reg_token": self.reg_token}
        named["relative_position_bias_table"] = self.rel_pos_bias
        return {name for name, present in named.items() if present is not None}

    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer groups for timm's layer-wise learning-rate decay, as timm's ``VisionTransformer``
        makes them: embeddings, one group per block (the final norm joins the last), the head on top."""
        return {
            "stem": r"^cls_token|reg_token|pos_embed|patch_embed|rope\.",
            "blocks": [(r"^encoder\.layers\.(\d+)", None), (r"^encoder\.norm", (99999,))],
        }

    def forward_features(self, x: Tensor) -> Tensor:
        """Images (B, C, H, W) -> encoded tokens (B, P + N, D): the P = ``num_prefix_tokens`` (class token, then
        registers) first (after the final norm, unless the model norms after pooling: ``fc_norm``)."""
        x, grid = self.embed_tokens(x)
        return self.encoder(self.pos_drop(x), **self.attention_positions(grid))

    def forward_packed(self, images: Sequence[Tensor]) -> Tensor:
        """Images (C, H_i, W_i) of several sizes, packed in one sequence (NaViT) -> logits (N, num_classes), equal to
        each image's alone; see `models.vision.packing`."""
        return forward_packed(self, images)

    def embed_tokens(self, x: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images (B, C, H, W) -> the encoder's input (B, P + N, D) with its added positions, and the patch grid."""
        grid = self.patch_embed.patch_grid(*x.shape[-2:])
        x = self.patch_embed(x)  # (B, N, D)
        if self.sincos is not None:
            x = x + self.sincos(x.new_zeros(1, *grid, dtype=torch.bool)).flatten(2).transpose(1, 2)  # (1, N, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, D)
        if self.pos_embed is not None:
            x = x + self._pos_embed(grid)
        if self.reg_token is not None:
            x = insert_registers(x, self.reg_token, self._placed_prefix)  # (B, P + N, D)
        return x, grid

    @property
    def _placed_prefix(self) -> int:
        """The prefix tokens that have a learned position: the class token, if any (registers have none)."""
        return int(self.cls_token is not None)

    def _pos_embed(self, grid: tuple[int, int]) -> Tensor:
        """The learned positions (1, 1 + N, D), resampled (bicubic) from the training grid to ``grid``."""
        trained = self.patch_embed.grid_size
        if grid == (trained, trained):
            return self.pos_embed
        return resample_abs_pos_embed(self.pos_embed, list(grid), [trained, trained], self._placed_prefix)

    def attention_positions(self, grid: tuple[int, int]) -> dict:
        """The encoder's rope (class token and registers unrotated) or its per-layer biases (H, P + N, P + N)."""
        if self.rope is not None:
            rotation = self.rope(grid)
            if isinstance(rotation, list):  # mixed: one per layer
                return {"rope": [r.with_prefix(self.num_prefix_tokens) for r in rotation]}
            return {"rope": rotation.with_prefix(self.num_prefix_tokens)}
        if self.rel_pos_bias is not None:
            biases = {"position_bias": [table.lazy(grid) for table in self.rel_pos_bias]}
            return unplaced(biases, self._placed_prefix, self.num_registers)
        return {}

    def register_keys(self) -> dict[str, slice]:
        """The attention layers whose keys include the registers -> the registers' key positions."""
        if not self.num_registers:
            return {}
        where = slice(self._placed_prefix, self.num_prefix_tokens)
        return {f"encoder.layers.{i}.self_attn": where for i in range(len(self.encoder.layers))}

    def forward_head(self, tokens: Tensor) -> Tensor:
        """Tokens (B, P + N, D) -> logits (B, num_classes): the class token's, or the patches' mean."""
        pooled = (
            tokens[:, 0] if self.global_pool == "token" else tokens[:, self.num_prefix_tokens :].mean(dim=1)
        )  # (B, D)
        return self.head(self.fc_norm(pooled))

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))
