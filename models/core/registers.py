"""Registers: learned tokens that join a sequence without standing for any input.

Large ViTs hand attention's "sink" role (somewhere to put the mass a query does not need) to a few high-norm
patch tokens; a few extra learned tokens take it over (Darcet et al. 2024, "Vision Transformers Need
Registers"); StreamingLLM (Xiao et al. 2023) trains a language model with one learned sink token at the start.
Every model here holds them as ``reg_token`` (1, N, D) (timm's name; DETR's transformer holds them), inserts them into a sequence where its
docstring says, drops them before its heads and losses, and names the attention layers whose keys include them
in ``register_keys()``. A register has no place in the input, so it gets no position unless its model says
otherwise: the functions below add N such tokens to what goes with a sequence (padding masks, added positions,
the positions inside attention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.core.masks import LazyBias
from models.core.position import Rotation


class WithRegisters:
    """``num_registers`` of a model that keeps its learned registers as ``reg_token`` (1, N, D), or None."""

    reg_token: nn.Parameter | None

    @property
    def num_registers(self) -> int:
        return 0 if self.reg_token is None else self.reg_token.shape[1]


def learned_registers(n: int, d_model: int) -> nn.Parameter | None:
    """N learned tokens (1, N, D), started as timm's ViT starts them (N(0, 1e-6)); None for N = 0."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"model.register_tokens={n!r} must be a whole number >= 0 (0: no registers)")
    return nn.Parameter(torch.randn(1, n, d_model) * 1e-6) if n else None


def insert_registers(x: Tensor, tokens: Tensor, at: int) -> Tensor:
    """x (B, L, D) with the registers ``tokens`` (1, N, D) inserted before row ``at`` (0 <= at <= L)
    -> (B, L + N, D)."""
    return torch.cat([x[:, :at], tokens.expand(x.shape[0], -1, -1).to(x.dtype), x[:, at:]], dim=1)


def _order(length: int, at: int, n: int, device: torch.device) -> Tensor:
    """The index that moves N rows appended after ``length`` rows to sit before row ``at``."""
    return torch.cat([torch.arange(at), torch.arange(length, length + n), torch.arange(at, length)]).to(device)


def _unrotated(rotation: Rotation, at: int, n: int) -> Rotation:
    """``rotation`` (cos/sin (..., L, d)) with N rows of angle 0 (cos 1, sin 0) before row ``at``."""
    length = rotation.cos.shape[-2]
    order = _order(length, at, n, rotation.cos.device)
    cos = F.pad(rotation.cos, (0, 0, 0, n), value=1.0).index_select(-2, order)
    sin = F.pad(rotation.sin, (0, 0, 0, n), value=0.0).index_select(-2, order)
    return Rotation(cos, sin, rotation.interleaved)


def _unbiased(bias: Tensor | LazyBias, at: int, n: int) -> Tensor:
    """A position bias (..., L, L) with N zero rows and columns before index ``at`` -> (..., L + N, L + N); a lazy one
    is made whole first (registers with a position bias keep an (L, L) bias)."""
    bias = bias.full() if isinstance(bias, LazyBias) else bias
    order = _order(bias.shape[-1], at, n, bias.device)
    return F.pad(bias, (0, n, 0, n)).index_select(-1, order).index_select(-2, order)


def unplaced(positions: dict, at: int, n: int) -> dict:
    """A self-attention's positions (``rope``: a `Rotation` or one per layer; ``position_bias``: (H, L, L) or
    one per layer) for the sequence with N registers inserted before row ``at``, which get none: no rotation,
    no bias to or from them."""

    def each(value, fix):
        return [fix(v, at, n) for v in value] if isinstance(value, Sequence) else fix(value, at, n)

    out = dict(positions)
    if out.get("rope") is not None:
        out["rope"] = each(out["rope"], _unrotated)
    if out.get("position_bias") is not None:
        out["position_bias"] = each(out["position_bias"], _unbiased)
    return out


def pad_rows(x: Tensor | None, n: int, value: float | bool = 0) -> Tensor | None:
    """Per-row data (B, L) or (B, L, D), e.g. a padding mask (False: registers are never masked) or added
    positions (zero: registers have none), extended by N rows at the end."""
    if x is None or n == 0:
        return x
    pad = (0, n) if x.dim() == 2 else (0, 0, 0, n)
    return F.pad(x, pad, value=value)
