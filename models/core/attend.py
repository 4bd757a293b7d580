"""The attention kernels of the shared core: masks, normalisations over keys, the SDPA fast path and the
reference path. `models.core.attention.MultiHeadAttention` projects, caches and gates around them.

Masks (True = blocked, everywhere) and position biases: `models.core.masks`, which merges them for any block of
query rows. A query row whose keys are all blocked gets all-zero weights and a zero attention output, never NaN, under
every normalisation.

Normalisations (``attention.normalization``), for the scores s_j of one query over its n visible keys
(the scaled similarities plus any position bias); each built-in's constants are its constructor's arguments,
set as ``{class_path: models.core.attend.ClippedSoftmax, init_args: {alpha: 4}}`` (`models.core.attention_config`):
    "softmax"   exp(s_j) / Σ_k exp(s_k)                                    fast path: SDPA
    "softmax1"  exp(s_j) / (exp(b) + Σ_k exp(s_k))  (Miller 2023, "off by one"; `Softmax1`'s ``sink_logit`` b = 0
                gives his 1 + Σ)   fast path: SDPA with one more key whose value is 0 and whose logit is b (q·0 plus
                an additive mask value b), so a head can put its weight nowhere
    "clipped"   clip((ζ - γ)·softmax(s)_j + γ, 0, 1), ζ = 1, γ = -α/n, α = 12 (Bondarenko et al. 2023, the
                α of their published BERT command; their T is n): exact zeros without infinite logits; `ClippedSoftmax`
                takes ``alpha``, ``zeta`` and a fixed ``gamma`` that replaces -α/n       reference path
    "sigmoid"   σ(s_j + b), b = -log n  (Ramapuram et al. 2025): each key on its own, no sum to one; `SigmoidAttention`'s
                ``bias`` replaces -log n by a fixed b                                 reference path
    a class path (``my_module.MyNorm``): an ``nn.Module`` of your own whose ``forward(scores, blocked)`` takes
                the scores (B, H, Lq, Lk), -inf where blocked, and the boolean mask (B|1, H|1, Lq, Lk) or None,
                and returns the weights (B, H, Lq, Lk)                       reference path
Blocked keys and empty rows get zero weight after any normalisation.

A kernel of one's own (``attention.kernel``, `attention_own_kernel`) replaces all of the above: an ``nn.Module``
whose ``forward(q, k, v, blocked)`` takes q (B, H, Lq, d), k and v (B, H, Lk, d) and the boolean mask
(B|1, H|1, Lq, Lk) or None, and returns out (B, H, Lq, d), or (out, weights (B, H, Lq, Lk)). It sees boolean masks
only (an additive float mask or a position bias is refused) and must give a row whose keys are all blocked zeros.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.core.masks import blocked_of, causal_mask


class Softmax(nn.Module):
    """exp(s_j) / Σ_k exp(s_k) over the keys."""

    def forward(self, scores: Tensor, blocked: Tensor | None) -> Tensor:
        return scores.softmax(dim=-1)


class Softmax1(nn.Module):
    """exp(s_j) / (exp(b) + Σ_k exp(s_k)): softmax beside a sink of logit b (Miller 2023's 1 + Σ at b = 0).

    Args:
        sink_logit: b, the logit of the implicit key whose value is 0.
    """

    def __init__(self, sink_logit: float = 0.0):
        super().__init__()
        self.sink_logit = float(sink_logit)

    def forward(self, scores: Tensor, blocked: Tensor | None) -> Tensor:
        m = scores.amax(-1, keepdim=True).clamp(min=self.sink_logit)  # the sink's logit takes part in the max
        e = (scores - m).exp()
        return e / (e.sum(-1, keepdim=True) + (self.sink_logit - m).exp())


def visible_keys(scores: Tensor, blocked: Tensor | None) -> Tensor | float:
    """n, the keys each query may see: (B|1, H|1, Lq, 1), or Lk when nothing is blocked. Counting them per
    query (not the padded length) keeps a cached decoding step equal to the full causal pass."""
    return float(scores.size(-1)) if blocked is None else (~blocked).sum(-1, keepdim=True).clamp(min=1).to(scores)


class ClippedSoftmax(nn.Module):
    """clip((ζ - γ)·softmax(s) + γ, 0, 1) over n keys (Bondarenko et al. 2023).

    Args:
        alpha: α of γ = -α/n (their T is n).
        gamma: a fixed γ (< 0 reaches exact zeros) in place of -α/n.
        zeta: ζ (> 1 reaches exact ones).
    """

    def __init__(self, alpha: float = 12.0, gamma: float | None = None, zeta: float = 1.0):
        super().__init__()
        self.alpha, self.gamma, self.zeta = alpha, gamma, zeta

    def forward(self, scores: Tensor, blocked: Tensor | None) -> Tensor:
        gamma = -self.alpha / visible_keys(scores, blocked) if self.gamma is None else self.gamma
        return ((self.zeta - gamma) * scores.softmax(dim=-1) + gamma).clamp(0.0, 1.0)


class SigmoidAttention(nn.Module):
    """σ(s_j + b) over n keys, each key on its own (Ramapuram et al. 2025).

    Args:
        bias: b; None: -log n, the paper's.
    """

    def __init__(self, bias: float | None = None):
        super().__init__()
        self.bias = bias

    def forward(self, scores: Tensor, blocked: Tensor | None) -> Tensor:
        if self.bias is not None:
            return torch.sigmoid(scores + self.bias)
        n = visible_keys(scores, blocked)
        return torch.sigmoid(scores - (math.log(n) if isinstance(n, float) else n.log()))


NORMALIZATIONS: dict[str, type[nn.Module]] = {
    "softmax": Softmax,
    "softmax1": Softmax1,
    "clipped": ClippedSoftmax,
    "sigmoid": SigmoidAttention,
}
FUSED = (Softmax, Softmax1)  # the normalisations `attention_fast` computes with SDPA


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    normalization: nn.Module | None = None,
    logits: Tensor | None = None,
    keep_logits: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Explicit attention. q (B, H, Lq, d), k/v (B, H, Lk, d) -> out (B, H, Lq, d), weights (B, H, Lq, Lk)
    and logits (B, H, Lq, Lk): the scaled similarities before the mask (and a position bias in it) and the
    normalisation (softmax when None). ``logits`` given (a similarity of one's own) replace q·k·scale. Without
    ``keep_logits`` they are freed before the normalisation (one (B, H, Lq, Lk) tensor less) and None is returned."""
    if logits is None:
        logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    scores, blocked = logits, blocked_of(mask)
    empty = None if blocked is None else blocked.all(-1, keepdim=True)  # (B|1, H|1, Lq, 1)
    # a row whose keys are all blocked is unblocked at 0 so that every normalisation stays finite; zeroed below
    if mask is not None and mask.dtype == torch.bool:
        scores = torch.where(mask, torch.where(empty, 0.0, float("-inf")).to(logits.dtype), logits)
    elif mask is not None:
        scores = torch.where(empty, 0.0, logits + mask)
    if not keep_logits:
        logits = None
    weights = (normalization or Softmax())(scores, None if blocked is None else blocked & ~empty)
    if weights.shape != scores.shape:
        raise ValueError(
            f"attention.normalization={type(normalization).__module__}.{type(normalization).__qualname__} returned "
            f"weights of shape {tuple(weights.shape)}; expected the logits' shape {tuple(scores.shape)}"
        )
    del scores
    if blocked is not None:
        weights = torch.where(blocked, 0.0, weights)
    out = F.dropout(weights, dropout_p) @ v if dropout_p > 0 else weights @ v
    return out, weights, logits


_CPU_SDPA_SAFE: bool | None = None


def cpu_sdpa_zeroes_empty_rows() -> bool:
    """Whether this torch's CPU SDPA already returns zeros (and finite gradients) for a query row whose
    keys are all blocked (torch >= 2.5 uses a safe softmax there); then the fast path skips its own fix,
    a pass over the output that costs ~15% of self-attention at L=64 with padding. Measured once, when the first
    `MultiHeadAttention` is built (so that torch.compile reads a constant)."""
    global _CPU_SDPA_SAFE
    if _CPU_SDPA_SAFE is None:
        with torch.inference_mode(False), torch.enable_grad():  # the first call may come under no_grad
            q = torch.ones(1, 1, 1, 2, requires_grad=True)
            out = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(1, 1, 1, 1, dtype=torch.bool))
            out.sum().backward()
        _CPU_SDPA_SAFE = bool((out == 0).all() and torch.isfinite(q.grad).all())
    return _CPU_SDPA_SAFE


def _with_sink(k: Tensor, v: Tensor, mask: Tensor | None, sink_logit: float) -> tuple[Tensor, Tensor, Tensor | None]:
    """softmax1 as softmax: one key in front whose value is 0 and whose logit is ``sink_logit`` (q·0 plus that value
    in the additive mask), visible to every query."""
    zero = k.new_zeros(*k.shape[:2], 1, k.size(-1))  # (B, H, 1, d)
    k, v = torch.cat([zero, k], 2), torch.cat([zero.expand(*v.shape[:2], 1, v.size(-1)), v], 2)
    if sink_logit == 0.0:  # q·0 is the logit: False / 0.0 in the mask (or none) leave it
        return k, v, None if mask is None else torch.cat([mask.new_zeros(*mask.shape[:-1], 1), mask], -1)
    if mask is None:
        mask = k.new_zeros(1, 1, 1, k.size(2) - 1)
    elif mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=k.dtype, device=k.device).masked_fill(mask, float("-inf"))
    return k, v, torch.cat([torch.full_like(mask[..., :1], sink_logit), mask.to(k.dtype)], -1)


def attention_fast(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    sink_logit: float | None = None,
) -> Tensor:
    """SDPA with the project's mask convention: softmax, or softmax1 (`Softmax1`) through one value-zero key of
    logit ``sink_logit``. ``is_causal`` only when Lq == Lk and no other mask."""
    if sink_logit is not None:
        if is_causal:  # SDPA aligns is_causal to the start: the sink key needs the explicit mask
            mask, is_causal = causal_mask(q.size(2), k.size(2), q.device)[None, None], False
        k, v, mask = _with_sink(k, v, mask, sink_logit)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if q.device.type == "cpu" and cpu_sdpa_zeroes_empty_rows():  # GPU kernels are not all known to: fix below
        sdpa_mask = ~mask if mask.dtype == torch.bool else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, scale=scale)
    empty = (mask if mask.dtype == torch.bool else torch.isneginf(mask)).all(-1, keepdim=True)
    if mask.dtype == torch.bool:
        # SDPA's boolean convention is True = attend; an empty row attends to all, then is zeroed (two
        # kernels: each launch counts at these sizes on a GPU)
        sdpa_mask = torch.logical_not(mask).logical_or_(empty)
    else:
        sdpa_mask = mask.masked_fill(empty, 0.0)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_mask, dropout_p=dropout_p, scale=scale)
    # where, not masked_fill: it keeps SDPA's memory layout (B, L, H, d), so that merging the heads stays a
    # view; masked_fill returns a contiguous (B, H, L, d) copy, which the merge then copies once more
    return torch.where(empty, 0.0, out)


def attention_own_kernel(
    kernel: nn.Module, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, name: str
) -> tuple[Tensor, Tensor | None]:
    """A kernel of one's own (module docstring) on q (B, H, Lq, d), k/v (B, H, Lk, d) and a merged mask -> out
    (B, H, Lq, d) and its weights (B, H, Lq, Lk) or None. ``name``: its class path, for the errors."""
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(
            f"attention.kernel={name} takes boolean masks only; this model gives it a position bias (ALiBi, T5, "
            "relative positions) or an additive float mask: use positions rope or learned with a kernel"
        )
    return kernel_output(kernel(q, k, v, mask), q, k.size(2), name)


def kernel_output(out: Tensor | tuple, q: Tensor, lk: int, name: str) -> tuple[Tensor, Tensor | None]:
    """What a kernel of one's own returned, as (out (B, H, Lq, d), weights (B, H, Lq, Lk) or None); one line when
    the shapes are not those."""
    out, weights = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    weights_shape = (*q.shape[:3], lk)
    if not isinstance(out, Tensor) or out.shape != q.shape or (weights is not None and weights.shape != weights_shape):
        got = [tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__ for x in (out, weights)]
        raise ValueError(
            f"attention.kernel={name} returned {got[0] if weights is None else tuple(got)}; expected out "
            f"{tuple(q.shape)} (B, H, Lq, d), or (out, weights {weights_shape} (B, H, Lq, Lk))"
        )
    return out, weights
