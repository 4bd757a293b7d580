"""DETR: End-to-End Object Detection with Transformers (Carion et al. 2020) on the shared core.

CNN backbone -> 1x1 projection to width D -> post-norm Transformer encoder over the H·W feature
cells (2D sine positions added to queries and keys) -> decoder whose N learned object queries
attend to the memory -> per query a class (K + 1 with "no object") and a box (normalised cxcywh).

Parameter names follow facebookresearch/detr (``input_proj``, ``query_embed``,
``transformer.encoder/decoder.layers.*``, ``class_embed``, ``bbox_embed.layers.*``), so an official
checkpoint loads after `convert_official_state_dict`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import Similarity
from models.backbone import Backbone
from models.box_ops import box_cxcywh_to_xyxy
from models.position import PositionEmbeddingSine2D
from models.transformer import TransformerDecoder, TransformerEncoder


class MLP(nn.Module):
    """Feed-forward network with ReLU between ``num_layers`` linear layers (DETR's box head)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int):
        super().__init__()
        dims = [input_dim] + [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims, dims[1:] + [output_dim]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


class DETRTransformer(nn.Module):
    """DETR's encoder-decoder: post-norm layers, positions added to queries and keys only, the decoder
    normed and returned at every layer for the auxiliary losses.

    Shapes: src (B, D, h, w), mask (B, h, w) True at padding, query_embed (N, D), pos (B, D, h, w)
    -> decoder outputs (L_dec, B, N, D) and memory (B, h·w, D).
    """

    def __init__(self, d_model: int = 256, nhead: int = 8, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1, activation: str = "relu", similarity: Similarity = "scaled_dot"):
        super().__init__()
        layer_kwargs = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation, norm_first=False, similarity=similarity)
        self.encoder = TransformerEncoder(num_encoder_layers, d_model, nhead, final_norm=False, **layer_kwargs)
        self.decoder = TransformerDecoder(num_decoder_layers, d_model, nhead, final_norm=True, return_intermediate=True, **layer_kwargs)
        self.d_model = d_model
        for name, p in self.named_parameters():  # the reference's init; the "general" W stays the identity
            if p.dim() > 1 and not name.endswith("general_weight"):
                nn.init.xavier_uniform_(p)

    def forward(self, src: Tensor, mask: Tensor, query_embed: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        src = src.flatten(2).transpose(1, 2)  # (B, h·w, D)
        pos = pos.flatten(2).transpose(1, 2)  # (B, h·w, D)
        mask = mask.flatten(1)  # (B, h·w)
        query_pos = query_embed.unsqueeze(0).expand(src.shape[0], -1, -1)  # (B, N, D)
        memory = self.encoder(src, src_key_padding_mask=mask, pos=pos)
        tgt = torch.zeros_like(query_pos)
        hs = self.decoder(tgt, memory, memory_key_padding_mask=mask, pos=pos, query_pos=query_pos)  # (L, B, N, D)
        return hs, memory


class DETR(nn.Module):
    """The detector. Defaults are the paper's: ResNet-50 features, D = 256, 8 heads, 6 + 6 layers,
    FFN 2048, dropout 0.1, 100 queries, auxiliary decoding losses.

    Args:
        backbone: a `Backbone` (has ``num_channels`` and ``stride``).
        num_classes: K object classes; the classifier has K + 1 outputs, the last is "no object".
        num_queries: N object queries, the most objects one image can yield.
        d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout,
        activation, similarity: the Transformer (see models.transformer).
        aux_loss: return every decoder layer's predictions in ``aux_outputs``.
    Shapes: images (B, 3, H, W), mask (B, H, W) True at padding -> dict with
        ``pred_logits`` (B, N, K + 1), ``pred_boxes`` (B, N, 4) normalised cxcywh in [0, 1],
        ``aux_outputs``: L_dec - 1 dicts with the same two keys (empty without aux_loss).
    """

    def __init__(self, backbone: Backbone, num_classes: int = 91, num_queries: int = 100, d_model: int = 256, nhead: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", similarity: Similarity = "scaled_dot", aux_loss: bool = True):
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes} must be >= 1")
        if d_model % 2:
            raise ValueError(f"model.d_model={d_model} must be even: half the channels encode y, half x")
        self.num_classes, self.num_queries, self.aux_loss = num_classes, num_queries, aux_loss
        self.backbone = backbone
        self.position_embedding = PositionEmbeddingSine2D(d_model // 2, normalize=True)
        self.input_proj = nn.Conv2d(backbone.num_channels, d_model, kernel_size=1)
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.transformer = DETRTransformer(d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout, activation, similarity)
        self.class_embed = nn.Linear(d_model, num_classes + 1)
        self.bbox_embed = MLP(d_model, d_model, 4, 3)

    def no_weight_decay(self) -> set[str]:
        return {"query_embed.weight"}

    def forward(self, images: Tensor, mask: Tensor | None = None) -> dict:
        if mask is None:
            mask = torch.zeros(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        features = self.backbone(images)  # (B, C, h, w)
        mask = F.interpolate(mask[None].float(), size=features.shape[-2:]).to(torch.bool)[0]  # (B, h, w)
        pos = self.position_embedding(mask).to(features.dtype)  # (B, D, h, w)
        hs, _ = self.transformer(self.input_proj(features), mask, self.query_embed.weight, pos)  # (L, B, N, D)
        logits = self.class_embed(hs)  # (L, B, N, K + 1)
        boxes = self.bbox_embed(hs).sigmoid()  # (L, B, N, 4)
        aux = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])] if self.aux_loss else []
        return {"pred_logits": logits[-1], "pred_boxes": boxes[-1], "aux_outputs": aux}


@torch.no_grad()
def post_process(outputs: dict, target_sizes: Tensor) -> list[dict[str, Tensor]]:
    """DETR's PostProcess: every query becomes a detection with its best real class.

    Args: outputs of `DETR`; target_sizes (B, 2) as (height, width) of the original images.
    Returns: B dicts with ``scores`` (N,), ``labels`` (N,) in [0, K) and ``boxes`` (N, 4) absolute xyxy.
    """
    prob = outputs["pred_logits"].softmax(-1)[..., :-1]  # (B, N, K): the no-object column is dropped
    scores, labels = prob.max(-1)
    h, w = target_sizes.unbind(1)
    scale = torch.stack([w, h, w, h], dim=1).to(outputs["pred_boxes"].dtype)  # (B, 4)
    boxes = box_cxcywh_to_xyxy(outputs["pred_boxes"]) * scale[:, None, :]
    return [{"scores": s, "labels": l, "boxes": b} for s, l, b in zip(scores, labels, boxes)]


def convert_official_state_dict(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename a facebookresearch/detr checkpoint (``checkpoint["model"]``) to this module's keys.

    Only the backbone prefix differs (``backbone.0.body.`` -> ``backbone.body.``); the official
    classifier has 92 outputs (91 COCO ids + no object), so load it with ``num_classes=91``.
    """
    return {k.replace("backbone.0.body.", "backbone.body.", 1): v for k, v in state_dict.items()}
