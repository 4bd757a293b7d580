"""Train short, test long (Press et al. 2022): models run beyond their training length or image size."""

import pytest
import torch

from models.text.lm import DecoderOnlyLM
from models.vision.vit import VisionTransformer

V = 11


def tiny_lm(positions: str, **kw) -> DecoderOnlyLM:
    torch.manual_seed(0)
    return DecoderOnlyLM(V, d_model=16, nhead=2, num_layers=1, dropout=0.0, max_positions=8, positions=positions, **kw)


@pytest.mark.parametrize("positions", ["sinusoidal", "sinusoidal_concat", "rope", "alibi", "t5"])
def test_lm_runs_at_four_times_its_training_length(positions):
    lm = tiny_lm(positions).eval()
    tokens = torch.randint(V, (2, 32))
    logits = lm(tokens)
    assert logits.shape == (2, 32, V) and torch.isfinite(logits).all()
    # causal: the first 8 positions read the same whatever follows them
    torch.testing.assert_close(logits[:, :8], lm(tokens[:, :8]), atol=1e-5, rtol=1e-5)


def test_learned_positions_beyond_the_table_raise_one_line_naming_max_positions():
    with pytest.raises(ValueError, match=r"^position 15 exceeds max_positions=8 [^\n]*model\.max_positions[^\n]*$"):
        tiny_lm("learned")(torch.randint(V, (1, 16)))


def test_resampled_learned_positions_interpolate_the_table_linearly():
    lm = tiny_lm("learned", resample_positions=True)
    table = lm.pos.weight.detach()  # (8, D)
    assert torch.equal(lm.pos(8), lm.pos.weight)  # within the table: unchanged
    stretched = lm.pos(15).detach()  # (15, D): row p sits at p·7/14 = p/2 of the old table
    torch.testing.assert_close(stretched[0::2], table)
    torch.testing.assert_close(stretched[1::2], (table[:-1] + table[1:]) / 2)
    assert lm(torch.randint(V, (1, 15))).shape == (1, 15, V)


@pytest.mark.parametrize("positions", ["learned", "sincos2d", "rope_axial", "rope_mixed"])
def test_vit_trained_at_8px_classifies_12_and_16px_images(positions):
    torch.manual_seed(0)
    vit = VisionTransformer(8, 2, 1, 3, embed_dim=16, depth=1, num_heads=2, positions=positions).eval()
    for size in (8, 12, 16):
        assert vit(torch.randn(2, 1, size, size)).shape == (2, 3)
    with pytest.raises(ValueError, match="model.patch_size=2 does not divide the image size 9"):
        vit(torch.randn(1, 1, 9, 9))


def test_vit_learned_positions_are_resampled_bicubically_to_the_larger_grid():
    from timm.layers import resample_abs_pos_embed

    vit = VisionTransformer(8, 2, 1, 3, embed_dim=16, depth=1, num_heads=2)
    expected = resample_abs_pos_embed(vit.pos_embed, [6, 6], [4, 4], num_prefix_tokens=1)
    torch.testing.assert_close(vit._pos_embed((6, 6)), expected)
    assert vit._pos_embed((4, 4)) is vit.pos_embed


def test_vit_sincos2d_has_no_parameters_and_relpos_tables_are_resized_to_another_grid():
    vit = VisionTransformer(8, 2, 1, 3, embed_dim=16, depth=1, num_heads=2, positions="sincos2d")
    assert vit.pos_embed is None and not any("sincos" in name for name, _ in vit.named_parameters())
    relpos = VisionTransformer(8, 2, 1, 3, embed_dim=16, depth=1, num_heads=2, positions="relpos")
    (bias,) = relpos.attention_positions((6, 6))["position_bias"]
    assert bias.shape == (2, 1 + 36, 1 + 36) and relpos(torch.randn(1, 1, 12, 12)).shape == (1, 3)
    assert relpos.rel_pos_bias[0].relative_position_bias_table.shape == (7 * 7 + 3, 2)  # the parameter is unchanged
