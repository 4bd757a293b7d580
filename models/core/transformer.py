"""Encoder and decoder layers and stacks built on the shared attention core.

Parameter names follow ``torch.nn.TransformerEncoderLayer``/``TransformerDecoderLayer``
(``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``, ``norm1..3``), so their state dicts
load unchanged. Both layers run pre-norm (``norm_first=True``, ViT/GPT) or post-norm (the paper,
DETR). Optional positional terms (DETR) are added to queries and keys only, never to values.
Positions inside the self-attention (``rope``: a `Rotation`; ``position_bias``: (H, Lq, Lk) added to the
logits) are handed to it unchanged; a stack takes one for all its layers or a sequence of one per layer
(mixed 2D RoPE, a Swin table per layer). Cross-attention takes neither (as in T5).

Llama's layer is a pre-norm layer with ``norm="rmsnorm"`` (Zhang & Sennrich 2019), ``activation="swiglu"``
(Shazeer 2020: silu(x·W_gate) ⊙ (x·W_up), then W_down; ``linear1`` packs W_gate's rows, then W_up's, so it is
(2·dim_feedforward, D)), ``bias=False`` and grouped-query attention (``num_kv_heads``, see models.core.attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from timm.layers import DropPath, LayerScale
from torch import Tensor, nn

from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.kv_cache import KVCache, StaticKVCache
from models.core.position import Rotation

Activation = Literal["relu", "gelu", "gelu_tanh", "silu", "swiglu"]
Norm = Literal["layernorm", "rmsnorm"]
_NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


def _swiglu(x: Tensor) -> Tensor:
    """(..., 2F) holding the gate, then the up projection -> (..., F): silu(gate) ⊙ up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# gelu_tanh: GPT-2's tanh approximation of GELU ("gelu_new"); silu: x·sigmoid(x), Marian's "swish";
# swiglu: a gated MLP whose linear1 is twice as wide (module docstring)
_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "swiglu": _swiglu,
}


@dataclass
class DecoderLayerCache:
    """A decoder layer's keys and values between decoding steps: its self-attention's, which grow by a
    step each call, and its cross-attention's, computed once from the memory."""

    self_attn: KVCache | StaticKVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(static=True))

    def reorder(self, index: Tensor, static_index: Tensor | None) -> None:
        """See `KVCache.reorder`."""
        self.self_attn.reorder(index, static_index)
        self.cross_attn.reorder(index, static_index)


def _with_pos(x: Tensor, pos: Tensor | None) -> Tensor:
    return x if pos is None else x + pos


def _residual(
    x: Tensor, sublayer: Callable[[Tensor], Tensor], norm: nn.Module, norm_first: bool, scale: nn.Module
) -> Tensor:
    """One sublayer with its residual connection: norm before the sublayer (pre-norm) or after the sum (post-norm);
    ``scale`` (LayerScale or the identity) multiplies the branch before the sum."""
    return x + scale(sublayer(norm(x))) if norm_first else norm(x + scale(sublayer(x)))


def _layer_scale(d_model: int, init_values: float | None) -> nn.Module:
    """LayerScale (Touvron et al. 2021, CaiT): a learned per-channel ``gamma`` (D,), started at ``init_values``,
    multiplying a residual branch; the identity when ``init_values`` is None (timm's ``ls1``/``ls2``)."""
    return nn.Identity() if init_values is None else LayerScale(d_model, init_values)


def _self_attention(
    attn: MultiHeadAttention,
    x: Tensor,
    pos: Tensor | None,
    mask: Tensor | None,
    kpm: Tensor | None,
    is_causal: bool,
    cache: KVCache | StaticKVCache | None,
    rope: Rotation | None,
    bias: Tensor | None,
) -> Tensor:
    """Self-attention of x (B, L, D), ``pos`` added to its queries and keys, not to its values."""
    qk = _with_pos(x, pos)
    return attn(
        qk, qk, x, attn_mask=mask, key_padding_mask=kpm, is_causal=is_causal, cache=cache, rope=rope, position_bias=bias
    )[0]


def _final_norm(final_norm: bool, d_model: int, layer_kwargs: dict) -> nn.Module | None:
    """A stack's norm after its last layer, of its layers' kind (pre-norm needs one)."""
    if not final_norm:
        return None
    return _norm(layer_kwargs.get("norm", "layernorm"), d_model, layer_kwargs.get("layer_norm_eps", 1e-5))


def _or(rate: float | None, default: float) -> float:
    return default if rate is None else rate


def _layer_item(x, i: int):
    """The ``i``-th layer's rope or bias: a sequence holds one per layer, anything else serves every layer."""
    return x[i] if isinstance(x, Sequence) else x


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not known; choose one of {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _norm(kind: str, d_model: int, eps: float) -> nn.Module:
    if kind not in _NORMS:
        raise ValueError(f"norm={kind!r} is not known; choose one of {', '.join(_NORMS)}")
    return _NORMS[kind](d_model, eps=eps)


def _mlp_in(d_model: int, dim_feedforward: int, activation: str, bias: bool) -> nn.Linear:
    """The MLP's first projection: (D -> F), or (D -> 2F) holding the gate and the up projection of SwiGLU."""
    return nn.Linear(d_model, dim_feedforward * (2 if activation == "swiglu" else 1), bias=bias)


class TransformerEncoderLayer(nn.Module):
    """Self-attention + feed-forward, each with a residual connection and LayerNorm.

    Args:
        d_model: width D. nhead: heads. dim_feedforward: hidden width of the MLP.
        dropout: dropout after attention and MLP (the paper's residual dropout), and the two below unless given.
        activation: "relu", "gelu", "gelu_tanh" or "silu".
        norm_first: pre-norm if True, post-norm (the paper) if False.
        attention: the attention block (similarity, qk_norm, normalization, gate; see models.core.attention).
        drop_path: stochastic depth rate.
        attn_dropout: dropout on the attention weights. activation_dropout: dropout inside the MLP, after
            its activation (fairseq's ``attention_dropout`` and ``activation_dropout``). None: ``dropout``.
        norm: "layernorm" or "rmsnorm" (Llama). bias: biases on the attention's and the MLP's projections.
        num_kv_heads: key/value heads of grouped-query attention (see models.core.attention); None: ``nhead``.
        init_values: LayerScale's start (Touvron et al. 2021): ``ls1``/``ls2`` multiply the attention's and the
            MLP's branch by a learned ``gamma`` (D,) started at this value (timm's names); None: no LayerScale.
    Shapes: src (B, L, D), pos (B, L, D) or None, src_key_padding_mask (B, L) -> (B, L, D).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        attention: AttentionConfig | None = None,
        layer_norm_eps: float = 1e-5,
        drop_path: float = 0.0,
        attn_dropout: float | None = None,
        activation_dropout: float | None = None,
        norm: Norm = "layernorm",
        bias: bool = True,
        num_kv_heads: int | None = None,
        init_values: float | None = None,
    ):
        super().__init__()
        self.self_attn = MultiHeadAttention(
            d_model, nhead, _or(attn_dropout, dropout), attention=attention, bias=bias, num_kv_heads=num_kv_heads
        )
        self.ls1, self.ls2 = (_layer_scale(d_model, init_values) for _ in range(2))
        self.linear1 = _mlp_in(d_model, dim_feedforward, activation, bias)
        self.dropout = nn.Dropout(_or(activation_dropout, dropout))
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = _norm(norm, d_model, layer_norm_eps)
        self.norm2 = _norm(norm, d_model, layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.activation = _activation(activation)
        self.norm_first = norm_first

    def _ff(self, x: Tensor) -> Tensor:
        return self.drop_path(self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x))))))

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        pos: Tensor | None = None,
        cache: KVCache | None = None,
        rope: Rotation | None = None,
        position_bias: Tensor | None = None,
    ) -> Tensor:
        """``cache``: this layer's keys/values, for causal decoding step by step (a decoder-only LM's
        blocks are encoder layers with ``is_causal=True``). ``rope``, ``position_bias``: see the module docstring."""

        def sa(x: Tensor) -> Tensor:
            out = _self_attention(
                self.self_attn, x, pos, src_mask, src_key_padding_mask, is_causal, cache, rope, position_bias
            )
            return self.drop_path(self.dropout1(out))

        x = _residual(src, sa, self.norm1, self.norm_first, self.ls1)
        return _residual(x, self._ff, self.norm2, self.norm_first, self.ls2)


class TransformerDecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder memory, feed-forward.

    Queries of the cross-attention come from the decoder, keys and values from the memory.
    ``query_pos`` (DETR's object queries) is added to the queries and keys of the self-attention
    and to the queries of the cross-attention; ``pos`` is added to the memory keys.
    ``cache`` (a `DecoderLayerCache`) enables incremental decoding one token at a time.
    Arguments as in `TransformerEncoderLayer`; ``attn_dropout``, ``bias`` and ``num_kv_heads`` apply to both attentions;
    with ``init_values``, ``ls1``, ``ls2``, ``ls3`` scale the self-attention's, the cross-attention's and the MLP's branch.
    Shapes: tgt (B, T, D), memory (B, S, D) -> (B, T, D).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        attention: AttentionConfig | None = None,
        layer_norm_eps: float = 1e-5,
        attn_dropout: float | None = None,
        activation_dropout: float | None = None,
        norm: Norm = "layernorm",
        bias: bool = True,
        num_kv_heads: int | None = None,
        init_values: float | None = None,
    ):
        super().__init__()
        rate = _or(attn_dropout, dropout)
        self.self_attn, self.multihead_attn = (
            MultiHeadAttention(d_model, nhead, rate, attention=attention, bias=bias, num_kv_heads=num_kv_heads)
            for _ in range(2)
        )
        self.ls1, self.ls2, self.ls3 = (_layer_scale(d_model, init_values) for _ in range(3))
        self.linear1 = _mlp_in(d_model, dim_feedforward, activation, bias)
        self.dropout = nn.Dropout(_or(activation_dropout, dropout))
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = _norm(norm, d_model, layer_norm_eps)
        self.norm2 = _norm(norm, d_model, layer_norm_eps)
        self.norm3 = _norm(norm, d_model, layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = _activation(activation)
        self.norm_first = norm_first

    def _ff(self, x: Tensor) -> Tensor:
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        pos: Tensor | None = None,
        query_pos: Tensor | None = None,
        cache: DecoderLayerCache | None = None,
        rope: Rotation | None = None,
        position_bias: Tensor | None = None,
    ) -> Tensor:
        """``rope``, ``position_bias``: for the self-attention (see the module docstring)."""
        self_cache, cross_cache = (None, None) if cache is None else (cache.self_attn, cache.cross_attn)
        masks = (tgt_mask, tgt_key_padding_mask, tgt_is_causal)

        def sa(x: Tensor) -> Tensor:
            out = _self_attention(self.self_attn, x, query_pos, *masks, self_cache, rope, position_bias)
            return self.dropout1(out)

        def ca(x: Tensor) -> Tensor:
            q, k, kpm = _with_pos(x, query_pos), _with_pos(memory, pos), memory_key_padding_mask
            out = self.multihead_attn(q, k, memory, attn_mask=memory_mask, key_padding_mask=kpm, cache=cross_cache)[0]
            return self.dropout2(out)

        x = _residual(tgt, sa, self.norm1, self.norm_first, self.ls1)
        x = _residual(x, ca, self.norm2, self.norm_first, self.ls2)
        return _residual(x, self._ff, self.norm3, self.norm_first, self.ls3)


class TransformerEncoder(nn.Module):
    """A stack of `TransformerEncoderLayer` with an optional final norm (needed for pre-norm), of the layers' kind.

    ``drop_path`` rises linearly from 0 to the given rate over the layers (stochastic depth).
    """

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        nhead: int,
        final_norm: bool = False,
        drop_path: float = 0.0,
        **layer_kwargs,
    ):
        super().__init__()
        rates = torch.linspace(0, drop_path, num_layers).tolist() if num_layers > 1 else [drop_path] * num_layers
        self.layers = nn.ModuleList(TransformerEncoderLayer(d_model, nhead, drop_path=r, **layer_kwargs) for r in rates)
        self.norm = _final_norm(final_norm, d_model, layer_kwargs)

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        pos: Tensor | None = None,
        cache: list[KVCache] | None = None,
        rope: Rotation | Sequence[Rotation] | None = None,
        position_bias: Tensor | Sequence[Tensor] | None = None,
    ) -> Tensor:
        """``cache``: one `KVCache` per layer, for incremental causal decoding. ``rope``, ``position_bias``:
        one for every layer or one per layer (see the module docstring)."""
        x = src
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                mask,
                src_key_padding_mask,
                is_causal,
                pos,
                None if cache is None else cache[i],
                _layer_item(rope, i),
                _layer_item(position_bias, i),
            )
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(nn.Module):
    """A stack of `TransformerDecoderLayer`; with ``return_intermediate`` it returns every layer's
    (normed) output stacked as (num_layers, B, T, D), for DETR's auxiliary losses."""

    def __init__(
        self,
        num_layers: int,
        d_model: int,
        nhead: int,
        final_norm: bool = False,
        return_intermediate: bool = False,
        **layer_kwargs,
    ):
        super().__init__()
        self.layers = nn.ModuleList(TransformerDecoderLayer(d_model, nhead, **layer_kwargs) for _ in range(num_layers))
        self.norm = _final_norm(final_norm, d_model, layer_kwargs)
        self.return_intermediate = return_intermediate

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        pos: Tensor | None = None,
        query_pos: Tensor | None = None,
        cache: list[DecoderLayerCache] | None = None,
        rope: Rotation | Sequence[Rotation] | None = None,
        position_bias: Tensor | Sequence[Tensor] | None = None,
    ) -> Tensor:
        """``cache``: one `DecoderLayerCache` per layer (e.g. ``[DecoderLayerCache() for _ in decoder.layers]``).
        ``rope``, ``position_bias``: for the self-attention, one for every layer or one per layer."""
        x, intermediate = tgt, []
        norm = self.norm if self.norm is not None else nn.Identity()
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                memory,
                tgt_mask,
                memory_mask,
                tgt_key_padding_mask,
                memory_key_padding_mask,
                tgt_is_causal,
                pos,
                query_pos,
                None if cache is None else cache[i],
                _layer_item(rope, i),
                _layer_item(position_bias, i),
            )
            if self.return_intermediate:
                intermediate.append(norm(x))
        return torch.stack(intermediate) if self.return_intermediate else norm(x)
