"""Vision Transformer (Dosovitskiy et al. 2021) on the shared encoder, and weight import.

An image is cut into non-overlapping patches (`PatchEmbed`), a class token is prepended,
learned positions are added (or positions act inside attention: ``positions``), and the shared
pre-norm encoder runs over the tokens; the head
reads the class token after the final norm ("token"), or the mean of the patch tokens followed
by ``fc_norm`` ("avg", as timm and MAE do).

Weights come from a local file (`load_pretrained`): a checkpoint of our own
(`attnlab fit` writes Lightning ``.ckpt`` files) or a timm ``VisionTransformer`` state dict
(``.pth``/``.bin``/``.safetensors``), renamed by `models.vit_timm.timm_to_attnlab`; or from a timm hub name
(``timm/vit_small_patch16_224.augreg_in21k``), the hub repository of timm's weights, through huggingface_hub's
cache (`models.weights`: one path for foreign weights); or by timm's model name (``timm:vit_small_patch16_224``),
which also sets the architecture (`models.vit_timm`). Positions are resampled
(bicubic, timm's ``resample_abs_pos_embed``) when the patch grid differs from the checkpoint's,
the patch projection is adapted when the channel count differs, and the head is re-initialised
when the class count differs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch
from timm.layers import ConvNormAct, resample_abs_pos_embed
from timm.models import adapt_input_conv
from torch import Tensor, nn

from models.attention import DEFAULT_ATTENTION, AttentionConfig
from models.position import PositionEmbeddingSine2D, RelativePositionBias2D, RotaryEmbedding2D
from models.registers import WithRegisters, insert_registers, learned_registers, unplaced
from models.transformer import TransformerEncoder
from models.vit_timm import KEY, TIMM, hub_repository, split_timm, timm_to_attnlab
from models.weights import WEIGHT_SUFFIXES, load_checked, network_state, read_state, resolve

log = logging.getLogger(__name__)


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
    positions: str,
    embed_dim: int,
    num_heads: int,
    depth: int,
    grid: tuple[int, int],
    placed: int,
    rope_theta: float | None,
    rope_grid_indexing: str,
) -> tuple[PositionEmbeddingSine2D | None, RotaryEmbedding2D | None, nn.ModuleList | None]:
    """The position modules of ``positions`` other than learned ones: (sine-cosine, RoPE, per-layer relative
    position tables), None where unused; ``placed``: the prefix tokens that relative positions cover."""
    sincos = rope = tables = None
    if positions == "sincos2d":
        sincos = PositionEmbeddingSine2D(embed_dim // 2, normalize=False)  # integer row and column
    if positions.startswith("rope"):
        mode = positions.removeprefix("rope_")
        rope = RotaryEmbedding2D(embed_dim // num_heads, num_heads, mode, rope_theta, depth, rope_grid_indexing)
    if positions == "relpos":
        tables = nn.ModuleList(RelativePositionBias2D(grid, num_heads, placed) for _ in range(depth))
    return sincos, rope, tables


def _init_linear(layer: nn.Linear) -> None:
    nn.init.trunc_normal_(layer.weight, std=0.02)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


class VisionTransformer(nn.Module, WithRegisters):
    """ViT classifier.

    Args:
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
            `models.attention`).
        stem_channels: widths of a convolutional stem before the patch projection (see `PatchEmbed`);
            ``patch_size`` then applies to the stem's feature map. Empty: the plain ViT.
        positions: "learned" (ViT: ``pos_embed`` added to the tokens), "sincos2d" (fixed 2D sine-cosine added to
            the patch tokens, MAE's: half of the channels encode the row, half the column), or inside attention, without
            ``pos_embed`` (the class token unrotated / with its own bias entries): "rope_axial" or
            "rope_mixed" (2D RoPE, Heo et al. 2024, timm's RoPE ViTs), "relpos" (a Swin/BEiT relative
            position table per layer). See `models.position`.
        rope_theta: the 2D RoPE frequency base; None: the RoPE ViTs' (100 axial, 10 mixed).
        register_tokens: N learned registers (Darcet et al. 2024, `models.registers`) in timm's layout: tokens
            [class, reg_1 .. reg_N, patches]; they have no position (learned or sine-cosine positions cover the
            class token and the patches, RoPE leaves them unrotated, a "relpos" table gives them no bias), and
            the head never reads them.
        init_values: LayerScale (Touvron et al. 2021) on every residual branch, ``gamma`` started at this
            value (timm's ``init_values``: 1e-5 in its RoPE and DINOv2 ViTs); None: none.
        class_token: false: no class token (timm's ``class_token=False``: its ``*_gap`` ViTs, "avg" pooling only).
        rope_grid_indexing: "xy" (the RoPE ViTs of Heo et al.) or "ij" (timm's ``*_rope_reg*`` ViTs: the row
            takes the first half of the rotated channels), see `models.position.RotaryEmbedding2D`.
    Shapes: images (B, C, H, W) -> logits (B, num_classes). Images of another size than ``img_size`` (trained
    small, evaluated large) give another patch grid: learned positions are resampled to it (bicubic, timm's
    ``resample_abs_pos_embed``), sine-cosine and RoPE positions are computed for it, and "relpos" tables are resized
    to it (BEiT's geometric interpolation, timm's ``resize_rel_pos_bias_table``).
    """

    POSITIONS = ("learned", "sincos2d", "rope_axial", "rope_mixed", "relpos")

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
        attention: AttentionConfig = DEFAULT_ATTENTION,
        stem_channels: Sequence[int] = (),
        positions: Literal["learned", "sincos2d", "rope_axial", "rope_mixed", "relpos"] = "learned",
        rope_theta: float | None = None,
        register_tokens: int = 0,
        init_values: float | None = None,
        class_token: bool = True,
        rope_grid_indexing: Literal["xy", "ij"] = "xy",
        fc_norm: bool | None = None,
    ):
        super().__init__()
        _check_settings(positions, global_pool, class_token, embed_dim, num_heads)
        self.global_pool, self.num_classes, self.embed_dim = global_pool, num_classes, embed_dim
        fc_norm = global_pool == "avg" if fc_norm is None else fc_norm
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, stem_channels)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = learned_registers(register_tokens, embed_dim)
        self.num_prefix_tokens = int(class_token) + register_tokens  # before the patches: [class, registers]
        num_placed, grid = int(class_token) + self.patch_embed.num_patches, self.patch_embed.grid_size
        self.pos_embed = nn.Parameter(torch.zeros(1, num_placed, embed_dim)) if positions == "learned" else None
        self.sincos, self.rope, self.rel_pos_bias = _positions_of(
            positions, embed_dim, num_heads, depth, (grid, grid), int(class_token), rope_theta, rope_grid_indexing
        )
        self.pos_drop = nn.Dropout(drop_rate)
        self.encoder = TransformerEncoder(
            depth,
            embed_dim,
            num_heads,
            final_norm=not fc_norm,
            drop_path=drop_path_rate,
            dim_feedforward=int(embed_dim * mlp_ratio),
            dropout=drop_rate,
            attn_dropout=attn_drop_rate,
            activation="gelu",
            norm_first=True,
            attention=attention,
            layer_norm_eps=1e-6,
            init_values=init_values,
        )
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if fc_norm else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
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
        return self.encoder(self.pos_drop(x), **self._attention_positions(grid))

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

    def _attention_positions(self, grid: tuple[int, int]) -> dict:
        """The encoder's rope (class token and registers unrotated) or its per-layer biases (H, P + N, P + N)."""
        if self.rope is not None:
            rotation = self.rope(grid)
            if isinstance(rotation, list):  # mixed: one per layer
                return {"rope": [r.with_prefix(self.num_prefix_tokens) for r in rotation]}
            return {"rope": rotation.with_prefix(self.num_prefix_tokens)}
        if self.rel_pos_bias is not None:
            biases = {"position_bias": [table(grid) for table in self.rel_pos_bias]}
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


def read_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """A local weights file or folder -> a state dict with our key names.

    Accepts an `attnlab fit` checkpoint (``.ckpt``: Lightning's ``state_dict`` with the module's
    ``model.`` prefix), a state dict of our `VisionTransformer`, or a timm ``VisionTransformer``
    state dict (``.pth``/``.bin``/``.safetensors``, or the folder of a timm hub repository), optionally under a
    "model"/"state_dict" key. Nothing is downloaded, and a file holding pickled code is refused before any of it
    runs (`models.weights`).
    """
    expected = "weights are never downloaded; give a local .ckpt, .pth or .safetensors file"
    state = read_state(resolve(str(path), KEY, expected, hub_files=None), KEY)
    return timm_to_attnlab(state, str(path)) if any(k.startswith("blocks.") for k in state) else network_state(state)


def read_init_from(name: str) -> dict[str, Tensor]:
    """``model.init_from`` -> a state dict with our key names: a local weights file or folder (`read_checkpoint`),
    a timm hub name (``timm/<model>.<tag>``, or timm's ``<model>.<tag>``): the hub repository of timm's weights,
    read through huggingface_hub's cache, downloaded into it only when online (`models.weights.resolve`), or
    ``timm:NAME`` (those hub weights) or ``timm:NAME=FILE`` (a local timm state dict), whose architecture
    `models.vit_timm.fill_from_timm` has read."""
    if name.startswith(TIMM):
        model_name, file = split_timm(name)
        if file:
            return read_checkpoint(file)
        return _read_hub(hub_repository(model_name, name), f"{KEY}={TIMM}{model_name}")
    if Path(name).expanduser().exists() or name.endswith(WEIGHT_SUFFIXES) or name.startswith((".", "/", "~")):
        return read_checkpoint(name)
    if "/" in name:
        return _read_hub(name, KEY)
    try:  # timm's name -> the hub repository of its weights
        repository = hub_repository(name, name)
    except ValueError:
        raise ValueError(
            f"{KEY}={name}: no such local file, and timm knows no hub weights of that name; "
            "give a timm ViT name (timm/vit_small_patch16_224.augreg_in21k) or a local file"
        ) from None
    return _read_hub(repository, KEY)


def _read_hub(repository: str, key: str) -> dict[str, Tensor]:
    """The weights of a hub repository, from huggingface_hub's cache (`models.weights.resolve`); ``key`` begins
    the messages (with the repository) and ends the hint (``key=DIR``)."""
    return read_checkpoint(resolve(repository, key, "give a local file or a timm hub name", hub_files=("*.json",)))


def load_pretrained(model: VisionTransformer, state: dict[str, Tensor], source: str = "checkpoint") -> None:
    """Load a state dict with our key names into ``model``, adapting it where that is well defined.

    - positions: resampled (bicubic) to the model's patch grid when the grid differs;
    - the first convolution (the patch projection, or the stem's first): adapted to the model's channel count
      (timm's ``adapt_input_conv``: e.g. RGB weights summed for grayscale input);
    - head: re-initialised (and logged) when the class count differs.
    Anything else that does not fit (depth, width, patch size, pooling, stem) is a ValueError naming ``source``.
    """
    state = dict(state)
    own = model.state_dict()
    _check_norms(model, state, source)
    _check_tokens_and_scale(model, state, source)
    _fit_positions(model, state, source)
    stems = {name: _stem_widths(d) for name, d in (("checkpoint", state), ("model", own))}
    if stems["checkpoint"] != stems["model"]:
        raise ValueError(
            f"{source} has a convolutional stem of widths {stems['checkpoint']} ([]: none), the model "
            f"{stems['model']}; set model.stem_channels={stems['checkpoint']}"
        )
    first = "patch_embed.stem.0.conv.weight" if stems["model"] else "patch_embed.proj.weight"  # reads the image
    conv = state.get(first)
    in_chans = own[first].shape[1]
    if conv is not None and conv.shape[1] != in_chans:
        state[first] = adapt_input_conv(in_chans, conv)
        log.warning("%s: %s adapted from %d to %d input channels", source, first, conv.shape[1], in_chans)
    classes = {
        name: d["head.weight"].shape[0] if "head.weight" in d else 0
        for name, d in (("checkpoint", state), ("model", own))
    }
    new_head = classes["checkpoint"] != classes["model"]
    if new_head:
        state = {k: v for k, v in state.items() if not k.startswith("head.")} | {
            k: v for k, v in own.items() if k.startswith("head.")
        }  # re-initialised below
        log.warning(
            "%s: its head has %d classes, the model %d; the head is re-initialised",
            source,
            classes["checkpoint"],
            classes["model"],
        )
    load_checked(
        model, state, source, "ViT", "is it a ViT of this depth and pooling? check embed_dim, patch_size, mlp_ratio"
    )
    if new_head:
        model.reset_head()


def _check_norms(model: VisionTransformer, state: dict[str, Tensor], source: str) -> None:
    """A checkpoint with the norm after pooling (``fc_norm``) or the final norm that the model lacks: one line
    naming the setting."""
    own = model.state_dict()
    if "fc_norm.weight" in state and "fc_norm.weight" not in own:
        if model.global_pool == "avg":
            raise ValueError(f"{source} has a norm after pooling (fc_norm); set model.fc_norm=null")
        raise ValueError(f"{source} was trained with global_pool='avg' (it has fc_norm); set model.global_pool=avg")
    if "encoder.norm.weight" in state and "encoder.norm.weight" not in own:
        if model.global_pool == "token":
            raise ValueError(f"{source} has a final norm over the tokens (encoder.norm); set model.fc_norm=null")
        raise ValueError(
            f"{source} was trained with global_pool='token'; set model.global_pool=token, or model.fc_norm=false "
            "for the mean of the finally normed tokens"
        )


def _fit_positions(model: VisionTransformer, state: dict[str, Tensor], source: str) -> None:
    """The checkpoint's learned positions, resampled (bicubic) in ``state`` to the model's patch grid where it
    differs; a ValueError where the model has none or the checkpoint's fit no square grid."""
    pos, own = state.get("pos_embed"), model.pos_embed
    if pos is not None and own is None:
        raise ValueError(
            f"{source} has learned positions (pos_embed) that this model's positions inside attention lack; "
            "set model.positions=learned"
        )
    if pos is None or pos.shape == own.shape or pos.shape[-1] != own.shape[-1]:
        return  # nothing to resample, or a width that `load_checked` names
    placed = model._placed_prefix
    old_grid = math.isqrt(pos.shape[1] - placed)
    if old_grid**2 + placed != pos.shape[1]:
        raise ValueError(
            f"{source}: pos_embed has {pos.shape[1]} positions, not {placed} class token(s) and a square patch grid"
        )
    grid = model.patch_embed.grid_size
    state["pos_embed"] = resample_abs_pos_embed(pos, [grid, grid], [old_grid, old_grid], num_prefix_tokens=placed)
    log.warning("%s: positions resampled from a %dx%d to a %dx%d patch grid", source, old_grid, old_grid, grid, grid)


def _check_tokens_and_scale(model: VisionTransformer, state: dict[str, Tensor], source: str) -> None:
    """A checkpoint with another class token, register count or LayerScale than the model: one line naming the key."""
    own = model.state_dict()
    if ("cls_token" in state) != ("cls_token" in own):
        raise ValueError(
            f"{source} {'has' if 'cls_token' in state else 'lacks'} a class token (cls_token); "
            f"set model.class_token={str('cls_token' in state).lower()}"
        )
    theirs = state["reg_token"].shape[1] if "reg_token" in state else 0
    if theirs != model.num_registers:
        raise ValueError(
            f"{source} has {theirs} registers (reg_token), the model {model.num_registers}; "
            f"set model.register_tokens={theirs}"
        )
    scaled = [("encoder.layers.0.ls1.gamma" in d) for d in (state, own)]
    if scaled[0] != scaled[1]:
        fix = "init_values to a number (the checkpoint's gamma replaces it)" if scaled[0] else "init_values=null"
        raise ValueError(f"{source} {'has' if scaled[0] else 'lacks'} LayerScale (ls1.gamma); set model.{fix}")


def _stem_widths(state: dict[str, Tensor]) -> list[int]:
    """The output widths of a state dict's convolutional stem (`PatchEmbed`), in order; [] without one."""
    widths = []
    while (weight := state.get(f"patch_embed.stem.{len(widths)}.conv.weight")) is not None:
        widths.append(weight.shape[0])
    return widths


def load_timm_state_dict(model: VisionTransformer, state: dict[str, Tensor], source: str = "timm state dict") -> None:
    """Load a timm ``VisionTransformer`` state dict (timm key names) into our ``model``."""
    load_pretrained(model, timm_to_attnlab(state, source), source)
