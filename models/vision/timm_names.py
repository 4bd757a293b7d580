"""timm's ViTs in attnlab: their architecture read from timm's registry by name, their state dicts renamed to ours.

``model.init_from: timm:NAME`` (``timm:vit_small_patch16_224``, a pretrained tag allowed:
``timm:vit_small_patch16_224.augreg_in21k``) builds timm's model NAME on the meta device (no memory, no weights,
nothing downloaded) and reads from it every setting of our `VisionTransformer` that the name fixes
(`timm_architecture`): width, depth, heads, MLP ratio, patch size, pooling, class token, registers, LayerScale and
positions (learned, or RoPE axial or mixed with its θ and grid indexing). `fill_from_timm` gives them to the model:
a setting left unset takes timm's value, another value is refused. The weights are timm's hub weights of
that name, or a local timm state dict given after ``=`` (``timm:NAME=FILE``), renamed by `timm_to_attnlab`.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from timm.layers import Mlp, PatchEmbed, RotaryEmbeddingCat, RotaryEmbeddingMixed
from timm.models import create_model, get_pretrained_cfg, list_models, list_pretrained
from timm.models.eva import Eva, EvaBlock
from timm.models.vision_transformer import Block
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import Tensor, nn

log = logging.getLogger(__name__)
KEY = "model.init_from"
TIMM = "timm:"  # model.init_from: timm:NAME or timm:NAME=FILE
_ROPES = {RotaryEmbeddingCat: "rope_axial", RotaryEmbeddingMixed: "rope_mixed"}


def split_timm(init_from: str) -> tuple[str, str | None]:
    """``timm:NAME`` -> (NAME, None); ``timm:NAME=FILE`` -> (NAME, FILE)."""
    name, _, file = init_from.removeprefix(TIMM).partition("=")
    return name, file or None


def hub_repository(name: str, init_from: str) -> str:
    """The Hugging Face hub repository of timm's weights for ``name`` (its default tag when it has none)."""
    try:
        repository = get_pretrained_cfg(name).hf_hub_id
    except (RuntimeError, AttributeError):  # a tag timm does not know, or no such architecture (None)
        repository = None
    if not repository:
        raise ValueError(
            f"{KEY}={init_from}: timm knows no hub weights of the name {name}; "
            f"give a local timm state dict: {KEY}={TIMM}{name}=FILE"
        )
    return repository


def meta_model(name: str, init_from: str) -> nn.Module:
    """timm's model ``name`` built on the meta device: its modules and shapes, no values."""
    try:
        return create_model(name, pretrained=False, device="meta")
    except RuntimeError as err:  # an unknown architecture or pretrained tag
        architecture, _, tag = name.partition(".")
        if architecture in list_models():
            tags = [n.partition(".")[2] for n in list_pretrained(f"{architecture}.*")]
            why = f"timm's {architecture} has no pretrained tag {tag!r}; its tags: {', '.join(tags) or 'none'}"
        else:
            close = difflib.get_close_matches(architecture, list_models(), n=1)
            why = f"timm knows no model {architecture}" + (f"; did you mean {close[0]}?" if close else "")
        raise ValueError(f"{KEY}={init_from}: {why}") from err


def _layer_scale(block: nn.Module) -> float | None:
    """LayerScale's initial gamma (timm's ``init_values``); None without LayerScale."""
    if isinstance(block, EvaBlock):
        return block.init_values if block.gamma_1 is not None else None
    return getattr(block.ls1, "init_values", None)


def _unsupported(model: nn.Module) -> list[str]:
    """timm's settings of ``model`` that our ViT lacks, as timm names them; [] when it has them all."""
    block = model.blocks[0] if isinstance(model, (TimmVisionTransformer, Eva)) else None
    if type(model) not in (TimmVisionTransformer, Eva) or type(block) not in (Block, EvaBlock):
        classes = f"{type(model).__name__}" + (f" of {type(block).__name__} blocks" if block is not None else "")
        return [f"the class {classes} (attnlab reads timm's VisionTransformer and Eva, with their own blocks)"]
    attn, mlp, rope, embed = block.attn, block.mlp, getattr(model, "rope", None), model.patch_embed
    found = {
        f"global_pool={model.global_pool!r}": model.global_pool not in ("token", "avg"),
        "neither fc_norm nor a final norm, or both": (
            isinstance(model.fc_norm, nn.Identity) == isinstance(model.norm, nn.Identity)
        ),
        "norm_pre (a norm before the blocks)": not isinstance(model.norm_pre, nn.Identity),
        "a norm other than LayerNorm(eps=1e-6)": not isinstance(block.norm1, nn.LayerNorm) or block.norm1.eps != 1e-6,
        "an MLP other than fc1, GELU, fc2 (SwiGLU, scale_mlp)": (
            type(mlp) is not Mlp or type(mlp.act) is not nn.GELU or mlp.act.approximate != "none"
        )
        or not isinstance(mlp.norm, nn.Identity),
        "qkv_fused=False": getattr(attn, "qkv", None) is None,
        "a norm inside attention (scale_attn_inner, scale_norm)": not isinstance(
            getattr(attn, "norm", nn.Identity()), nn.Identity
        ),
        "num_kv_heads": getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads,
        "attn_only_layer_scale": isinstance(block, EvaBlock) and (block.gamma_1 is None) != (block.gamma_2 is None),
        f"the patch embedding {type(embed).__name__} (a CNN stem)": type(embed) is not PatchEmbed,
        "a patch embedding with a norm or without bias": type(embed) is PatchEmbed
        and (not isinstance(embed.norm, nn.Identity) or embed.proj.bias is None),
        "non-square patches": type(embed) is PatchEmbed and embed.patch_size[0] != embed.patch_size[1],
        "dynamic_img_pad": getattr(embed, "dynamic_img_pad", False),
        "no positions": model.pos_embed is None and rope is None,
        "learned positions and RoPE together (EVA-02)": model.pos_embed is not None and rope is not None,
        f"rope_type of {type(rope).__name__}": rope is not None and type(rope) not in _ROPES,
        "rotate_half, in_pixels, grid_offset or linear_bands RoPE": rope is not None
        and any(getattr(rope, name, False) for name in ("rotate_half", "in_pixels", "grid_offset", "linear_bands")),
    }
    return [name for name, present in found.items() if present]


def timm_architecture(model: nn.Module, init_from: str) -> dict[str, Any]:
    """Our `VisionTransformer`'s settings that timm's ``model`` (built by `meta_model`) fixes, or a ValueError
    naming what our ViT lacks."""
    if lacking := _unsupported(model):
        raise ValueError(f"{KEY}={init_from}: attnlab's ViT lacks what timm's model uses: {'; '.join(lacking)}")
    block, rope = model.blocks[0], getattr(model, "rope", None)
    hidden, width = block.mlp.fc1.out_features, model.embed_dim
    settings = dict(
        patch_size=model.patch_embed.patch_size[0],
        embed_dim=width,
        depth=len(model.blocks),
        num_heads=block.attn.num_heads,
        mlp_ratio=_mlp_ratio(hidden, width),
        global_pool=model.global_pool,
        fc_norm=not isinstance(model.fc_norm, nn.Identity),
        class_token=model.cls_token is not None,
        register_tokens=0 if model.reg_token is None else model.reg_token.shape[1],
        init_values=_layer_scale(block),
        positions="learned" if rope is None else _ROPES[type(rope)],
    )
    if rope is not None:
        settings |= dict(rope_theta=float(rope.temperature), rope_grid_indexing=rope.grid_indexing)
    return settings


def _mlp_ratio(hidden: int, width: int) -> float:
    """The MLP ratio from which our ViT's ``int(width * ratio)`` gives back ``hidden``."""
    ratio = hidden / width
    return ratio if int(width * ratio) == hidden else math.nextafter(ratio, math.inf)


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def fill_from_timm(init_from: str, network: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``network`` (our `VisionTransformer`'s arguments, ``defaults`` its defaults) with the settings that timm's
    model ``timm:NAME[=FILE]`` fixes (`timm_architecture`). A setting left unset (None) takes timm's value; one
    set to another value than timm's is refused, every such key in one line, whether or not it equals ViT-B/16's
    (`models.vision.vit.VIT_B16`: what an unset key means without timm). ``img_size``, ``in_chans`` and
    ``num_classes`` stay the data's: the weights adapt to them as to any checkpoint
    (`models.vision.pretrained.load_pretrained`)."""
    name = split_timm(init_from)[0]
    model = meta_model(name, init_from)
    timm = timm_architecture(model, init_from)
    wrong = {k: network[k] for k, v in timm.items() if network.get(k) is not None and network[k] != v}
    if wrong:
        given = ", ".join(f"model.{k}={_show(v)}" for k, v in wrong.items())
        theirs = ", ".join(f"{k}={_show(timm[k])}" for k in wrong)
        fix = f"remove it or set {_show(timm[next(iter(wrong))])}" if len(wrong) == 1 else "remove them or set these"
        verb = "contradicts" if len(wrong) == 1 else "contradict"
        raise ValueError(f"{given} {verb} timm's {name} ({theirs}); {fix}")
    _warn_scaled_rope(model, network.get("img_size", defaults["img_size"]), timm["patch_size"], init_from)
    cfg = model.pretrained_cfg
    log.info(
        f"{KEY}={init_from}: timm's registry gives {', '.join(f'{k}={_show(v)}' for k, v in timm.items())}; its "
        f"weights expect images of {cfg.get('input_size')} normalised with mean {cfg.get('mean')}, std "
        f"{cfg.get('std')} (data.mean, data.std), and {cfg.get('num_classes')} classes"
    )
    return {**network, **timm}


def _warn_scaled_rope(model: nn.Module, img_size: int, patch_size: int, init_from: str) -> None:
    """timm's axial RoPE with ``ref_feat_shape`` counts positions in units of that grid, ours in patches: they agree
    at that grid only (timm's pretrained image size). Elsewhere the rotations differ, and a warning says so."""
    reference = getattr(getattr(model, "rope", None), "ref_feat_shape", None)
    grid = img_size // patch_size
    if reference is not None and tuple(reference) != (grid, grid):
        log.warning(
            f"{KEY}={init_from}: timm scales its RoPE positions to a {reference[0]}x{reference[1]} patch grid "
            f"(ref_feat_shape), attnlab counts patches: at this {grid}x{grid} grid ({img_size} px) the rotations "
            f"differ from timm's; they agree at {reference[0] * patch_size} px"
        )


# timm VisionTransformer key -> ours (nn.TransformerEncoderLayer names in models.core.transformer).
_TIMM_KEYS = (
    (r"^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$", r"encoder.layers.\1.self_attn.in_proj_\2"),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.out_proj."),
    (r"^blocks\.(\d+)\.mlp\.fc1\.", r"encoder.layers.\1.linear1."),
    (r"^blocks\.(\d+)\.mlp\.fc2\.", r"encoder.layers.\1.linear2."),
    (r"^blocks\.(\d+)\.(norm[12])\.", r"encoder.layers.\1.\2."),
    (r"^blocks\.(\d+)\.attn\.([qk]_norm)\.", r"encoder.layers.\1.self_attn.\2."),
    (r"^norm\.", "encoder.norm."),
    (r"^blocks\.(\d+)\.(ls[12])\.gamma$", r"encoder.layers.\1.\2.gamma"),  # VisionTransformer's LayerScale
    (r"^blocks\.(\d+)\.gamma_([12])$", r"encoder.layers.\1.ls\2.gamma"),  # Eva's
    (r"^blocks\.(\d+)\.attn\.([qv])_bias$", r"encoder.layers.\1.self_attn.\2_bias"),  # Eva's, joined below
)


def timm_to_attnlab(state: dict[str, Tensor], source: str = "timm state dict") -> dict[str, Tensor]:
    """Rename the keys of a timm ``VisionTransformer`` state dict to ours.

    timm's packed ``attn.qkv`` is our ``in_proj`` (both (3D, D), q, k, v stacked), ``attn.proj`` our
    ``out_proj``, ``mlp.fc1/fc2`` our ``linear1/linear2`` and the final ``norm`` our ``encoder.norm``;
    ``attn.q_norm/k_norm`` (QK-norm) our ``self_attn.q_norm/k_norm``;
    LayerScale's ``ls1/ls2.gamma`` (Eva: ``gamma_1/gamma_2``) our ``ls1/ls2.gamma``; Eva's ``q_bias`` and
    ``v_bias`` (its key bias is zero) are packed into ``in_proj_bias``, and a projection without biases
    (``qkv_bias=False``) gets zero ones; ``cls_token``, ``reg_token``, ``patch_embed.proj``, ``fc_norm``, ``head``
    and a RoPE ViT's ``rope.freqs`` keep their names, and ``pos_embed`` is moved to our layout (`_timm_positions`).
    Keys of timm features we lack pass through unrenamed, so that loading names them.
    """
    renamed = {}
    for key, value in state.items():
        for pattern, replacement in _TIMM_KEYS:
            key = re.sub(pattern, replacement, key)
        renamed[key] = value
    for weight in [k for k in renamed if k.endswith("self_attn.in_proj_weight")]:
        layer = weight.removesuffix("in_proj_weight")
        if layer + "in_proj_bias" not in renamed:
            q, v = (renamed.pop(layer + f"{x}_bias", None) for x in "qv")
            zeros = renamed[weight].new_zeros(renamed[weight].shape[0] // 3)
            renamed[layer + "in_proj_bias"] = torch.cat([zeros if q is None else q, zeros, zeros if v is None else v])
    return _timm_positions(renamed, source)


def _timm_positions(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """timm's learned positions cover the class token, the registers and the patches, or (``no_embed_class``:
    DeiT-3, DINOv2 with registers) the patches only; ours the class token and the patches. A register's position
    is a constant added to a constant, so it joins ``reg_token``; a class token without one gets a zero one."""
    pos = state.get("pos_embed")
    if pos is None:
        return state
    cls = int("cls_token" in state)
    regs = state["reg_token"].shape[1] if "reg_token" in state else 0
    prefix = [n for n in {0, cls + regs} if math.isqrt(pos.shape[1] - n) ** 2 == pos.shape[1] - n]
    if len(prefix) != 1:
        raise ValueError(
            f"{source}: pos_embed has {pos.shape[1]} positions, not a square patch grid after {cls + regs} "
            "class and register tokens, nor without them"
        )
    state = dict(state)
    if prefix[0]:  # [class, registers, patches] -> [class, patches]
        if regs:
            state["reg_token"] = state["reg_token"] + pos[:, cls : cls + regs]
            state["pos_embed"] = torch.cat([pos[:, :cls], pos[:, cls + regs :]], dim=1)
    elif cls:  # [patches] -> [class, patches]
        state["pos_embed"] = torch.cat([pos.new_zeros(1, 1, pos.shape[-1]), pos], dim=1)
    return state
