"""ViT building blocks and the digits DataModule, without a Trainer."""

import pytest
import torch
from builders import tiny_vit

from datamodules.vision.classification import DigitsDataModule, split_lengths
from models.core.attention import AttentionConfig
from models.core.capture import capture_attention
from models.optim import param_groups
from models.vision.module import ImageClassifier
from models.vision.vit import PatchEmbed, VisionTransformer


def test_patch_embed_cuts_non_overlapping_patches():
    embed = PatchEmbed(img_size=8, patch_size=2, in_chans=1, embed_dim=4)
    x = torch.zeros(1, 1, 8, 8)
    x[0, 0, 2:4, 4:6] = 1.0  # exactly patch (row 1, col 2) = token 1 * 4 + 2
    tokens = embed(x) - embed.proj.bias
    changed = tokens.abs().sum(-1)[0].nonzero().flatten().tolist()
    assert tokens.shape == (1, 16, 4) and changed == [6]


def test_patch_size_must_divide_image_size():
    with pytest.raises(ValueError, match="model.patch_size=3 does not divide the image size 8"):
        PatchEmbed(img_size=8, patch_size=3)


def test_conv_stem_halves_the_side_per_layer_and_stays_local():
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=8, patch_size=1, in_chans=1, embed_dim=4, stem_channels=(3, 5)).eval()
    assert (embed.grid_size, embed.num_patches) == (2, 4)  # 8 -> 4 -> 2
    assert PatchEmbed(img_size=28, patch_size=1, in_chans=1, embed_dim=4, stem_channels=(2, 2, 2)).grid_size == 4
    x = torch.randn(1, 1, 8, 8)
    y = x.clone()
    y[0, 0, 0, 2] += 1.0  # through two 3x3 stride-2 layers, pixel (0, 2) reaches tokens (0, 0) and (0, 1) only
    changed = (embed(y) - embed(x)).abs().sum(-1)[0] > 0
    assert embed(x).shape == (1, 4, 4) and changed.tolist() == [True, True, False, False]
    with pytest.raises(ValueError, match="model.patch_size=3 does not divide the stem's 4x4 feature map 4"):
        PatchEmbed(img_size=8, patch_size=3, stem_channels=(4,))


def test_heads_must_divide_the_width():
    with pytest.raises(ValueError, match=r"model.num_heads=3 does not divide model.embed_dim=32; choose a divisor"):
        VisionTransformer(img_size=8, patch_size=2, embed_dim=32, num_heads=3)


def test_vit_shapes_pooling_and_weight_decay_exemptions():
    for pool in ("token", "avg"):
        vit = tiny_vit(32, 2, 4, global_pool=pool)
        assert vit(torch.randn(3, 1, 8, 8)).shape == (3, 10)
    assert vit.forward_features(torch.randn(3, 1, 8, 8)).shape == (3, 17, 32)
    assert vit.no_weight_decay() == {"pos_embed", "cls_token"}


def test_every_vit_layer_attends_through_the_shared_core():
    vit = tiny_vit(32, 3, 4).eval()
    with capture_attention(vit) as maps:
        vit(torch.randn(2, 1, 8, 8))
    assert sorted(maps) == [f"encoder.layers.{i}.self_attn" for i in range(3)]
    assert all(m[0].shape == (2, 4, 17, 17) for m in maps.values())


def test_digits_split_is_fixed_by_the_seed_and_standardised():
    a, b = DigitsDataModule(seed=1), DigitsDataModule(seed=1)
    a.setup(), b.setup()
    assert len(a.train_set) + len(a.val_set) + len(a.test_set) == 1797
    torch.testing.assert_close(a.val_set.tensors[0], b.val_set.tensors[0])
    train = a.train_set.tensors[0]
    assert abs(train.mean().item()) < 1e-4 and abs(train.std().item() - 1) < 1e-4
    assert train.shape[1:] == (1, 8, 8)


def test_split_fractions_are_checked():
    assert split_lengths(100, 0.1, 0.2) == [70, 10, 20]
    with pytest.raises(ValueError, match="data.val_fraction=1.5"):
        split_lengths(100, 1.5)
    with pytest.raises(ValueError, match="leave no training samples"):
        split_lengths(10, 0.5, 0.5)


@pytest.mark.slow
def test_tiny_vit_overfits_32_digits():
    torch.manual_seed(0)
    dm = DigitsDataModule()
    dm.setup()
    x, y = dm.train_set.tensors[0][:32], dm.train_set.tensors[1][:32]
    vit = tiny_vit(32, 2, 4)
    opt = torch.optim.AdamW(vit.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(vit(x), y).backward()
        opt.step()
    assert (vit(x).argmax(-1) == y).float().mean().item() == 1.0


# positions inside attention: 2D RoPE (timm's RoPE ViTs, Eva), a Swin/BEiT table per layer, QK-norm


def _rope_pair(positions, qk_norm, folder):
    """A timm Eva RoPE ViT, its state dict saved to a file, and our ViT loaded from that file by ``model.init_from``."""
    from timm.models.eva import Eva

    torch.manual_seed(0)
    size = dict(img_size=20, patch_size=4, in_chans=1, num_classes=3, embed_dim=24, depth=2, num_heads=2)
    theirs = Eva(
        **size,
        attn_type="rope",
        qkv_bias=True,
        qk_norm=qk_norm is not None,
        use_abs_pos_emb=False,
        use_rot_pos_emb=True,
        rope_grid_indexing="xy",
        rope_temperature=100.0 if positions == "rope_axial" else 10.0,
        rope_type="cat" if positions == "rope_axial" else "mixed",
        global_pool="token",
    ).eval()
    for p in theirs.parameters():  # away from the initialisation, so that every parameter counts
        p.data.add_(0.1 * torch.randn_like(p))
    path = folder / "eva.pth"
    torch.save(theirs.state_dict(), path)
    ours = ImageClassifier(
        **size, positions=positions, attention=AttentionConfig(qk_norm=qk_norm), init_from=str(path)
    ).model.eval()
    return theirs, ours


@pytest.mark.parametrize("positions", ["rope_axial", "rope_mixed"])
@pytest.mark.parametrize("qk_norm", [None, "layernorm"])
def test_rope_vit_equals_timm_eva_with_its_weights(positions, qk_norm, tmp_path):
    theirs, ours = _rope_pair(positions, qk_norm, tmp_path)
    assert ours.pos_embed is None and ("rope.freqs" in ours.no_weight_decay()) == (positions == "rope_mixed")
    images = torch.randn(2, 1, 20, 20)
    torch.testing.assert_close(ours(images), theirs(images), atol=1e-5, rtol=1e-5)


def test_relpos_vit_has_a_table_per_layer_with_class_token_entries():
    torch.manual_seed(0)
    vit = VisionTransformer(
        img_size=12, patch_size=4, in_chans=1, num_classes=2, embed_dim=12, depth=2, num_heads=3, positions="relpos"
    ).eval()
    tables = [n for n, _ in vit.named_parameters() if "relative_position_bias_table" in n]
    assert tables == [f"rel_pos_bias.{i}.relative_position_bias_table" for i in range(2)]
    assert vit.rel_pos_bias[0].relative_position_bias_table.shape == (5 * 5 + 3, 3)
    images = torch.randn(2, 1, 12, 12)
    before = vit(images)
    with torch.no_grad():
        vit.rel_pos_bias[1].relative_position_bias_table[-1] += 1.0  # class token to class token, layer 1
    assert not torch.allclose(vit(images), before)
    _, no_decay = param_groups(vit, 0.05, vit.no_weight_decay())
    assert id(vit.rel_pos_bias[0].relative_position_bias_table) in {id(p) for p in no_decay["params"]}


def test_vit_positions_that_make_no_sense_are_refused_with_the_key():
    size = dict(img_size=8, patch_size=4, in_chans=1, num_classes=2, depth=1)
    with pytest.raises(ValueError, match="model.positions='alibi' is not known for the ViT; choose one of learned"):
        VisionTransformer(**size, embed_dim=8, num_heads=2, positions="alibi")
    with pytest.raises(ValueError, match=r"model.positions=rope_mixed needs a head size divisible by 4, .* = 6"):
        VisionTransformer(**size, embed_dim=12, num_heads=2, positions="rope_mixed")
