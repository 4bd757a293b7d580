"""RoPE (1D, 2D axial and mixed), ALiBi and relative position biases against the implementations whose
checkpoints they must load (HF Llama, timm, BLOOM, T5) and against their defining properties."""

import itertools

import numpy as np
import pytest
import torch
from timm.layers import RelPosBias, RotaryEmbeddingCat, RotaryEmbeddingMixed, apply_rot_embed_cat

from models.core.attention import AttentionConfig
from models.core.position import (
    ALiBi,
    RelativePositionBias2D,
    RotaryEmbedding,
    RotaryEmbedding2D,
    T5RelativePositionBias,
    alibi_slopes,
    relative_position_bucket,
)


def test_rope_equals_hf_llama_with_a_cache_offset():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads, theta = 10, 3, 500.0
    hf = LlamaRotaryEmbedding(LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads, rope_theta=theta))
    ours = RotaryEmbedding(head_dim, theta=theta)
    q, k = torch.randn(2, heads, 4, head_dim), torch.randn(2, heads, 4, head_dim)
    cos, sin = hf(q, torch.arange(6, 10)[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    rot = ours(4, start=6)
    torch.testing.assert_close(rot(q), q_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rot(k), k_hf, atol=1e-6, rtol=1e-6)


def test_rope_logits_depend_on_the_offset_only():
    rope = RotaryEmbedding(8, theta=10000.0)
    q, k = torch.randn(8, dtype=torch.float64).float(), torch.randn(8)
    logit = [rope(1, start=i)(q) @ rope(1, start=j)(k).T for i, j in ((3, 1), (40, 38), (2, 2), (30, 30))]
    torch.testing.assert_close(logit[0], logit[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logit[2], logit[3], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logit[0], logit[2])


def test_axial_2d_rope_equals_timm_rope_vit():
    head_dim, grid = 12, (3, 5)  # a non-square grid pins which axis is x
    timm_rope = RotaryEmbeddingCat(head_dim, temperature=100.0, in_pixels=False, grid_indexing="xy")
    ours = RotaryEmbedding2D(head_dim, num_heads=2, mode="axial")
    x = torch.randn(2, 2, grid[0] * grid[1], head_dim)
    torch.testing.assert_close(ours(grid)(x), apply_rot_embed_cat(x, timm_rope.get_embed(grid)), atol=1e-6, rtol=1e-6)


def test_axial_2d_rope_rotates_the_first_half_by_x_and_the_second_by_y():
    rot = RotaryEmbedding2D(8, num_heads=1, mode="axial")((2, 3))
    x = torch.randn(6, 8)
    out = rot(x)
    torch.testing.assert_close(out[0], x[0])  # cell (0, 0): no rotation
    torch.testing.assert_close(out[3, :4], x[3, :4])  # cell (1, 0): x = 0, first half untouched
    torch.testing.assert_close(out[1, 4:], x[1, 4:])  # cell (0, 1): y = 0, second half untouched


def test_mixed_2d_rope_equals_timm_with_the_same_frequencies():
    dim, heads, depth, grid = 24, 2, 3, (4, 3)
    timm_rope = RotaryEmbeddingMixed(dim, depth=depth, num_heads=heads, temperature=10.0, grid_indexing="xy")
    ours = RotaryEmbedding2D(dim // heads, heads, mode="mixed", depth=depth)
    assert ours.freqs.shape == timm_rope.freqs.shape
    ours.load_state_dict({"freqs": timm_rope.freqs.detach()})
    embed = timm_rope.get_embed(grid)  # (depth, H, N, 2d)
    x = torch.randn(2, heads, grid[0] * grid[1], dim // heads)
    rotations = ours(grid)
    assert len(rotations) == depth
    for layer, rot in enumerate(rotations):
        torch.testing.assert_close(rot(x), apply_rot_embed_cat(x, embed[layer]), atol=1e-6, rtol=1e-6)


def test_mixed_2d_rope_starts_like_timm_and_learns():
    torch.manual_seed(0)
    ours = RotaryEmbedding2D(8, 2, mode="mixed", depth=2)
    magnitude = 10.0 ** (-torch.arange(0, 8, 4).float() / 8)
    fx, fy = ours.freqs.detach()
    torch.testing.assert_close((fx**2 + fy**2).sqrt(), magnitude.repeat(2).expand(2, 2, 4))  # |f| = θ^(-4j/d)
    rot = ours((2, 2))[1]
    rot(torch.randn(2, 4, 8)).sum().backward()
    assert ours.freqs.grad is not None and ours.freqs.grad[:, 1].abs().sum() > 0


def test_2d_rope_refuses_a_head_dim_not_divisible_by_4():
    with pytest.raises(ValueError, match="divisible by 4, got 6"):
        RotaryEmbedding2D(6, 2)


@pytest.mark.parametrize("heads", [1, 5, 6, 8, 12])
def test_alibi_equals_bloom_up_to_a_constant_per_query(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    length = 7
    bloom = build_alibi_tensor(torch.ones(1, length, dtype=torch.long), heads, torch.float32)  # (H, 1, L): m·j
    torch.testing.assert_close(alibi_slopes(heads), bloom[:, 0, 1])
    ours = ALiBi(heads)(length, length)  # (H, L, L)
    past = torch.ones(length, length, dtype=torch.bool).tril()
    # BLOOM adds m·j, we add -m·(i - j): the same softmax over the keys a causal query sees
    diff = (ours - bloom)[:, past]
    shift = ours - bloom - (ours - bloom)[:, :, :1]
    assert torch.allclose(shift[:, past], torch.zeros_like(diff), atol=1e-5)


@pytest.mark.parametrize("heads", [4, 8])
@pytest.mark.parametrize("lq,lk", [(6, 6), (2, 6)])
def test_alibi_is_minus_the_slope_times_the_distance_before_and_after_the_query(heads, lq, lk):
    """Press et al. 2022: head h (1-based) has slope m_h = 2^(-8h/H) and adds -m_h·|i - j|; an encoder sees the keys
    after the query too (j > i), with the same bias as the keys as far before it. Queries sit at the last Lq keys."""
    bias = ALiBi(heads)(lq, lk)
    for h, i, j in itertools.product(range(heads), range(lq), range(lk)):
        position = lk - lq + i
        assert bias[h, i, j].item() == pytest.approx(-(2 ** (-8 * (h + 1) / heads)) * abs(position - j), abs=1e-6)


def test_alibi_of_a_cached_step_is_the_last_row():
    alibi = ALiBi(3)
    torch.testing.assert_close(alibi(2, 6), alibi(6, 6)[:, -2:])


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_equal_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300)[:, None] + torch.arange(0, 3)[None]
    for buckets, distance in ((32, 128), (10, 20)):
        expected = T5Attention._relative_position_bucket(rel, bidirectional, buckets, distance)
        torch.testing.assert_close(relative_position_bucket(rel, bidirectional, buckets, distance), expected)


def test_t5_bias_is_one_value_per_head_and_bucket_and_the_decoder_sees_no_future_bucket():
    enc, dec = T5RelativePositionBias(3, bidirectional=True), T5RelativePositionBias(3, bidirectional=False)
    bias = enc(5, 5)
    assert bias.shape == (3, 5, 5)
    torch.testing.assert_close(bias[:, 1, 0], enc.relative_attention_bias.weight[1])  # offset -1: bucket 1
    torch.testing.assert_close(bias[:, 0, 1], enc.relative_attention_bias.weight[17])  # offset +1: 16 + 1
    torch.testing.assert_close(dec(1, 5)[:, 0], dec(5, 5)[:, -1])  # a cached step
    torch.testing.assert_close(dec(5, 5)[:, 0, 1], dec.relative_attention_bias.weight[0])  # the future: bucket 0


@pytest.mark.parametrize("prefix", [0, 1])
def test_swin_table_equals_timm_rel_pos_bias(prefix):
    grid, heads = (3, 4), 2
    ours, theirs = RelativePositionBias2D(grid, heads, prefix), RelPosBias(grid, heads, prefix_tokens=prefix)
    assert (
        ours.relative_position_bias_table.shape == theirs.relative_position_bias_table.shape == (5 * 7 + 3 * prefix, 2)
    )
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(), theirs.get_bias()[0])
    theirs.set_window_size((5, 6))  # a larger grid: timm resizes its table in place, ours is resized on the fly
    torch.testing.assert_close(ours((5, 6)), theirs.get_bias()[0])
    torch.testing.assert_close(ours((3, 4)), ours())  # the table's own grid: unchanged
    if prefix:  # the class token's three entries are kept as they are
        torch.testing.assert_close(ours((5, 6))[:, 0, 0], ours()[:, 0, 0])


def _gathered_by_hand(offsets: torch.Tensor, grid: tuple[int, int], prefix: int) -> torch.Tensor:
    """Swin's bias (H, p + h·w, p + h·w) from ``offsets`` (H, 2h - 1, 2w - 1), entry [dy + h - 1, dx + w - 1] for a
    query cell (y, x) and key cell (y', x') with dy = y - y', dx = x - x', cells row by row; a class token (``prefix``):
    class to cell, cell to class, class to class, (H,) each, after the offsets (BEiT)."""
    h, w = grid
    heads = offsets.shape[0]
    cells = [(y, x) for y in range(h) for x in range(w)]
    bias = torch.empty(heads, prefix + h * w, prefix + h * w)
    for (a, (y, x)), (b, (y_, x_)) in itertools.product(enumerate(cells), repeat=2):
        bias[:, prefix + a, prefix + b] = offsets[:, y - y_ + h - 1, x - x_ + w - 1]
    return bias


def _spread_by_beit(n: int, n_new: int) -> np.ndarray:
    """Where BEiT's resize puts one axis's old offsets -(n - 1)..n - 1: 0, ±1, ±(1 + q), ±(1 + q + q²), .., with q in
    [1.01, 1.5] chosen so that the last lands on the new largest offset n_new - 1 where it can."""
    from scipy.optimize import brentq

    def reach(q: float) -> float:
        return sum(q**i for i in range(n - 1)) - (n_new - 1)

    q = 1.01 if reach(1.01) > 0 else 1.5 if reach(1.5) < 0 else brentq(reach, 1.01, 1.5)
    spread = np.cumsum([q**i for i in range(n - 1)])
    return np.concatenate([-spread[::-1], [0.0], spread])


def _resized_by_hand(offsets: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """An offset table (H, 2h - 1, 2w - 1) resized to another grid as BEiT fine-tunes at a higher resolution: the old
    offsets spread (`_spread_by_beit`), each new integer offset interpolated linearly between them (scipy), the edge
    value beyond the last."""
    from scipy.interpolate import RegularGridInterpolator

    axes = [_spread_by_beit(n, n_new) for n, n_new in zip(old, new)]
    dy, dx = (np.clip(np.arange(1 - n, n), a[0], a[-1]) for n, a in zip(new, axes))
    points = np.stack(np.meshgrid(dy, dx, indexing="ij"), axis=-1)  # (2h' - 1, 2w' - 1, 2)
    resized = [RegularGridInterpolator(axes, table.double().numpy())(points) for table in offsets]
    return torch.tensor(np.stack(resized), dtype=torch.float32)


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("new", [(4, 3), (5, 6), (2, 2)], ids=["table's grid", "larger", "smaller"])
def test_swin_bias_is_the_offset_table_gathered_and_resized_by_hand(prefix, new):
    """A (4, 3) table (non-square: the axes are told apart) on its own grid, on a larger one (rows: q = 1.30 spreads
    the offsets to reach 4; columns: q = 1.5 leaves the edge value beyond 2.5) and on a smaller one (the centre)."""
    old, heads = (4, 3), 2
    module = RelativePositionBias2D(old, heads, prefix)
    n_offsets = (2 * old[0] - 1) * (2 * old[1] - 1)
    table = module.relative_position_bias_table.detach()  # (offsets + 3·prefix, H), offsets row by row (dy outer)
    offsets = table[:n_offsets].T.reshape(heads, 2 * old[0] - 1, 2 * old[1] - 1)
    if new != old:
        offsets = _resized_by_hand(offsets, old, new)
    expected = _gathered_by_hand(offsets, new, prefix)
    if prefix:
        expected[:, 0, :], expected[:, :, 0], expected[:, 0, 0] = (
            table[n_offsets, :, None],
            table[n_offsets + 1, :, None],
            table[n_offsets + 2],
        )
    torch.testing.assert_close(module(new), expected, atol=1e-5, rtol=1e-5)


def test_swin_table_depends_on_the_offset_only():
    bias = RelativePositionBias2D((3, 3), 1)()[0]  # (9, 9), cells row by row
    assert bias[0, 4] == bias[4, 8]  # (0,0)->(1,1) and (1,1)->(2,2)
    assert bias[0, 4] != bias[4, 0]


@pytest.mark.slow  # dynamo traces each model: seconds apiece on a shared CPU
@pytest.mark.parametrize("model", ["vit-rope_mixed", "vit-relpos", "seq2seq-rope", "seq2seq-t5", "lm-alibi"])
def test_positions_inside_attention_keep_forward_one_graph(model):
    """As tests/test_compile.py checks for the default models: no host read or graph break in the new paths."""
    import torch._dynamo as dynamo

    from models.text.lm import DecoderOnlyLM
    from models.text.seq2seq import Seq2SeqTransformer
    from models.vision.vit import VisionTransformer

    kind, positions = model.split("-")
    if kind == "vit":
        net = VisionTransformer(
            img_size=16, patch_size=4, num_classes=5, embed_dim=16, depth=2, num_heads=2, positions=positions
        )
        inputs = (torch.randn(2, 3, 16, 16),)
    elif kind == "seq2seq":
        net = Seq2SeqTransformer(30, 30, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                 dim_feedforward=32, positions=positions, attention=AttentionConfig(qk_norm="rmsnorm"))  # fmt: skip
        src = torch.randint(1, 30, (2, 7))
        src[1, 4:] = 0
        inputs = (src, torch.randint(1, 30, (2, 5)))
    else:
        net = DecoderOnlyLM(30, d_model=16, nhead=2, num_layers=2, dim_feedforward=32, positions=positions)
        inputs = (torch.randint(0, 30, (2, 9)),)
    dynamo.reset()
    explanation = dynamo.explain(net.train())(*inputs)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
