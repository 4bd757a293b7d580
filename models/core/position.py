"""Positional encodings, added to the tokens or acting inside attention.

Added to the token embeddings:
    sinusoidal 1D (Vaswani et al. 2017), learned 1D (GPT, ViT): a run of consecutive positions,
    (length, D), sliced from a table; DETR's 2D sine encoding: a padding mask (B, H, W) -> (B, D, H, W).
Rotations of queries and keys (`Rotation`, applied by the attention core before its kernel):
    `RotaryEmbedding` 1D RoPE for text (Su et al. 2021), HF Llama's rotate-half layout;
    `RotaryEmbedding2D` for patch grids (Heo et al. 2024), "axial" or "mixed", timm's layout.
Additive biases on the attention logits, (H, Lq, Lk), queries aligned to the end of the keys:
    `ALiBi` (Press et al. 2022), `T5RelativePositionBias` (Raffel et al. 2020, bucketed),
    `RelativePositionBias2D` (Swin, Liu et al. 2021: one learned value per 2D offset and head).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from models.core.masks import LazyBias


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


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal encoding: (length, start) -> positions start..start + length - 1, (length, dim).

    Defined for every position: a table of ``max_len`` is kept, positions beyond it are computed when asked
    for (a model trained short and evaluated long, Press et al. 2022). ``concat``: all sines first, then all
    cosines (tensor2tensor, Marian), instead of interleaved.
    """

    def __init__(self, dim: int, max_len: int = 1024, base: float = 10000.0, concat: bool = False):
        super().__init__()
        self.dim, self.base, self.concat = dim, base, concat
        self.register_buffer("pe", self._table(max_len), persistent=False)

    def _table(self, length: int) -> Tensor:
        pe = sinusoidal_encoding(length, self.dim, self.base)  # (length, dim)
        return torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=1) if self.concat else pe

    def forward(self, length: int, start: int = 0) -> Tensor:
        if start + length > len(self.pe):
            return self._table(start + length)[start:].to(self.pe.device)
        return self.pe[start : start + length]


class LearnedPositionalEncoding(nn.Module):
    """One learned vector per position (GPT, ViT): (length, start) -> positions start..start + length - 1, (length, dim).

    Positions beyond the ``max_len`` rows of the table are a ValueError, unless ``interpolate``: then the table
    is resampled linearly to ``start + length`` rows (row p of the new table is the old one at p·(max_len - 1) /
    (start + length - 1)), as a ViT's pos_embed is resampled to a larger patch grid: every position keeps its
    relative place in the sequence, and neighbouring tokens sit closer together than in training.
    """

    def __init__(self, dim: int, max_len: int = 1024, interpolate: bool = False):
        super().__init__()
        self.max_len, self.interpolate = max_len, interpolate
        self.weight = nn.Parameter(torch.empty(max_len, dim))
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, length: int, start: int = 0) -> Tensor:
        if self.interpolate and start + length > self.max_len:
            table = nn.functional.interpolate(
                self.weight.T[None], size=start + length, mode="linear", align_corners=True
            )  # (1, dim, start + length)
            return table[0, :, start:].T
        if start + length > self.max_len:
            raise ValueError(
                f"position {start + length - 1} exceeds max_positions={self.max_len} (positions 0..{self.max_len - 1}) "
                "of the learned positions; raise model.max_positions, or set model.resample_positions=true to "
                "interpolate the table"
            )
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


def rotate_half(x: Tensor) -> Tensor:
    """(..., d): [x1 | x2] -> [-x2 | x1], the pairs (i, i + d/2) (HF Llama's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """(..., d): [x0, x1, x2, x3, ..] -> [-x1, x0, -x3, x2, ..], the pairs (2i, 2i + 1) (timm's interleaved layout)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


@dataclass
class Rotation:
    """RoPE angles of a run of positions: ``cos`` and ``sin`` (..., L, d), broadcastable to the heads
    (B, H, L, d). Calling it rotates each pair of channels of a query or key by its position's angle:
    x·cos + rot(x)·sin, where ``interleaved`` pairs channels (2i, 2i + 1) (timm), else (i, i + d/2) (Llama).
    The product is taken in the angles' float32 and cast back to x's dtype."""

    cos: Tensor
    sin: Tensor
    interleaved: bool = False

    def __call__(self, x: Tensor) -> Tensor:
        rot = rotate_pairs(x) if self.interleaved else rotate_half(x)
        return (x * self.cos + rot * self.sin).to(x.dtype)

    def with_prefix(self, n: int) -> Rotation:
        """Leave ``n`` leading tokens (a class token) unrotated: angle 0 (cos 1, sin 0) before the run."""
        pad = (0, 0, n, 0)
        return Rotation(
            nn.functional.pad(self.cos, pad, value=1.0), nn.functional.pad(self.sin, pad, value=0.0), self.interleaved
        )


class RotaryEmbedding(nn.Module):
    """1D RoPE (Su et al. 2021) as HF Llama computes it, so that its checkpoints load unchanged:
    inverse frequencies θ^(-2i/d), i < d/2, in float32, channels i and i + d/2 rotated together.

    (length, start) -> the `Rotation` of positions start..start + length - 1, cos/sin (length, d);
    ``start`` is the KV cache's length when decoding step by step. Any position has its angles: no bound.
    `at` gives the angles of any positions, e.g. each token's position within its packed document.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # (d/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, length: int, start: int = 0) -> Rotation:
        return self.at(torch.arange(start, start + length, device=self.inv_freq.device))

    def at(self, positions: Tensor) -> Rotation:
        """The `Rotation` of integer ``positions`` (..., L): cos/sin (..., L, d)."""
        angles = positions.float()[..., None] * self.inv_freq  # (..., L, d/2)
        angles = torch.cat((angles, angles), dim=-1)  # (..., L, d)
        return Rotation(angles.cos(), angles.sin())


class RotaryEmbedding2D(nn.Module):
    """2D RoPE for a grid of patches or feature-map cells (Heo et al. 2024), in timm's layout
    (``RotaryEmbeddingCat`` with integer positions, ``RotaryEmbeddingMixed``; grid indexing "xy"):
    channels are rotated in interleaved pairs; a cell at row y, column x has the angles
    "axial": x·ω_j on the first d/2 channels, y·ω_j on the last d/2, ω_j = θ^(-j/(d/4)), j < d/4
             (fixed; θ = 100 in the RoPE ViTs);
    "mixed": x·f_x + y·f_y, learned frequencies ``freqs`` (2, depth, H, d/2) per layer and head, started
             as ω' = θ^(-4j/d) along a random direction per head and layer, then at a right angle to it
             (θ = 10).
    Cells are numbered row by row (y outer), as the tokens of a flattened feature map. ``indexing="ij"`` swaps
    the roles of x and y (timm's ``rope_grid_indexing='ij'``, its default, used by its ``*_rope_reg*`` ViTs).

    Shapes: grid (h, w) -> "axial": one `Rotation` for every layer, cos/sin (h·w, d);
    "mixed": a list of ``depth`` `Rotation`s, cos/sin (H, h·w, d) each.
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        mode: Literal["axial", "mixed"] = "axial",
        theta: float | None = None,
        depth: int = 1,
        indexing: Literal["xy", "ij"] = "xy",
    ):
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2D RoPE needs a head dimension divisible by 4, got {head_dim}")
        if indexing not in ("xy", "ij"):
            raise ValueError(f"2D RoPE indexing={indexing!r} is not known; choose xy or ij")
        self.indexing = indexing
        if mode not in ("axial", "mixed"):
            raise ValueError(f"2D RoPE mode={mode!r} is not known; choose axial or mixed")
        self.mode = mode
        if mode == "axial":
            theta = 100.0 if theta is None else theta
            omega = 1.0 / theta ** (torch.arange(head_dim // 4, dtype=torch.int64).float() / (head_dim // 4))
            self.register_buffer("omega", omega, persistent=False)  # (d/4,)
        else:
            theta = 10.0 if theta is None else theta
            magnitude = 1.0 / theta ** (torch.arange(0, head_dim, 4).float() / head_dim)  # (d/4,)
            direction = torch.rand(depth, num_heads, 1) * 2 * math.pi  # (depth, H, 1)
            fx = torch.cat((magnitude * direction.cos(), magnitude * (direction + math.pi / 2).cos()), dim=-1)
            fy = torch.cat((magnitude * direction.sin(), magnitude * (direction + math.pi / 2).sin()), dim=-1)
            self.freqs = nn.Parameter(torch.stack((fx, fy)))  # (2, depth, H, d/2)

    def forward(self, grid: tuple[int, int]) -> Rotation | list[Rotation]:
        h, w = grid
        device = self.omega.device if self.mode == "axial" else self.freqs.device
        y, x = torch.meshgrid(
            torch.arange(h, device=device).float(), torch.arange(w, device=device).float(), indexing="ij"
        )
        x, y = x.reshape(-1, 1), y.reshape(-1, 1)  # (N, 1), rows first
        if self.indexing == "ij":
            x, y = y, x
        if self.mode == "axial":
            angles = torch.cat((x * self.omega, y * self.omega), dim=-1).repeat_interleave(2, -1)  # (N, d)
            return Rotation(angles.cos(), angles.sin(), interleaved=True)
        freqs = self.freqs.float()
        angles = (x * freqs[0, :, :, None] + y * freqs[1, :, :, None]).repeat_interleave(2, -1)  # (depth, H, N, d)
        cos, sin = angles.cos(), angles.sin()
        return [Rotation(c, s, interleaved=True) for c, s in zip(cos, sin)]


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al. 2022): the geometric sequence 2^(-8/n), 2^(-16/n), .. for n a power
    of two; otherwise those of the power of two below n, then every other slope of the next power of two."""
    closest = 2 ** math.floor(math.log2(num_heads))

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    slopes = geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


def _query_key_offsets(lq: int, lk: int, start: int, stop: int, keys: tuple[int, int], device: torch.device) -> Tensor:
    """(stop - start, keys) key position minus query position for the query rows start..stop and the keys
    keys[0]..keys[1], queries aligned to the end of the keys (a cached step)."""
    return torch.arange(*keys, device=device)[None, :] - (torch.arange(start, stop, device=device)[:, None] + (lk - lq))


class ALiBi(nn.Module):
    """Attention with linear biases (Press et al. 2022): head h adds -m_h·|i - j| to the logit of query i
    and key j (causal models see j <= i only, so this is the paper's -m_h·(i - j)).

    (Lq, Lk) -> bias (H, Lq, Lk), queries at the last Lq key positions.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def lazy(self, lq: int, lk: int) -> LazyBias:
        """The bias (H, Lq, Lk), computed a block of query rows at a time."""

        def rows(start: int, stop: int, keys: tuple[int, int]) -> Tensor:
            distance = _query_key_offsets(lq, lk, start, stop, keys, self.slopes.device).abs().float()  # (rows, keys)
            return -self.slopes[:, None, None] * distance

        return LazyBias(rows, (self.slopes.numel(), lq, lk))

    def forward(self, lq: int, lk: int) -> Tensor:
        return self.lazy(lq, lk).full()


def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's buckets for key position minus query position: half of the buckets (per direction when
    ``bidirectional``, else for the past only; the future shares bucket 0) hold offsets 0..n/2 - 1 exactly,
    the other half grow logarithmically up to ``max_distance``, beyond which offsets share the last bucket."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    log_bucket = (
        max_exact
        + (
            torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
        ).long()
    )
    log_bucket = log_bucket.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, log_bucket)


class T5RelativePositionBias(nn.Module):
    """T5's relative position bias (Raffel et al. 2020): one learned scalar per head and bucket of the offset
    key - query; bidirectional for an encoder, past-only for a causal decoder. One module serves every
    layer of a stack, as in T5. (Lq, Lk) -> bias (H, Lq, Lk), queries at the last Lq key positions."""

    def __init__(self, num_heads: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)  # T5's name
        nn.init.trunc_normal_(self.relative_attention_bias.weight, std=0.02)

    def lazy(self, lq: int, lk: int) -> LazyBias:
        """The bias (H, Lq, Lk), computed a block of query rows at a time. It depends on key - query alone: the bias
        of each of the Lq + Lk - 1 offsets is looked up once, and a block's rows are windows of it, one offset apart."""
        table = self.relative_attention_bias
        offsets = torch.arange(-(lk - 1), lq, device=table.weight.device)  # key - query, every pair's
        buckets = relative_position_bucket(offsets, self.bidirectional, self.num_buckets, self.max_distance)
        per_offset = table(buckets).t()  # (H, Lq + Lk - 1), the offset -(Lk - 1) first

        def rows(start: int, stop: int, keys: tuple[int, int]) -> Tensor:
            last = stop - 1 + lk - lq  # the key position of the last row's query
            first = keys[0] - last + lk - 1  # that row's offset to the first key, as an index into per_offset
            span = per_offset[:, first : first + keys[1] - keys[0] + stop - start - 1]
            return span.unfold(1, keys[1] - keys[0], 1).flip(1)  # (H, rows, keys): row i is window rows - 1 - i

        return LazyBias(rows, (table.embedding_dim, lq, lk), (per_offset,))

    def forward(self, lq: int, lk: int) -> Tensor:
        return self.lazy(lq, lk).full()


def relative_position_index(
    grid: Sequence[int], prefix_tokens: int = 0, start: int = 0, stop: int | None = None, device=None
) -> Tensor:
    """The row of each (query, key) cell pair in a (2h - 1)(2w - 1) offset table, (dy, dx) rows first; a class token
    (``prefix_tokens`` = 1) takes BEiT's three last rows: class to cell, cell to class, class to class.
    -> (stop - start, p + h·w) for the query rows start..stop (all p + h·w of them by default)."""
    h, w = grid
    n_offsets, n = (2 * h - 1) * (2 * w - 1), prefix_tokens + h * w
    stop = n if stop is None else stop
    cells = torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"))
    cells = cells.flatten(1)  # (2, N)
    queries = cells[:, max(start - prefix_tokens, 0) : max(stop - prefix_tokens, 0)]
    delta = queries[:, :, None] - cells[:, None, :]  # (2, rows, N): query minus key
    index = (delta[0] + h - 1) * (2 * w - 1) + delta[1] + w - 1  # (rows, N)
    if prefix_tokens:
        index = nn.functional.pad(index, (1, 0), value=n_offsets + 1)  # cell to class
        if start == 0:  # the class token's row: class to cell, class to class
            first = torch.full((1, n), n_offsets, dtype=index.dtype, device=index.device)
            first[0, 0] = n_offsets + 2
            index = torch.cat([first, index])
    return index


class RelativePositionBias2D(nn.Module):
    """Swin's relative position bias over a patch grid (Liu et al. 2021), timm's ``RelPosBias``: a table of
    (2h - 1)(2w - 1) offsets x heads, indexed by the (dy, dx) between query and key cells (rows first).
    ``prefix_tokens`` = 1 (a class token) adds BEiT's three entries: class to cell, cell to class, class to class.
    For another grid than the table's, the table is resized as BEiT fine-tunes at a higher resolution (timm's
    ``resize_rel_pos_bias_table``: offsets spread geometrically, then interpolated; the class entries kept).
    (grid) -> bias (H, p + h·w, p + h·w)."""

    def __init__(self, grid: Sequence[int], num_heads: int, prefix_tokens: int = 0):
        super().__init__()
        if prefix_tokens not in (0, 1):
            raise ValueError(f"a relative position bias takes 0 or 1 prefix tokens, got {prefix_tokens}")
        self.grid, self.prefix_tokens = tuple(grid), prefix_tokens
        n_offsets = (2 * grid[0] - 1) * (2 * grid[1] - 1)
        self.relative_position_bias_table = nn.Parameter(torch.empty(n_offsets + 3 * prefix_tokens, num_heads))
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def lazy(self, grid: Sequence[int] | None = None) -> LazyBias:
        """The bias (H, p + h·w, p + h·w) over ``grid`` (the table's by default), a block of query rows at a time."""
        table, grid = self.relative_position_bias_table, tuple(grid or self.grid)
        if grid != self.grid:
            from timm.layers import resize_rel_pos_bias_table

            h, w = grid
            shape = ((2 * h - 1) * (2 * w - 1) + 3 * self.prefix_tokens, table.shape[1])
            table = resize_rel_pos_bias_table(table, (h, w), shape, old_window_size=self.grid)
        n = self.prefix_tokens + grid[0] * grid[1]

        def rows(start: int, stop: int, keys: tuple[int, int]) -> Tensor:
            index = relative_position_index(grid, self.prefix_tokens, start, stop, table.device)
            return table[index[:, keys[0] : keys[1]]].permute(2, 0, 1)  # (H, rows, keys)

        return LazyBias(rows, (table.shape[1], n, n), (table,))

    def forward(self, grid: Sequence[int] | None = None) -> Tensor:
        return self.lazy(grid).full()


# The text models' positions: added to the token embeddings, or acting inside self-attention.
Positions = Literal["sinusoidal", "sinusoidal_concat", "learned", "rope", "alibi", "t5"]
POSITIONS = ("sinusoidal", "sinusoidal_concat", "learned", "rope", "alibi", "t5")
IN_ATTENTION = ("rope", "alibi", "t5")


def positional_encoding(kind: Positions, d_model: int, max_len: int, interpolate: bool = False) -> nn.Module | None:
    """The encoding added to the token embeddings; None when positions act inside attention. Sines are defined
    for every position; a learned table ends at ``max_len``, unless ``interpolate`` (`LearnedPositionalEncoding`)."""
    if kind in IN_ATTENTION:
        return None
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model, max_len)
    if kind == "sinusoidal_concat":  # the same waves, all sines first, then all cosines (tensor2tensor, Marian)
        return SinusoidalPositionalEncoding(d_model, max_len, concat=True)
    if kind == "learned":
        return LearnedPositionalEncoding(d_model, max_len, interpolate)
    raise ValueError(f"model.positions={kind!r} is not known; choose one of {', '.join(POSITIONS)}")


class SelfAttentionPositions(nn.Module):
    """The positions one stack's self-attention sees: RoPE angles, or an ALiBi or T5 bias.

    (length, start) -> the stack's keyword arguments for new tokens at positions start..start + length - 1,
    attending to keys 0..start + length - 1 (a cached step has start > 0): {"rope": Rotation} or
    {"position_bias": a `LazyBias` (H, length, start + length)}; {} for positions added to the embeddings.
    """

    def __init__(self, kind: Positions, d_model: int, nhead: int, causal: bool, rope_theta: float):
        super().__init__()
        self.rope = self.bias = None
        if kind == "rope":
            if (d_model // nhead) % 2:
                raise ValueError(
                    f"model.positions=rope needs an even head size, got model.d_model/model.nhead = {d_model // nhead}"
                )
            self.rope = RotaryEmbedding(d_model // nhead, rope_theta)
        elif kind == "alibi":
            self.bias = ALiBi(nhead)
        elif kind == "t5":
            self.bias = T5RelativePositionBias(nhead, bidirectional=not causal)

    def forward(self, length: int, start: int = 0) -> dict:
        if self.rope is not None:
            return {"rope": self.rope(length, start)}
        if self.bias is not None:
            return {"position_bias": self.bias.lazy(length, start + length)}
        return {}
