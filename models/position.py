"""Positional encodings: sinusoidal 1D (Vaswani et al.), learned 1D, and DETR's 2D sine encoding.

The 1D encodings return the vectors of a run of consecutive positions, (length, D), sliced from
their table; models add them to token embeddings. The 2D encoding maps a padding mask (B, H, W)
to (B, D, H, W).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_encoding(length: int, dim: int, base: float = 10000.0) -> Tensor:
    """(length, dim) table with PE(pos, 2i) = sin(pos / base^(2i/dim)), PE(pos, 2i+1) = cos(...)."""
    if dim % 2:
        raise ValueError(f"sinusoidal positional encoding needs an even dimension, got {dim}")
    pos = torch.arange(length, dtype=torch.float64)[:, None]
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pe = torch.empty(length, dim, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq)
    return pe.float()


def _check_range(length: int, start: int, max_len: int) -> None:
    # on the host, from Python ints: a check of a positions tensor would wait for the GPU at every call
    if start + length > max_len:
        raise ValueError(
            f"position {start + length - 1} exceeds max_positions={max_len} (positions 0..{max_len - 1}); "
            f"raise model.max_positions"
        )


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal encoding: (length, start) -> positions start..start + length - 1, (length, dim)."""

    def __init__(self, dim: int, max_len: int = 1024, base: float = 10000.0):
        super().__init__()
        self.max_len = max_len
        self.register_buffer("pe", sinusoidal_encoding(max_len, dim, base), persistent=False)

    def forward(self, length: int, start: int = 0) -> Tensor:
        _check_range(length, start, self.max_len)
        return self.pe[start : start + length]


class LearnedPositionalEncoding(nn.Module):
    """One learned vector per position (GPT, ViT): (length, start) -> positions start..start + length - 1, (length, dim)."""

    def __init__(self, dim: int, max_len: int = 1024):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.empty(max_len, dim))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, length: int, start: int = 0) -> Tensor:
        _check_range(length, start, self.max_len)
        return self.weight[start : start + length]


class PositionEmbeddingSine2D(nn.Module):
    """DETR's 2D sine encoding computed from the padding mask (Carion et al. 2020).

    Positions are cumulative counts of valid pixels along each axis, so padding does not shift
    the encoding of the image. Half of the channels encode y, half x.

    Args:
        num_pos_feats: channels per axis (output has 2 * num_pos_feats channels).
        temperature: base of the frequencies.
        normalize: scale positions to [0, scale] by the valid height/width.
        scale: the range after normalisation (2π by default).
    Shapes: mask (B, H, W) boolean, True at padding -> (B, 2 * num_pos_feats, H, W).
    """

    def __init__(
        self, num_pos_feats: int = 128, temperature: float = 10000.0, normalize: bool = True, scale: float = 2 * math.pi
    ):
        super().__init__()
        self.num_pos_feats, self.temperature, self.normalize, self.scale = num_pos_feats, temperature, normalize, scale

    def forward(self, mask: Tensor) -> Tensor:
        valid = (~mask).float()
        y = valid.cumsum(1)  # (B, H, W)
        x = valid.cumsum(2)
        if self.normalize:
            eps = 1e-6
            y = y / (y[:, -1:, :] + eps) * self.scale
            x = x / (x[:, :, -1:] + eps) * self.scale
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=mask.device)
        dim_t = self.temperature ** (2 * (dim_t // 2) / self.num_pos_feats)
        pos_x = x[..., None] / dim_t  # (B, H, W, F)
        pos_y = y[..., None] / dim_t
        pos_x = torch.stack((pos_x[..., 0::2].sin(), pos_x[..., 1::2].cos()), dim=4).flatten(3)
        pos_y = torch.stack((pos_y[..., 0::2].sin(), pos_y[..., 1::2].cos()), dim=4).flatten(3)
        return torch.cat((pos_y, pos_x), dim=3).permute(0, 3, 1, 2)  # (B, 2F, H, W)
