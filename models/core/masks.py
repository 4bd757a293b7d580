"""What a query sees: the masks and position biases of one attention call, merged whole or for a block of query rows.

Mask convention (ONE for the whole project, the one of ``torch.nn.MultiheadAttention`` and DETR):
    a boolean mask is True where attention is BLOCKED (padding, the future).
    ``key_padding_mask``  (B, Lk)                      True at padded keys
    ``attn_mask``         (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk): boolean (True = blocked) or
                          float (added to the logits; -inf blocks); or `Documents`
    ``is_causal``         query i may attend to keys j <= i, aligned to the END of the keys, so
                          that a decoder step with cached keys (Lq < Lk) sees its whole past.
    ``window``            sliding-window attention (Beltagy et al. 2020; Mistral, Jiang et al. 2023): query i sees
                          the keys j with i - window < j <= i when causal, |i - j| < window otherwise
    ``position_bias``     (H, Lq, Lk) or (B, H, Lq, Lk) added to the logits, or a `LazyBias` that gives its rows
A query row whose keys are all blocked gets all-zero weights and a zero attention output, never NaN.

`Documents` and `LazyBias` are never an (Lq, Lk) tensor until a path asks for one: `MaskParts.rows` merges the parts
for the query rows start..stop only, so that the chunked path (`models.core.chunked`) holds O(rows · Lk) of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def subsequent_mask(size: int, device: torch.device | None = None) -> Tensor:
    """(size, size) boolean mask, True above the diagonal: position i may not see j > i."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


def causal_mask(lq: int, lk: int, device: torch.device) -> Tensor:
    """(Lq, Lk) boolean, aligned to the end: query i sits at absolute position lk - lq + i."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).triu(lk - lq + 1)


@dataclass(frozen=True)
class Documents:
    """Document masking of packed sequences (Llama 3; NaViT's images packed in one sequence): ``ids`` (B, L) names the
    document of every token, and a query attends only to keys of its own document. Self-attention only."""

    ids: Tensor

    def rows(self, start: int, stop: int, keys: tuple[int, int]) -> Tensor:
        """(B, stop - start, keys) boolean, True where the key is of another document."""
        return self.ids[:, start:stop, None] != self.ids[:, None, keys[0] : keys[1]]


@dataclass(frozen=True)
class LazyBias:
    """An additive position bias of ``shape`` (H, Lq, Lk) or (B, H, Lq, Lk), computed a block at a time by
    ``rows(start, stop, keys)`` -> (..., stop - start, keys[1] - keys[0]) for the query rows start..stop and the keys
    keys[0]..keys[1]: ALiBi, T5 and Swin biases are functions of the query and key positions, never stored whole on
    the chunked path. ``tensors``: what ``rows`` reads that may take a gradient (a learned table), for the chunked
    path's backward."""

    rows: Callable[[int, int, tuple[int, int]], Tensor]
    shape: tuple[int, ...]
    tensors: tuple[Tensor, ...] = ()

    def full(self) -> Tensor:
        return self.rows(0, self.shape[-2], (0, self.shape[-1]))


def _checked(name: str, got: tuple[int, ...], wanted: tuple[int, ...], dims: tuple[int, ...], expected: str) -> None:
    if got[-2:] != wanted or len(got) not in dims:
        raise ValueError(f"{name} has shape {got}, expected {expected}")


@dataclass
class MaskParts:
    """The masks and bias of one call on a (batch B, Lq queries, Lk keys) block, checked once, merged on demand."""

    batch: int
    lq: int
    lk: int
    attn_mask: Tensor | Documents | None = None
    key_padding_mask: Tensor | None = None
    is_causal: bool = False
    window: int | None = None
    position_bias: Tensor | LazyBias | None = None

    def __post_init__(self) -> None:
        if self.position_bias is not None:
            lq, lk = self.lq, self.lk
            expected = f"(heads, {lq}, {lk}) or (batch, heads, {lq}, {lk})"
            _checked("position_bias", tuple(self.position_bias.shape), (lq, lk), (3, 4), expected)
        if self.key_padding_mask is not None and self.key_padding_mask.shape != (self.batch, self.lk):
            raise ValueError(
                f"key_padding_mask has shape {tuple(self.key_padding_mask.shape)}, expected (batch={self.batch}, "
                f"keys={self.lk})"
            )
        if isinstance(self.attn_mask, Documents):
            if self.attn_mask.ids.shape != (self.batch, self.lk) or self.lq != self.lk:
                raise ValueError(
                    f"Documents ids of shape {tuple(self.attn_mask.ids.shape)}: self-attention over (batch="
                    f"{self.batch}, length={self.lk}) takes (batch, length) ids"
                )
        elif self.attn_mask is not None:
            expected = f"(..., {self.lq}, {self.lk})"
            _checked("attn_mask", tuple(self.attn_mask.shape), (self.lq, self.lk), (2, 3, 4), expected)

    @property
    def empty(self) -> bool:
        return not (self.is_causal or self.window) and all(
            p is None for p in (self.attn_mask, self.key_padding_mask, self.position_bias)
        )

    @property
    def float_valued(self) -> bool:
        """Whether the merged mask is additive (a bias or a float mask) rather than boolean."""
        mask = self.attn_mask
        return self.position_bias is not None or (isinstance(mask, Tensor) and mask.dtype != torch.bool)

    def key_range(self, start: int, stop: int) -> tuple[int, int]:
        """The keys that the causal and window masks let any of the query rows start..stop see."""
        first, last = start + self.lk - self.lq, stop - 1 + self.lk - self.lq  # the rows' own key indices
        reach = self.window - 1 if self.window else self.lk
        low = max(0, first - reach) if self.window else 0
        high = last + 1 if self.is_causal else last + 1 + reach
        return low, min(self.lk, max(high, low))

    def positional(self, start: int, stop: int, keys: tuple[int, int], device: torch.device) -> Tensor | None:
        """The causal and window masks of the query rows start..stop over ``keys``, (stop - start, keys), or None."""
        if not (self.is_causal or self.window):
            return None
        position = torch.arange(start, stop, device=device)[:, None] + (self.lk - self.lq)  # each query's key index
        offset = torch.arange(*keys, device=device)[None, :] - position  # key minus query
        blocked = offset > 0 if self.is_causal else torch.zeros_like(offset, dtype=torch.bool)
        if self.window:
            blocked |= offset <= -self.window if self.is_causal else offset.abs() >= self.window
        return blocked

    def boolean_parts(self, start: int, stop: int, keys: tuple[int, int], device: torch.device) -> list[Tensor]:
        """The boolean parts of the rows start..stop over ``keys``, each broadcastable to (B, H, rows, keys)."""
        parts, (k0, k1) = [], keys
        if (positional := self.positional(start, stop, keys, device)) is not None:
            parts.append(positional)
        if self.key_padding_mask is not None:
            parts.append(self.key_padding_mask[:, k0:k1].to(device)[:, None, None, :])
        mask = self.attn_mask
        if isinstance(mask, Documents):
            parts.append(mask.rows(start, stop, keys).to(device)[:, None])
        elif mask is not None and mask.dtype == torch.bool:
            parts.append(_rows_4d(mask.to(device), start, stop)[..., k0:k1])
        return parts

    def rows(
        self, start: int, stop: int, device: torch.device, dtype: torch.dtype, keys: tuple[int, int] | None = None
    ) -> Tensor | None:
        """The merged mask of the query rows start..stop over ``keys`` (all by default): boolean (True = blocked)
        when every part is, else additive (-inf blocks), (B|1, H|1, rows, keys); None when nothing is masked."""
        keys = (0, self.lk) if keys is None else keys
        blocked = None
        for part in self.boolean_parts(start, stop, keys, device):
            blocked = part if blocked is None else blocked | part
        blocked = None if blocked is None else blocked.reshape((1,) * (4 - blocked.dim()) + blocked.shape)
        if not self.float_valued:
            return blocked
        additive, bias, mask = None, self.position_bias, self.attn_mask
        if bias is not None:
            block = bias.rows(start, stop, keys) if isinstance(bias, LazyBias) else bias[..., start:stop, slice(*keys)]
            additive = block.to(device=device, dtype=dtype)
        if isinstance(mask, Tensor) and mask.dtype != torch.bool:
            rows = _rows_4d(mask.to(device, dtype), start, stop)[..., keys[0] : keys[1]]
            additive = rows if additive is None else additive + rows
        if blocked is not None:
            additive = torch.where(blocked, float("-inf"), additive)
        return additive.reshape((1,) * (4 - additive.dim()) + additive.shape)

    def full(self, device: torch.device, dtype: torch.dtype) -> Tensor | None:
        return self.rows(0, self.lq, device, dtype)


def merge_masks(batch: int, lq: int, lk: int, *, device: torch.device, dtype: torch.dtype, **parts) -> Tensor | None:
    """The whole merged mask of a call (`MaskParts` with ``parts``): boolean (B|1, H|1, Lq, Lk) when every part is,
    else additive; None when nothing is masked."""
    return MaskParts(batch, lq, lk, **parts).full(device, dtype)


def _rows_4d(mask: Tensor, start: int, stop: int) -> Tensor:
    """The rows start..stop of an (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk) mask, broadcastable to 4 dimensions."""
    rows = mask[..., start:stop, :]
    return rows[:, None] if rows.dim() == 3 else rows


def blocked_of(mask: Tensor | None) -> Tensor | None:
    """The boolean view (True = blocked) of a merged mask."""
    return mask if mask is None or mask.dtype == torch.bool else torch.isneginf(mask)
