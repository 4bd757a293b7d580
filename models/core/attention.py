"""The shared attention core: the attention block and multi-head attention (`models.core.capture` records it).

Every model in attnlab (text, ViT, DETR) attends through `MultiHeadAttention` below, with the options of ONE
block, `AttentionConfig` (`models.core.attention_config`), which each model takes as ``attention:`` and hands unchanged
to every layer::

    attention: {similarity: scaled_dot, qk_norm: null, normalization: softmax, gate: null, kernel: null}

A variant (similarity, normalization, kernel) is a built-in's name, a class path, or ``{class_path, init_args}``
with the class's arguments (a built-in's constants too); `models.core.attention_config` shows the three forms.

Similarities (``similarity``), for a query q and key k of one head (size d):
    "scaled_dot"  q·k / √d        (Vaswani et al. 2017, the default)
    "dot"         q·k             (Luong et al. 2015, "dot")
    "general"     qᵀ W k          (Luong et al. 2015, "general"; W is a learned d×d map per head,
                                   initialised to the identity, so it starts equal to "dot")
    a class       an ``nn.Module`` of your own whose ``forward(q, k)`` takes (B, H, Lq, d) and (B, H, Lk, d)
                  and returns the logits (B, H, Lq, Lk); it runs on the reference path.
QK-norm (``qk_norm="layernorm"|"rmsnorm"``, Dehghani et al. 2023, Wortsman et al. 2023): each head's queries
and keys are normalised over d after the projections (learned scale shared by the heads, as in timm), before
the rotation and the similarity; it bounds the logits, whose maximum `capture_attention(scores=True)` records.
Normalisations over the keys (``normalization``: softmax, softmax1, clipped, sigmoid or a class), the masks
and the kernels: see `models.core.attend`.
A kernel of one's own (``kernel``, a class; `models.core.attend.attention_own_kernel`) replaces similarity,
normalisation and the paths below: each layer builds one instance (``num_heads``, ``head_dim`` and ``dropout`` given
to its ``__init__`` when it names them) and hands it q (B, H, Lq, d), k and v (B, H, Lk, d) after the projections,
QK-norm, rotation, the cache, the grouped heads' repeat and the beams' folding, with the merged boolean mask
(True = blocked) or None; it returns out (B, H, Lq, d), or (out, weights (B, H, Lq, Lk)), which `capture_attention`
records. A kernel that returns no weights is refused in one line by ``need_weights`` and `capture_attention`
(`kernel_without_weights` says why).
Output gate (``gate="headwise"|"elementwise"``, Qiu et al. 2025's G1; Bondarenko et al. 2023's gated attention):
each head's output is multiplied by σ(x W_g + b_g), computed from the layer's query input x, before ``out_proj``:
one gate per head and query (headwise) or per channel (elementwise). b_g starts at logit(0.25), Bondarenko et
al.'s initial gate. It keeps every kernel.

Positions inside attention (the tables come from `models.core.position`):
    ``rope``           a `Rotation` of the queries and keys after the projections (RoPE, 1D or 2D), before the
                       kernel; with a KV cache the keys are cached rotated, so a step rotates only its new rows
                       (at the cache's offset, which the caller gives).
    ``position_bias``  (H, Lq, Lk) or (B, H, Lq, Lk) added to the logits (ALiBi, T5, Swin); merged with the
                       masks into one additive float mask.

Paths. Fast: ``F.scaled_dot_product_attention`` whenever weights are not requested and the similarity and the
normalisation are built in and fused (softmax, softmax1). On a GPU: no mask, or ``is_causal`` alone: flash; a
boolean mask: memory-efficient; ``position_bias``: memory-efficient with a float mask; math where those kernels do
not apply. ``rope``, ``qk_norm`` and the gate act outside the kernel, so they keep whichever kernel the masks
allow. Reference: explicit weights, used when weights are requested (``need_weights=True`` or inside
`capture_attention`), for the other normalisations and similarities, and as the test oracle. Inside
``capture_attention(scores=True, block_mib=...)`` under no_grad, a call whose fp32 scores pass ``block_mib`` (and whose
normalisation is row-wise) takes it a block of query rows at a time, recording each block's `AttentionScores`
(`_record_blocks`; the attention statistics of a long context).

Padding-free path (`models.core.padding_free`): a boolean key-padding mask alone (with ``is_causal`` in self-attention;
no other mask, no ``position_bias``, softmax, weights not requested, no KV cache, not under torch.compile) packs
the valid rows and runs one variable-length flash kernel over them, so padded keys (and, in self-attention, padded
query rows, which come back as zeros) cost nothing. ``PADDING_FREE`` gives each device type its kernels, first
choice first; the first that takes the call runs (varlen_attn has no dropout). Empty by default: on the CPU it
cannot be faster, and on an H100 both kernels were slower than the masked SDPA (benchmarks/RESULTS.md, "GPU rows
(H100)": a padded layer at 1.85-2.18x the unmasked one by varlen_attn and 9-13x by NJT SDPA, against 1.25-1.33x; the
Multi30k step 1.15x nn.Transformer's by varlen_attn against 1.00x). The tests set ``PADDING_FREE["cpu"]`` to hold
the path to the reference.

Incremental decoding: ``forward(cache=...)`` reads and writes the layer's keys and values in a cache, decoding state
that lives in `models.core.kv_cache` (a `KVCache` growing by each step, or a `StaticKVCache` of fixed length).

Grouped-query attention (``num_kv_heads`` < ``num_heads``, Ainslie et al. 2023; Llama 2/3, Mistral): keys and values
have ``num_kv_heads`` heads, each shared by ``num_heads // num_kv_heads`` consecutive query heads. The KV cache
holds the key/value heads; they are repeated to the query heads just before the kernel.

Parameters use the layout of ``torch.nn.MultiheadAttention`` (packed ``in_proj_weight`` of shape (3D, D),
``in_proj_bias``, ``out_proj``), so its state dict loads unchanged and timm's ``attn.qkv`` / DETR's checkpoints
load by renaming keys. With grouped-query attention ``in_proj_weight`` is (D + 2·D_kv, D), the q rows, then k,
then v (D_kv = num_kv_heads·d), as Llama's ``q_proj``, ``k_proj``, ``v_proj`` concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.core.attend import (
    FUSED,
    Softmax1,
    attention_fast,
    attention_own_kernel,
    attention_reference,
    cpu_sdpa_zeroes_empty_rows,
)
from models.core.attention_config import DEFAULT_ATTENTION, QK_NORMS, SIMILARITIES, AttentionConfig, class_path
from models.core.chunked import attention_chunked, block_rows, row_wise, scores_mib
from models.core.kv_cache import KVCache, StaticKVCache
from models.core.masks import LazyBias, MaskParts, blocked_of
from models.core.padding_free import PaddingFree, attention_padding_free, packing, supported
from models.core.position import Rotation

__all__ = [  # the block lives in models.core.attention_config; every model imports it from here
    "DEFAULT_ATTENTION",
    "SIMILARITIES",
    "AttentionConfig",
    "AttentionScores",
    "MultiHeadAttention",
]
GATE_INIT = 0.25  # σ(b_g) at initialisation: Bondarenko et al.'s attn_gate_init
# device type -> the padding-free kernels for a key-padding mask, first choice first (module docstring); none: the
# masked SDPA
PADDING_FREE: dict[str, tuple[PaddingFree, ...]] = {"cuda": (), "cpu": ()}


def _padding_free_kernel(
    q: Tensor, lk: int, key_padding_mask: Tensor | None, is_causal: bool, self_attention: bool, dropout_p: float
) -> PaddingFree | None:
    """The padding-free kernel for q (B, H, Lq, d) and this key-padding mask alone, or None (module docstring)."""
    if key_padding_mask is None or key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (q.shape[0], lk):
        return None  # (merge_masks names a wrong shape)
    if (is_causal and not self_attention) or torch.compiler.is_compiling():
        return None
    return next((k for k in PADDING_FREE.get(q.device.type, ()) if supported(q, k, is_causal, dropout_p)), None)


@dataclass
class AttentionScores:
    """What one call of a layer computed, recorded by ``capture_attention(model, scores=True)``.

    weights (B, H, Lq, Lk): the attention; logits (B, H, Lq, Lk): the scaled similarities before the
    mask, the position bias and the normalisation (their maximum is the largest attention logit, which QK-norm
    bounds); blocked: the mask, True where attention is blocked, broadcastable to the weights
    ((B|1, H|1, Lq, Lk)), or None when nothing was masked.

    A call recorded in row blocks (``capture_attention(block_mib=...)``) gives one per block: its query rows are
    start .. start + rows of the call's ``lq``, weights and logits (B, H, rows, Lk), blocked (B|1, H|1, rows, Lk).
    A whole call is one block at start 0.
    """

    weights: Tensor
    logits: Tensor
    blocked: Tensor | None
    start: int = 0
    lq: int | None = None  # None: the block's own rows (a whole call)

    def __post_init__(self) -> None:
        self.lq = self.weights.shape[2] if self.lq is None else self.lq


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self- and cross-attention, with the options of one `AttentionConfig`.

    Args:
        embed_dim: model width D.
        num_heads: number of heads H; D must be divisible by H.
        dropout: dropout on the attention weights during training.
        attention: the attention block (similarity, qk_norm, normalization, gate, kernel; module docstring), or
            its fields as a dict (as a checkpoint's hyper-parameters hold it).
        bias: biases on the input and output projections.
        num_kv_heads: key/value heads; fewer than ``num_heads`` (a divisor): grouped-query attention (module
            docstring). None: ``num_heads``.

    Shapes (batch first): query (B, Lq, D), key/value (B, Lk, D) -> output (B, Lq, D) and,
    when requested, weights (B, H, Lq, Lk).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        attention: AttentionConfig | dict | None = None,
        bias: bool = True,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        attention = AttentionConfig(**attention) if isinstance(attention, dict) else attention  # a checkpoint's
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={num_heads}")
        self.kv_dim = self.num_kv_heads * self.head_dim  # D_kv
        self.dropout, self.config = dropout, attention or AttentionConfig()
        self.similarity, self.qk_norm = self.config.similarity, self.config.qk_norm
        self.in_proj_weight = nn.Parameter(torch.empty(embed_dim + 2 * self.kv_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(embed_dim + 2 * self.kv_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        if self.similarity == "general":
            self.general_weight = nn.Parameter(torch.eye(self.head_dim).repeat(num_heads, 1, 1))  # (H, d, d)
        elif self.similarity not in SIMILARITIES:
            self.similarity_fn = self.config.build("similarity")
        if self.qk_norm is not None:  # timm's names
            self.q_norm = QK_NORMS[self.qk_norm](self.head_dim, eps=1e-6)
            self.k_norm = QK_NORMS[self.qk_norm](self.head_dim, eps=1e-6)
        self.normalization = self.config.build("normalization")
        self.fused = type(self.normalization) in FUSED and self.similarity in SIMILARITIES
        self.kernel, self.kernel_gives_weights = (
            (None, True) if self.config.kernel is None else self.config.build_kernel(num_heads, self.head_dim, dropout)
        )
        if self.config.gate is not None:  # W_g: D -> H (headwise) or D (elementwise)
            self.gate_proj = nn.Linear(embed_dim, num_heads if self.config.gate == "headwise" else embed_dim)
        # inside capture_attention: where each call's weights or scores go, and above which size they go in row blocks
        self._captured: Callable[[Tensor | AttentionScores], None] | None = None
        self._capture_scores, self._capture_block_mib = False, None
        self._reset_parameters()
        cpu_sdpa_zeroes_empty_rows()

    def _reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.config.gate is not None:
            nn.init.constant_(self.gate_proj.bias, math.log(GATE_INIT / (1 - GATE_INIT)))

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.similarity == "scaled_dot" else 1.0

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project and split into heads: q (B, H, Lq, d), k and v (B, H, Lk, d). Packed projections are
        split with one view, permute and unbind, as timm does: every view is an autograd node, and at
        small sizes (on a GPU, most steps) each node's host time counts."""
        w, b, d = self.in_proj_weight, self.in_proj_bias, self.embed_dim
        if self.kv_dim != d:
            return self._project_grouped(query, key, value)
        if query is key and key is value:  # self-attention: one packed matmul
            return self._heads(F.linear(query, w, b), 3)
        bq, bk, bv = (None, None, None) if b is None else b.split(d)
        if query is key:  # DETR: positions added to queries and keys, not to values
            q, k = self._heads(F.linear(query, w[: 2 * d], None if b is None else b[: 2 * d]), 2)
            return q, k, self._heads(F.linear(value, w[2 * d :], bv))[0]
        q = self._heads(F.linear(query, w[:d], bq))[0]
        if key is value:  # cross-attention to a memory
            k, v = self._heads(F.linear(key, w[d:], None if b is None else b[d:]), 2)
            return q, k, v
        return q, self._heads(F.linear(key, w[d : 2 * d], bk))[0], self._heads(F.linear(value, w[2 * d :], bv))[0]

    def _project_grouped(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Grouped-query attention: q (B, H, Lq, d), k and v (B, H_kv, Lk, d), from ``in_proj``'s rows (D, D_kv, D_kv)."""
        sizes = (self.embed_dim, self.kv_dim, self.kv_dim)
        if query is key and key is value:  # self-attention: one packed matmul
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).split(sizes, -1)
        else:
            biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.split(sizes)
            q, k, v = (
                F.linear(x, w, b) for x, w, b in zip((query, key, value), self.in_proj_weight.split(sizes), biases)
            )
        return tuple(x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for x in (q, k, v))

    def _heads(self, x: Tensor, n: int = 1) -> tuple[Tensor, ...]:
        """(B, L, n·D) -> n tensors (B, H, L, d)."""
        b, l, _ = x.shape
        if n == 1:
            return (x.view(b, l, self.num_heads, self.head_dim).transpose(1, 2),)
        return x.view(b, l, n, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: KVCache | StaticKVCache | None = None,
        rope: Rotation | None = None,
        position_bias: Tensor | LazyBias | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (both default to ``query``: self-attention).

        ``cache`` (`models.core.kv_cache`) enables incremental decoding: the layer appends its new keys and values
        to a `KVCache`, reads a filled ``static`` one (cross-attention), or writes them into a `StaticKVCache`.

        ``key``/``value`` may hold fewer rows than ``query`` (cross-attention only, ``key_padding_mask``
        (B_kv, Lk) the only mask): each of their rows then serves ``B // B_kv`` consecutive query rows, so
        beam search keeps one copy of a sentence's memory and its keys/values for all its beams.

        ``rope`` rotates the queries and the new keys (cos/sin (..., Lq, d): self-attention, the new rows'
        positions); ``position_bias`` (H, Lq, Lk) or (B, H, Lq, Lk) is added to the logits. See the module docstring.

        Returns (output (B, Lq, D), weights (B, H, Lq, Lk) or None).
        """
        key = query if key is None else key
        value = key if value is None else value
        reads_cache = cache is not None and cache.static and cache.k is not None
        q, k, v = self._qkv(query, key, value, cache if reads_cache else None, rope)
        if cache is not None and not reads_cache:
            k, v, attn_mask, is_causal, position_bias = self._cache(
                cache, k, v, attn_mask, key_padding_mask, is_causal, position_bias
            )
        masks = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal)
        out, weights = self._kernel(
            q, k, v, masks, position_bias, need_weights, self_attention=key is query, cached=cache is not None
        )
        out = out.transpose(1, 2).reshape(query.shape[0], query.shape[1], self.embed_dim)  # (B, Lq, D)
        return self.out_proj(self._gate(query, out)), (weights if need_weights else None)

    def _qkv(
        self, query: Tensor, key: Tensor, value: Tensor, cache: KVCache | None, rope: Rotation | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Project: q (B, H, Lq, d), k and v (B, H_kv, Lk, d), QK-normed and rotated. A filled static
        (cross-attention) ``cache`` holds the keys and values: only the queries are projected."""
        if cache is not None:
            if rope is not None:
                raise ValueError("rope rotates self-attention; a static (cross-attention) cache takes none")
            d, b = self.embed_dim, self.in_proj_bias
            q = self._heads(F.linear(query, self.in_proj_weight[:d], None if b is None else b[:d]))[0]
            return (q if self.qk_norm is None else self.q_norm(q)), cache.k, cache.v
        q, k, v = self._project(query, key, value)
        if self.qk_norm is not None:  # (B, H, L, d), over d
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q), rope(k)
        return q, k, v

    @staticmethod
    def _cache(
        cache: KVCache | StaticKVCache,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        position_bias: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor | None, bool, Tensor | None]:
        """Cache: the new keys and values join the cached ones; a `StaticKVCache` also gives the mask of its
        filled positions (then ``is_causal`` is in it, and ``position_bias`` is padded to its length)."""
        if not isinstance(cache, StaticKVCache):
            return *cache.append(k, v), attn_mask, is_causal, position_bias
        if attn_mask is not None or key_padding_mask is not None:
            raise ValueError("a StaticKVCache masks the positions it has not filled itself; pass no other mask")
        k, v, attn_mask = cache.update(k, v, is_causal)
        if position_bias is not None:  # given over the filled keys: the rest are blocked
            bias = position_bias.full() if isinstance(position_bias, LazyBias) else position_bias  # (H, Lq, t + 1)
            position_bias = F.pad(bias, (0, cache.max_len - bias.size(-1)))
        return k, v, attn_mask, False, position_bias

    def _kernel(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        masks: dict,
        position_bias: Tensor | LazyBias | None,
        need_weights: bool,
        self_attention: bool,
        cached: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Kernel: out (B, H, Lq, d) and, on the reference path, the weights (B, H, Lq, Lk); the padding-free, SDPA,
        chunked or reference path as the module docstring says. Records the call inside `capture_attention`."""
        if self.num_kv_heads != self.num_heads:
            # kv head j serves q heads j·g .. j·g + g - 1: (B, H_kv, Lk, d) -> (B, H, Lk, d)
            k, v = (x.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1) for x in (k, v))
        if self.similarity == "general":
            q = torch.einsum("bhld,hde->bhle", q, self.general_weight)  # qᵀW, then ·k below
        bsz, lq, (kv_bsz, _, lk, _) = q.shape[0], q.shape[2], k.shape
        q = self._fold(q, kv_bsz, masks, position_bias)
        window = self.config.window if self_attention else None
        parts = MaskParts(kv_bsz, q.shape[2], lk, **masks, window=window, position_bias=position_bias)
        if self.kernel is not None:
            return self._own_kernel(q, k, v, parts, need_weights, bsz, lq)
        dropout_p = self.dropout if self.training else 0.0
        asked = need_weights or self._captured is not None
        want_weights = asked or not self.fused
        plain_causal = parts.is_causal and lq == lk and window is None and position_bias is None
        plain_causal = plain_causal and masks["attn_mask"] is None and masks["key_padding_mask"] is None
        padding_free = not (want_weights or cached or window or masks["attn_mask"] is not None)
        kernel = (
            _padding_free_kernel(q, lk, masks["key_padding_mask"], masks["is_causal"], self_attention, dropout_p)
            if padding_free and position_bias is None and q.shape[0] == bsz and isinstance(self.normalization, FUSED[0])
            else None
        )
        if kernel is not None:
            pack = packing(masks["key_padding_mask"].to(q.device), lq, self_attention)
            return attention_padding_free(q, k, v, pack, self.scale, dropout_p, masks["is_causal"], kernel), None
        similarity = None if self.similarity in SIMILARITIES else self.similarity_fn
        if not asked and self._chunks(q, lk, parts, plain_causal):
            out = attention_chunked(
                q, k, v, parts, self.scale, self.config.memory_budget_mib, dropout_p, self.normalization, similarity
            )
            return self._unfold(out, bsz, lq), None
        if not need_weights and self._records_blocks(q, lk, bsz):
            return self._record_blocks(q, k, v, parts, dropout_p, similarity), None
        mask = None if plain_causal and not want_weights else parts.full(q.device, q.dtype)
        if not want_weights:
            sink = self.normalization.sink_logit if isinstance(self.normalization, Softmax1) else None
            return self._unfold(attention_fast(q, k, v, mask, self.scale, dropout_p, plain_causal, sink), bsz, lq), None
        logits = None if similarity is None else similarity(q, k)
        out, weights, logits = attention_reference(q, k, v, mask, self.scale, dropout_p, self.normalization, logits)
        self._record(weights, logits, mask, bsz, lq)
        return self._unfold(out, bsz, lq), self._unfold(weights, bsz, lq)

    def _chunks(self, q: Tensor, lk: int, parts: MaskParts, plain_causal: bool) -> bool:
        """Whether this call takes the chunked path (`models.core.chunked`): its scores exceed the memory budget, its
        normalisation is row-wise, and no fused kernel already bounds the memory (SDPA without a mask, or causal)."""
        if self.fused and (parts.empty or plain_causal):
            return False
        too_big = scores_mib(q.size(0), q.size(1), q.size(2), lk) > self.config.memory_budget_mib
        return too_big and row_wise(self.normalization)

    def _records_blocks(self, q: Tensor, lk: int, bsz: int) -> bool:
        """Whether `capture_attention` records this call in row blocks: its scores pass the capture's ``block_mib``,
        nothing is kept for a backward (no_grad), the normalisation is row-wise and no beams are folded."""
        block_mib = self._capture_block_mib if self._captured is not None else None
        if block_mib is None or torch.is_grad_enabled() or not row_wise(self.normalization):
            return False
        return q.shape[0] == bsz and scores_mib(q.size(0), q.size(1), q.size(2), lk) > block_mib

    def _record_blocks(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        parts: MaskParts,
        dropout_p: float,
        similarity: Callable[[Tensor, Tensor], Tensor] | None,
    ) -> Tensor:
        """The reference path a block of query rows at a time, each block's `AttentionScores` recorded and then
        freed: out (B, H, Lq, d) from q (B, H, Lq, d), k/v (B, H, Lk, d); the blocks' scores fit ``block_mib``."""
        lq, lk = q.size(2), k.size(2)
        rows = block_rows(q.size(0), q.size(1), lk, self._capture_block_mib)
        outs = []
        for start, q_rows in zip(range(0, lq, rows), q.split(rows, 2)):  # q_rows (B, H, rows, d)
            mask = parts.rows(start, start + q_rows.size(2), q.device, q.dtype)  # (B|1, H|1, rows, Lk)
            logits = None if similarity is None else similarity(q_rows, k)
            out, weights, logits = attention_reference(
                q_rows, k, v, mask, self.scale, dropout_p, self.normalization, logits
            )
            self._captured(AttentionScores(weights, logits, blocked_of(mask), start, lq))
            outs.append(out)
            del weights, logits, mask  # freed before the next block is made
        return torch.cat(outs, 2)

    def _own_kernel(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        parts: MaskParts,
        need_weights: bool,
        bsz: int,
        lq: int,
    ) -> tuple[Tensor, Tensor | None]:
        """``attention.kernel`` on q (B_kv, H, group·Lq, d), k and v (B_kv, H, Lk, d) and the merged boolean mask:
        out (B, H, Lq, d) and its weights (B, H, Lq, Lk) or None. Inside `capture_attention` the logits recorded
        beside its weights are q·k/√d of the q and k it was given."""
        if need_weights and not self.kernel_gives_weights:
            raise ValueError(weightless(self.config.kernel))
        mask = parts.full(q.device, q.dtype)
        out, weights = attention_own_kernel(self.kernel, q, k, v, mask, class_path(self.config.kernel))
        if weights is not None and self._captured is not None:
            self._record(weights, (q @ k.transpose(-2, -1)) * self.scale, mask, bsz, lq)
        return self._unfold(out, bsz, lq), None if weights is None else self._unfold(weights, bsz, lq)

    def _record(self, weights: Tensor, logits: Tensor, mask: Tensor | None, bsz: int, lq: int) -> None:
        """Capture (inside `capture_attention`): the call's weights, or its `AttentionScores`, as (B, H, Lq, Lk)."""
        if self._captured is None:
            return
        weights, logits = (self._unfold(x.detach(), bsz, lq) for x in (weights, logits))
        if not self._capture_scores:
            self._captured(weights)
            return
        blocked = blocked_of(mask)
        blocked = None if blocked is None else blocked.repeat_interleave(bsz // blocked.shape[0], 0)
        self._captured(AttentionScores(weights, logits, blocked))

    def _fold(self, q: Tensor, kv_bsz: int, masks: dict, position_bias: Tensor | None) -> Tensor:
        """Beams sharing one memory: the ``group`` query rows of one key/value row attend as one longer query,
        (B, H, Lq, d) -> (B_kv, H, group·Lq, d)."""
        bsz, _, lq, d = q.shape
        group = bsz // kv_bsz
        if group * kv_bsz != bsz:
            raise ValueError(f"query batch {bsz} is not a multiple of the key/value batch {kv_bsz}")
        if group == 1:
            return q
        if masks["attn_mask"] is not None or masks["is_causal"] or position_bias is not None:
            raise ValueError(
                "a query batch larger than the key/value batch (beams sharing one memory) takes key_padding_mask only"
            )
        return q.view(kv_bsz, group, self.num_heads, lq, d).transpose(1, 2).reshape(kv_bsz, self.num_heads, -1, d)

    def _unfold(self, x: Tensor, bsz: int, lq: int) -> Tensor:
        """(B_kv, H, group·Lq, ·) -> (B, H, Lq, ·): the inverse of `_fold`."""
        if x.shape[0] == bsz:
            return x
        kv_bsz = x.shape[0]
        return (
            x.view(kv_bsz, self.num_heads, bsz // kv_bsz, lq, -1).transpose(1, 2).reshape(bsz, self.num_heads, lq, -1)
        )

    def _gate(self, query: Tensor, out: Tensor) -> Tensor:
        """Gate: out (B, Lq, D) times σ(query W_g + b_g), per head (headwise) or per channel (elementwise)."""
        if self.config.gate is None:
            return out
        gate = torch.sigmoid(self.gate_proj(query))  # (B, Lq, H) or (B, Lq, D)
        if self.config.gate == "elementwise":
            return out * gate
        return (out.unflatten(-1, (self.num_heads, self.head_dim)) * gate[..., None]).flatten(-2)


def weightless(kernel: str | dict) -> str:
    return (
        f"attention.kernel={class_path(kernel)} returns no attention weights, which need_weights, the attention "
        "maps and statistics (capture_attention) read; return (out, weights (B, H, Lq, Lk)) from its forward"
    )
