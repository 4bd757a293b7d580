"""Weights for a `VisionTransformer` from a local file (`load_pretrained`): a checkpoint of our own
(`attnlab fit` writes Lightning ``.ckpt`` files) or a timm ``VisionTransformer`` state dict
(``.pth``/``.bin``/``.safetensors``), renamed by `models.vision.timm_names.timm_to_attnlab`; or from a timm hub name
(``timm/vit_small_patch16_224.augreg_in21k``), the hub repository of timm's weights, through huggingface_hub's
cache (`models.weights`: one path for foreign weights); or by timm's model name (``timm:vit_small_patch16_224``),
which also sets the architecture (`models.vision.timm_names`). Positions are resampled
(bicubic, timm's ``resample_abs_pos_embed``) when the patch grid differs from the checkpoint's,
the patch projection is adapted when the channel count differs, and the head is re-initialised
when the class count differs.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from timm.layers import resample_abs_pos_embed
from timm.models import adapt_input_conv
from torch import Tensor

from models.vision.timm_names import KEY, TIMM, hub_repository, split_timm, timm_to_attnlab
from models.vision.vit import VisionTransformer
from models.weights import WEIGHT_SUFFIXES, load_checked, network_state, read_state, resolve

log = logging.getLogger(__name__)


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
    `models.vision.timm_names.fill_from_timm` has read."""
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
