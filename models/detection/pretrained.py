"""Fine-tuning DETR from a pretrained detector: ``model.init_from`` fills a `DETR` that the YAML
describes with the weights of

- a facebookresearch/detr checkpoint (``detr-r50-e632da11.pth``: ``{"model": state dict}``),
  renamed by `convert_official_state_dict`;
- a Hugging Face ``DetrForObjectDetection`` folder written by ``save_pretrained`` (``config.json``
  + ``model.safetensors``), or a hub name (``facebook/detr-resnet-50``) that huggingface_hub
  fetches into its own cache when online; renamed by `hf_to_attnlab`;
- an `attnlab fit` checkpoint (``.ckpt``: Lightning's ``state_dict`` with the ``model.`` prefix).

Every file is read as tensors only (`models.weights`). A class count or a query count that differs
from the file's re-initialises the class head (keeping the file's no-object row last) or the
queries; anything else that does not fit is an error naming the first tensor that differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import torch
from torch import Tensor

from models.detection.detr import DETR, convert_official_state_dict
from models.weights import FOLDER_WEIGHTS, load_checked, network_state, read_state, resolve

log = logging.getLogger(__name__)

KEY = "model.init_from"
_ARCHITECTURE = (
    "make the YAML describe the checkpoint's architecture (backbone, d_model, nhead, dim_feedforward, layers)"
)

# Hugging Face DETR names -> ours. Files written by transformers 4 and 5 use the left names; transformers 5
# models name the same tensors ``backbone.model``, ``o_proj`` and ``mlp.fc1`` in memory, accepted too.
_HF_KEYS = (
    (r"^model\.backbone\.(?:conv_encoder\.)?model\.", "backbone.body."),
    (r"^model\.input_projection\.", "input_proj."),
    (r"^model\.query_position_embeddings\.", "query_embed."),
    (r"^model\.decoder\.layernorm\.", "transformer.decoder.norm."),
    (r"^model\.(encoder|decoder)\.layers\.", r"transformer.\1.layers."),
    (r"^class_labels_classifier\.", "class_embed."),
    (r"^bbox_predictor\.", "bbox_embed."),
    (r"\.(?:o_proj|out_proj)\.", ".out_proj."),
    (r"\.(?:mlp\.)?fc([12])\.", r".linear\1."),
    (r"\.self_attn_layer_norm\.", ".norm1."),
    (r"^(transformer\.encoder\.layers\.\d+)\.final_layer_norm\.", r"\1.norm2."),
    (r"\.encoder_attn_layer_norm\.", ".norm2."),
    (r"\.final_layer_norm\.", ".norm3."),
    (r"\.encoder_attn\.", ".multihead_attn."),
)
# transformers' own ResNet (``use_timm_backbone: false``) -> timm's ResNet names
_HF_RESNET_KEYS = (
    (r"\.embedder\.embedder\.convolution\.", lambda m: ".conv1."),
    (r"\.embedder\.embedder\.normalization\.", lambda m: ".bn1."),
    (
        r"\.encoder\.stages\.(\d+)\.layers\.(\d+)\.shortcut\.(convolution|normalization)\.",
        lambda m: f".layer{int(m[1]) + 1}.{m[2]}.downsample.{int(m[3] == 'normalization')}.",
    ),
    (
        r"\.encoder\.stages\.(\d+)\.layers\.(\d+)\.layer\.(\d+)\.(convolution|normalization)\.",
        lambda m: f".layer{int(m[1]) + 1}.{m[2]}.{'conv' if m[4] == 'convolution' else 'bn'}{int(m[3]) + 1}.",
    ),
)


def hf_to_attnlab(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a Hugging Face ``DetrForObjectDetection`` state dict to this project's `DETR` keys.

    HF projects queries, keys and values with three (D, D) linears (``q_proj``, ``k_proj``,
    ``v_proj``); ours packs them as nn.MultiheadAttention does, ``in_proj_weight`` (3D, D) with
    q, k, v stacked in that order (biases likewise).
    """
    renamed: dict[str, Tensor] = {}
    for key, value in state.items():
        for pattern, replacement in _HF_KEYS + _HF_RESNET_KEYS:
            key = re.sub(pattern, replacement, key)
        renamed[key] = value
    packed = {}
    for key in [k for k in renamed if re.search(r"\.q_proj\.(weight|bias)$", k)]:
        prefix, kind = key.rsplit(".q_proj.", 1)
        parts = [renamed.pop(f"{prefix}.{p}_proj.{kind}", None) for p in "qkv"]
        if any(p is None for p in parts):
            raise ValueError(
                f"{KEY}: {prefix} has q_proj.{kind} without k_proj.{kind} and v_proj.{kind}; is it a DETR checkpoint?"
            )
        packed[f"{prefix}.in_proj_{kind}"] = torch.cat(parts)  # (3D, D) or (3D,)
    return {**renamed, **packed}


def _read_hf_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "detr":
        raise ValueError(
            f"{KEY}: {folder}/config.json describes a {config.get('model_type')!r} model, not DETR (model_type 'detr')"
        )
    return config


def read_detr_weights(source: str) -> tuple[dict[str, Tensor], dict | None]:
    """The weights named by ``model.init_from`` with our key names, and the Hugging Face config when
    the source is a ``save_pretrained`` folder or a hub name (else None).

    Raises:
        FileNotFoundError: ``source`` is neither a local file or folder nor an "owner/name" hub name.
        ValueError: the file holds pickled code (refused before it runs), is damaged, or holds no
            state dict of tensors; a hub name while offline and not in the cache.
    """
    path = resolve(
        source,
        KEY,
        "give a facebookresearch/detr .pth, an attnlab .ckpt, a Hugging Face save_pretrained folder or a hub name "
        "such as facebook/detr-resnet-50",
        hub_files=("config.json",),
    )
    config = None
    if path.is_dir():
        if not (path / "config.json").is_file() or not any((path / name).is_file() for name in FOLDER_WEIGHTS):
            raise FileNotFoundError(
                f"{KEY}: {path} is a folder without config.json and {' or '.join(FOLDER_WEIGHTS[::2])}; "
                "give a folder written by DetrForObjectDetection.save_pretrained"
            )
        config = _read_hf_config(path)
    state = read_state(path, KEY, safe_globals=[argparse.Namespace])  # detr's own checkpoints hold args
    if "class_labels_classifier.weight" in state or any(k.startswith("model.encoder.layers.") for k in state):
        return hf_to_attnlab(state), config
    if any(k.startswith("backbone.0.") for k in state):
        return convert_official_state_dict(state), config
    return network_state(state), config  # an attnlab .ckpt: the detector is the module's ``model``


def _check_hf_config(model: DETR, config: dict, source: str) -> None:
    """What a Hugging Face config states that the tensors' shapes do not: heads, positions, dilation."""
    nhead = model.transformer.encoder.layers[0].self_attn.num_heads
    for field in ("encoder_attention_heads", "decoder_attention_heads"):
        if config.get(field, nhead) != nhead:
            raise ValueError(
                f"{KEY}: {source} has {config[field]} heads ({field} in config.json), the model model.nhead={nhead}"
            )
    if config.get("position_embedding_type", "sine") != "sine":
        raise ValueError(
            f"{KEY}: {source} uses {config['position_embedding_type']!r} positions; attnlab's DETR has the sine ones"
        )
    stride = 16 if config.get("dilation") else 32
    if model.backbone.stride != stride:
        raise ValueError(
            f"{KEY}: {source} has a backbone of stride {stride} (dilation={config.get('dilation', False)} in config.json), "
            f"the model {model.backbone.stride}; set model.backbone_out_index=4"
            + (" and model.backbone_kwargs={output_stride: 16} (DC5)" if stride == 16 else "")
        )


def load_detr_weights(model: DETR, source: str) -> None:
    """Fill ``model`` with the weights named by ``model.init_from`` (see the module docstring).

    A different class count re-initialises the class rows of the head and keeps the file's
    no-object row as the last output; a different query count re-initialises the queries (both
    logged in one line). Any other tensor missing, extra or of another shape is a ValueError naming it.
    """
    state, config = read_detr_weights(source)
    if config is not None:
        _check_hf_config(model, config, source)
    own = model.state_dict()
    changed = []
    for name in ("class_embed", "proposals.enc_class_embed"):  # the decoder's and the encoder cells' classifiers
        head, file_head = own.get(f"{name}.weight"), state.get(f"{name}.weight")
        if (
            head is None
            or file_head is None
            or file_head.shape[0] == head.shape[0]
            or file_head.shape[1:] != head.shape[1:]
        ):
            continue
        for kind in ("weight", "bias"):  # the model's fresh class rows (then, softmax, the file's no-object row)
            fresh = own[f"{name}.{kind}"]
            state[f"{name}.{kind}"] = fresh if model.focal else torch.cat([fresh[:-1], state[f"{name}.{kind}"][-1:]])
        classes, file_classes = (len(head), len(file_head)) if model.focal else (len(head) - 1, len(file_head) - 1)
        kept = "" if model.focal else "; its no-object row is kept, last"
        changed.append(f"{name} re-initialised for {classes} classes (the file has {file_classes}{kept})")
    for name in ("query_embed.weight", "refpoint_embed.weight"):  # learned queries (vanilla) or anchors (DAB)
        queries, file_queries = own.get(name), state.get(name)
        if queries is None or file_queries is None:
            continue
        if file_queries.shape[0] != queries.shape[0] and file_queries.shape[1:] == queries.shape[1:]:
            state[name] = queries
            changed.append(f"{queries.shape[0]} object queries re-initialised (the file has {file_queries.shape[0]})")
    load_checked(model, state, f"{KEY}: {source}", "DETR", _ARCHITECTURE)
    if changed:
        log.warning("%s=%s: %s", KEY, source, "; ".join(changed))
