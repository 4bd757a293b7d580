"""DETR: End-to-End Object Detection with Transformers (Carion et al. 2020) on the shared core.

CNN backbone -> 1x1 projection to width D -> post-norm Transformer encoder over the H·W feature
cells (2D sine positions added to queries and keys, or 2D RoPE: ``encoder_positions``) -> decoder whose N learned object queries
attend to the memory -> per query a class (K + 1 with "no object") and a box (normalised cxcywh).

Parameter names follow facebookresearch/detr (``input_proj``, ``query_embed``,
``transformer.encoder/decoder.layers.*``, ``class_embed``, ``bbox_embed.layers.*``), so an official
checkpoint loads after `convert_official_state_dict`.

Options for faster convergence, all off by default (the paper's DETR): anchor-box queries refined
layer by layer (DAB-DETR, ``query_type="anchor"``), queries selected from the encoder's own dense
proposals (two-stage Deformable DETR, DINO, RT-DETR: ``query_type="encoder"``), sigmoid focal classes
(``class_loss="focal"``), and denoising queries in training (DN-DETR, ``dn_number`` > 0, see
models.detection.denoising). They change only how queries are built, which queries see which (a self-attention
mask), and the losses; every attention still runs through models.core.attention.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.core.attention import DEFAULT_ATTENTION, AttentionConfig
from models.core.position import PositionEmbeddingSine2D, RotaryEmbedding2D, Rotation
from models.core.registers import insert_registers, learned_registers, pad_rows, unplaced
from models.core.transformer import TransformerDecoder, TransformerEncoder
from models.detection.backbone import Backbone, BackboneNorm
from models.detection.box_ops import box_cxcywh_to_xyxy, inverse_sigmoid
from models.detection.denoising import DenoisingQueries, check_denoising, denoising_queries
from models.detection.query_selection import EncoderProposals, cell_boxes


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
    normed and returned at every layer for the auxiliary losses. `DETR` runs the encoder through
    ``encode`` and the decoder with the queries it builds; its signature holds the defaults.

    Shapes: src (B, D, h, w), mask (B, h, w) True at padding, pos (B, D, h, w)
    -> memory (B, h·w + R, D), mask (B, h·w + R), pos (B, h·w + R, D). With ``rope`` (2D RoPE over the cells,
    one `Rotation` or one per layer) the encoder takes it instead of ``pos``; ``pos`` still goes to the decoder's
    memory keys. ``register_tokens`` = R learned registers (`models.core.registers`, ``reg_token``) are appended to the
    cells: they have no position (zero ``pos``, no rotation), are never masked, and stay in the memory, where the
    decoder's cross-attention sees them.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        num_encoder_layers: int,
        num_decoder_layers: int,
        dim_feedforward: int,
        dropout: float,
        activation: str,
        attention: AttentionConfig | None = None,
        register_tokens: int = 0,
        init_values: float | None = None,
    ):
        super().__init__()
        layer_kwargs = dict(
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation=activation,
            norm_first=False,
            attention=attention,
            init_values=init_values,
        )
        self.encoder = TransformerEncoder(num_encoder_layers, d_model, nhead, final_norm=False, **layer_kwargs)
        self.decoder = TransformerDecoder(
            num_decoder_layers, d_model, nhead, final_norm=True, return_intermediate=True, **layer_kwargs
        )
        self.d_model = d_model
        for name, p in self.named_parameters():  # the reference's init; the "general" W stays the identity
            if p.dim() > 1 and not name.endswith("general_weight"):
                nn.init.xavier_uniform_(p)
        self.reg_token = learned_registers(register_tokens, d_model)

    def encode(
        self, src: Tensor, mask: Tensor, pos: Tensor, rope: Rotation | list[Rotation] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        src = src.flatten(2).transpose(1, 2)  # (B, h·w, D)
        pos = pos.flatten(2).transpose(1, 2)  # (B, h·w, D)
        mask = mask.flatten(1)  # (B, h·w)
        if self.reg_token is not None:
            cells, n = src.shape[1], self.reg_token.shape[1]
            src = insert_registers(src, self.reg_token, cells)  # (B, h·w + R, D)
            mask, pos = pad_rows(mask, n, False), pad_rows(pos, n)
            rope = unplaced({"rope": rope}, cells, n)["rope"]
        encoder_pos = pos if rope is None else None
        return self.encoder(src, src_key_padding_mask=mask, pos=encoder_pos, rope=rope), mask, pos


def box_sine_embedding(boxes: Tensor, num_pos_feats: int, temperature: float = 10000.0) -> Tensor:
    """DAB-DETR's sine embedding of boxes: (..., 4) normalised cxcywh -> (..., 4·num_pos_feats), each
    coordinate encoded as `PositionEmbeddingSine2D` encodes a normalised position (scale 2π), in the
    order y, x, w, h (DAB-DETR's ``gen_sineembed_for_position``)."""
    dim_t = torch.arange(num_pos_feats, dtype=torch.float32, device=boxes.device)
    dim_t = temperature ** (2 * (dim_t // 2) / num_pos_feats)
    pos = boxes.float()[..., None] * (2 * math.pi) / dim_t  # (..., 4, F)
    pos = torch.stack((pos[..., 0::2].sin(), pos[..., 1::2].cos()), dim=-1).flatten(-2)  # (..., 4, F)
    return pos[..., [1, 0, 2, 3], :].flatten(-2).to(boxes.dtype)


QueryType = Literal["vanilla", "anchor", "encoder"]
ClassLoss = Literal["ce", "focal"]


def _check_settings(
    num_classes: int, d_model: int, nhead: int, encoder_positions: str, query_type: str, class_loss: str
) -> None:
    """Settings of `DETR` that cannot work (together), refused with their keys."""
    if num_classes < 1:
        raise ValueError(f"num_classes={num_classes} must be >= 1")
    if d_model % 2:
        raise ValueError(f"model.d_model={d_model} must be even: half the channels encode y, half x")
    if encoder_positions not in ("sine", "rope_axial", "rope_mixed"):
        raise ValueError(
            f"model.encoder_positions={encoder_positions!r} is not known; choose sine, rope_axial or rope_mixed"
        )
    if encoder_positions != "sine" and (d_model // nhead) % 4:
        raise ValueError(
            f"model.encoder_positions={encoder_positions} needs a head size divisible by 4, "
            f"got model.d_model/model.nhead = {d_model // nhead}"
        )
    if query_type not in ("vanilla", "anchor", "encoder"):
        raise ValueError(f"model.query_type={query_type!r} is not known; choose 'vanilla', 'anchor' or 'encoder'")
    if class_loss not in ("ce", "focal"):
        raise ValueError(f"model.class_loss={class_loss!r} is not known; choose 'ce' or 'focal'")


class DETR(nn.Module):
    """The detector. Defaults are the paper's (its ResNet-50 trunk is `build_detr`'s default): D = 256,
    8 heads, 6 + 6 layers, FFN 2048, dropout 0.1, 100 queries, auxiliary decoding losses.

    Args:
        backbone: a `Backbone` (has ``num_channels`` and ``stride``).
        num_classes: K object classes; the classifier has K + 1 outputs, the last is "no object"
            (K sigmoid outputs with ``class_loss="focal"``).
        num_queries: N object queries, the most objects one image can yield.
        d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout,
        activation: the Transformer (see models.core.transformer).
        attention: the attention block of every attention (similarity, qk_norm, normalization, gate; see
            models.core.attention).
        encoder_positions: "sine" (the paper: the 2D sine encoding added to the encoder's queries and keys)
            or "rope_axial" / "rope_mixed" (2D RoPE over the feature-map cells, Heo et al. 2024, counted from
            the top-left cell, so that padding at the bottom and right moves no cell; padded cells stay
            blocked as keys). The decoder's memory keys keep the sine encoding either way.
        aux_loss: return every decoder layer's predictions in ``aux_outputs``.
        query_type: "vanilla" (the paper: N learned positional queries, boxes predicted absolutely)
            or "anchor" (DAB-DETR, Liu et al. 2022: N learned anchor boxes; each decoder layer's
            positional query is an MLP of the sine embedding of its anchor, the layer predicts a
            delta in inverse-sigmoid space, and the refined box, detached, is the next layer's anchor)
            or "encoder" (two-stage query selection, as Deformable DETR's two-stage variant, DINO and
            RT-DETR: every encoder cell predicts a class and a box relative to the cell, trained with the
            set loss like a decoder layer (``enc_outputs``); the N best-scoring cells become the queries,
            their memory the content and their boxes, detached, the anchors that the decoder refines as
            DAB-DETR's do). The dense supervision of every cell reaches the trunk from the first step.
        class_loss: "ce" (softmax with a no-object class, the paper) or "focal" (sigmoid per class,
            as Deformable DETR / DAB-DETR; the classifier bias starts at a 1% prior).
        dn_number, dn_label_noise, dn_box_noise: denoising training (see models.detection.denoising): groups of
            noised ground truth decoded beside the matching queries during training (0 groups: off).
        register_tokens: R learned registers appended to the encoder's cells (`DETRTransformer`); they stay in
            the memory the decoder attends to, and query selection leaves them out.
        init_values: LayerScale on every residual branch of both stacks (see models.core.transformer); None: none.
    Shapes: images (B, 3, H, W), mask (B, H, W) True at padding, targets (training with denoising
        only): B dicts with "labels" (T_b,), "boxes" (T_b, 4) -> dict with
        ``pred_logits`` (B, N, K + 1), ``pred_boxes`` (B, N, 4) normalised cxcywh in [0, 1],
        ``aux_outputs``: L_dec - 1 dicts with the same two keys (empty without aux_loss);
        with denoising, ``dn_outputs``: the same three keys over the G·P denoising slots, and
        ``num_groups``; with encoder queries, ``enc_outputs``: the per-cell proposals (B, h·w, ·)
        and their ``padding`` (B, h·w), which the matcher leaves out;
        with focal classes, ``sigmoid``: True.
    """

    def __init__(
        self,
        backbone: Backbone,
        num_classes: int = 91,
        num_queries: int = 100,
        d_model: int = 256,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str = "relu",
        attention: AttentionConfig = DEFAULT_ATTENTION,
        encoder_positions: Literal["sine", "rope_axial", "rope_mixed"] = "sine",
        aux_loss: bool = True,
        query_type: QueryType = "vanilla",
        class_loss: ClassLoss = "ce",
        dn_number: int = 0,
        dn_label_noise: float = 0.2,
        dn_box_noise: float = 0.4,
        register_tokens: int = 0,
        init_values: float | None = None,
    ):
        super().__init__()
        _check_settings(num_classes, d_model, nhead, encoder_positions, query_type, class_loss)
        check_denoising(dn_number, dn_label_noise, dn_box_noise)
        self.num_classes, self.num_queries, self.aux_loss = num_classes, num_queries, aux_loss
        self.query_type, self.focal = query_type, class_loss == "focal"
        self.dn_number, self.dn_label_noise, self.dn_box_noise = dn_number, dn_label_noise, dn_box_noise
        self.backbone = backbone
        self.position_embedding = PositionEmbeddingSine2D(d_model // 2, normalize=True)
        self.encoder_rope = (
            None
            if encoder_positions == "sine"
            else RotaryEmbedding2D(
                d_model // nhead, nhead, encoder_positions.removeprefix("rope_"), depth=num_encoder_layers
            )
        )
        self.input_proj = nn.Conv2d(backbone.num_channels, d_model, kernel_size=1)
        if query_type == "vanilla":
            self.query_embed = nn.Embedding(num_queries, d_model)
        self.transformer = DETRTransformer(
            d_model,
            nhead,
            num_encoder_layers,
            num_decoder_layers,
            dim_feedforward,
            dropout,
            activation,
            attention,
            register_tokens=register_tokens,
            init_values=init_values,
        )
        self._build_heads(d_model, num_classes, num_queries)

    def _build_heads(self, d_model: int, num_classes: int, num_queries: int) -> None:
        """The prediction heads (class, box) and what the query type and denoising add: proposals per encoder
        cell, learned anchors, the MLP from boxes to positional queries, the label embedding of noised queries."""
        self.class_embed = nn.Linear(d_model, num_classes if self.focal else num_classes + 1)
        self.bbox_embed = MLP(d_model, d_model, 4, 3)
        if self.query_type == "encoder":
            self.proposals = EncoderProposals(MLP(d_model, d_model, 4, 3), d_model, num_classes, self.focal)
        if self.query_type == "anchor":
            self.refpoint_embed = nn.Embedding(num_queries, 4)  # anchors before the sigmoid
            with torch.no_grad():  # centres uniform over the image (DAB-DETR's random_refpoints_xy); sizes N(0, 1)
                self.refpoint_embed.weight[:, :2] = inverse_sigmoid(torch.rand(num_queries, 2))
        if self.query_type != "vanilla":  # the first prediction is the anchor itself
            nn.init.zeros_(self.bbox_embed.layers[-1].weight)
            nn.init.zeros_(self.bbox_embed.layers[-1].bias)
        if self.query_type != "vanilla" or self.dn_number > 0:  # boxes (anchors, noised boxes) -> positional queries
            self.ref_point_head = MLP(2 * d_model, d_model, d_model, 2)
        if self.dn_number > 0:
            self.label_enc = nn.Embedding(num_classes + 1, d_model)  # the last row embeds padding slots
        if self.focal:
            nn.init.constant_(self.class_embed.bias, -math.log((1 - 0.01) / 0.01))

    def no_weight_decay(self) -> set[str]:
        return {"query_embed.weight", "refpoint_embed.weight", "encoder_rope.freqs", "transformer.reg_token"}

    def register_keys(self) -> dict[str, slice]:
        """The attention layers whose keys include the registers -> their key positions: the last R of the
        encoder's self-attention and of the decoder's cross-attention (the memory)."""
        reg = self.transformer.reg_token
        if reg is None:
            return {}
        last = slice(-reg.shape[1], None)
        names = [f"transformer.encoder.layers.{i}.self_attn" for i in range(len(self.transformer.encoder.layers))]
        names += [f"transformer.decoder.layers.{i}.multihead_attn" for i in range(len(self.transformer.decoder.layers))]
        return dict.fromkeys(names, last)

    def forward(
        self, images: Tensor, mask: Tensor | None = None, targets: list[dict[str, Tensor]] | None = None
    ) -> dict:
        """``targets`` are read in training with ``dn_number > 0`` only (the denoising queries)."""
        memory, memory_mask, pos, cells = self.encode(images, mask)
        dn = None
        if self.training and self.dn_number > 0 and targets is not None:
            dn = denoising_queries(
                targets, self.dn_number, self.dn_label_noise, self.dn_box_noise, self.num_classes, self.num_queries
            )
        return self.decode(memory, memory_mask, pos, cells, dn)

    def encode(self, images: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """images (B, 3, H, W) -> memory (B, h·w + R, D), its padding mask (B, h·w + R), positions (B, h·w + R, D)
        (R registers last, see `DETRTransformer`) and the cells as boxes (B, h·w, 4), see `cell_boxes`."""
        if mask is None:
            mask = torch.zeros(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        features = self.backbone(images)  # (B, C, h, w)
        mask = F.interpolate(mask[None].float(), size=features.shape[-2:]).to(torch.bool)[0]  # (B, h, w)
        pos = self.position_embedding(mask).to(features.dtype)  # (B, D, h, w)
        rope = None if self.encoder_rope is None else self.encoder_rope(tuple(features.shape[-2:]))
        return *self.transformer.encode(self.input_proj(features), mask, pos, rope), cell_boxes(mask)

    def decode(
        self, memory: Tensor, memory_mask: Tensor, pos: Tensor, cells: Tensor, dn: DenoisingQueries | None = None
    ) -> dict:
        """The N object queries (and the denoising queries ``dn``) against the memory -> the output dict."""
        batch, n = memory.shape[0], self.num_queries
        tgt = memory.new_zeros(batch, n, self.transformer.d_model)  # content queries start empty, as in DETR
        tgt_mask = padding = enc_outputs = None
        if self.query_type == "encoder":  # among the cells: the registers (after them) propose nothing
            hw = cells.shape[1]
            tgt, anchors, enc_outputs = self.proposals(memory[:, :hw], memory_mask[:, :hw], cells, n)
        elif self.query_type == "anchor":
            anchors = self.refpoint_embed.weight.sigmoid()[None].expand(batch, -1, -1)  # (B, N, 4)
        if dn is not None:
            tgt = torch.cat([tgt, self.label_enc(dn.labels)], dim=1)  # (B, N + G·P, D)
            tgt_mask = dn.attn_mask
            padding = torch.cat([dn.padding.new_zeros(batch, n), dn.padding], dim=1)  # (B, N + G·P)
        # the decoder layers' masks, the same for the stack (vanilla queries) and for the anchors' loop
        masks = {"tgt_mask": tgt_mask, "tgt_key_padding_mask": padding, "memory_key_padding_mask": memory_mask}
        if self.query_type != "vanilla":
            if dn is not None:
                anchors = torch.cat([anchors, dn.boxes.to(anchors.dtype)], dim=1)
            hs, boxes = self._refine_anchors(tgt, anchors, memory, pos, masks)
        else:
            query_pos = self.query_embed.weight[None].expand(batch, -1, -1)  # (B, N, D)
            if dn is not None:
                dn_pos = self.ref_point_head(
                    box_sine_embedding(dn.boxes.to(query_pos.dtype), self.transformer.d_model // 2)
                )
                query_pos = torch.cat([query_pos, dn_pos], dim=1)
            hs = self.transformer.decoder(tgt, memory, pos=pos, query_pos=query_pos, **masks)  # (L, B, N + G·P, D)
            boxes = self.bbox_embed(hs).sigmoid()  # (L, B, N + G·P, 4)
        logits = self.class_embed(hs)  # (L, B, N + G·P, K + 1)
        out = self._outputs(logits[:, :, :n], boxes[:, :, :n])
        if dn is not None:
            out["dn_outputs"] = {**self._outputs(logits[:, :, n:], boxes[:, :, n:]), "num_groups": dn.num_groups}
        if enc_outputs is not None:
            out["enc_outputs"] = enc_outputs
        if self.focal:
            out["sigmoid"] = True
        return out

    def _outputs(self, logits: Tensor, boxes: Tensor) -> dict:
        """Per-layer (L, B, Q, ·) predictions -> the last layer's, and the others as ``aux_outputs``."""
        aux = [{"pred_logits": a, "pred_boxes": b} for a, b in zip(logits[:-1], boxes[:-1])] if self.aux_loss else []
        return {"pred_logits": logits[-1], "pred_boxes": boxes[-1], "aux_outputs": aux}

    def _refine_anchors(
        self, tgt: Tensor, anchors: Tensor, memory: Tensor, pos: Tensor, masks: dict[str, Tensor | None]
    ) -> tuple[Tensor, Tensor]:
        """DAB-DETR's decoder: layer l takes its positional query from its anchor a_l (B, Q, 4) and predicts
        b_l = sigmoid(inverse_sigmoid(a_l) + bbox_embed(h_l)); a_{l+1} = b_l, detached, so that each layer
        learns its own correction. ``masks``: the decoder layers' mask arguments. Returns hs (L, B, Q, D) and
        boxes (L, B, Q, 4)."""
        decoder, x = self.transformer.decoder, tgt
        hs, boxes = [], []
        for layer in decoder.layers:
            query_pos = self.ref_point_head(box_sine_embedding(anchors, self.transformer.d_model // 2))  # (B, Q, D)
            x = layer(x, memory, pos=pos, query_pos=query_pos, **masks)
            h = decoder.norm(x)
            box = (inverse_sigmoid(anchors) + self.bbox_embed(h)).sigmoid()
            hs.append(h)
            boxes.append(box)
            anchors = box.detach()
        return torch.stack(hs), torch.stack(boxes)


@torch.no_grad()
def post_process(outputs: dict, target_sizes: Tensor) -> list[dict[str, Tensor]]:
    """DETR's PostProcess: every query becomes a detection with its best real class.

    Args: outputs of `DETR`; target_sizes (B, 2) as (height, width) of the original images.
    Returns: B dicts with ``scores`` (N,), ``labels`` (N,) in [0, K) and ``boxes`` (N, 4) absolute xyxy.
    """
    if outputs.get("sigmoid"):  # focal classes: one probability per class, no no-object column
        prob = outputs["pred_logits"].sigmoid()  # (B, N, K)
    else:
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


def build_detr(
    backbone: str = "resnet50",
    backbone_out_index: int = 4,
    backbone_norm: BackboneNorm = "frozen_bn",
    trainable_backbone_layers: int = 3,
    backbone_weights: str | None = None,
    backbone_pretrained: bool = False,
    backbone_kwargs: dict[str, Any] | None = None,
    **detr: Any,
) -> DETR:
    """`DETR` on the `Backbone` these flat arguments describe (the reference's ``build``): the one place
    that holds the detector's defaults, which `attnlab` shows as ``model.init_args.*``.

    Args:
        backbone, backbone_out_index, backbone_norm, trainable_backbone_layers, backbone_weights,
        backbone_pretrained: `Backbone`'s ``name``, ``out_index``, ``norm``, ``trainable_layers``,
            ``weights``, ``pretrained``; the defaults are the reference's trunk (ResNet-50, layer4,
            frozen BatchNorm, layer2-4 trained).
        backbone_kwargs: passed to ``timm.create_model`` (e.g. ``layers``, ``channels``, ``stem_width``).
        **detr: the arguments of `DETR` after ``backbone`` (its docstring holds them, its signature
            their defaults).
    """
    trunk = Backbone(
        backbone,
        backbone_out_index,
        backbone_norm,
        trainable_backbone_layers,
        backbone_weights,
        backbone_pretrained,
        **(backbone_kwargs or {}),
    )
    return DETR(trunk, **detr)
