"""Weight import and transfer learning: timm parity, position resampling, head replacement,
init_from our own checkpoints, frozen backbone, layer-wise learning-rate decay."""

import logging

import pytest
import timm
import torch
from safetensors.torch import save_file

from models.vision.module import ImageClassifier
from models.vision.pretrained import load_pretrained, load_timm_state_dict, read_checkpoint
from models.vision.vit import VisionTransformer


def _randomised(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random (norms included), so a swapped or untouched weight shows in the logits."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == model.embed_dim else 0.0))
    return model.eval()


# a small ViT in the arguments that timm's VisionTransformer and ours share
SMALL_VIT = dict(img_size=32, patch_size=4, in_chans=1, num_classes=7, embed_dim=48, depth=2, num_heads=3)


def _small_timm(**kwargs) -> timm.models.VisionTransformer:
    return _randomised(timm.models.VisionTransformer(**SMALL_VIT | kwargs))


def test_timm_vit_tiny_logits_agree_after_loading_its_file(tmp_path):
    theirs = _randomised(timm.create_model("vit_tiny_patch16_224", pretrained=False))
    path = tmp_path / "vit_tiny.pth"
    torch.save(theirs.state_dict(), path)
    ours = VisionTransformer(
        img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=192, depth=12, num_heads=3
    ).eval()
    load_pretrained(ours, read_checkpoint(path))
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected, got = theirs(x), ours(x)
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("global_pool", ["token", "avg"])
def test_small_timm_vit_agrees_for_both_poolings_and_from_safetensors(tmp_path, global_pool):
    theirs = _small_timm(global_pool=global_pool)
    path = tmp_path / "small.safetensors"
    save_file(theirs.state_dict(), str(path))
    ours = VisionTransformer(**SMALL_VIT, global_pool=global_pool).eval()
    load_pretrained(ours, read_checkpoint(path))
    x = torch.randn(3, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("registers", [{}, dict(reg_tokens=2, no_embed_class=True)])
def test_positions_resampled_like_timm_at_a_new_image_size(registers):
    """timm's dynamic_img_size resamples its positions on the fly; ours are resampled once at load to the model's
    image size, or on the fly for images of another size (the class token's, if any, kept; registers have none)."""
    theirs = _small_timm(dynamic_img_size=True, **registers)
    x = torch.randn(2, 1, 48, 48)
    for img_size in (48, 32):
        ours = VisionTransformer(**SMALL_VIT | dict(img_size=img_size, register_tokens=registers.get("reg_tokens", 0)))
        load_timm_state_dict(ours.eval(), theirs.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


def _vit(img_size: int, patch_size: int = 4, num_classes: int = 10, **kwargs) -> VisionTransformer:
    return VisionTransformer(
        img_size=img_size,
        patch_size=patch_size,
        in_chans=1,
        num_classes=num_classes,
        embed_dim=16,
        depth=1,
        num_heads=2,
        **kwargs,
    )


def test_position_resampling_keeps_a_one_patch_grid_and_an_unchanged_grid_sane():
    one = _vit(img_size=4)  # a 1x1 patch grid: one patch position after the class token's
    big = _vit(img_size=12)  # 3x3
    load_pretrained(big, one.state_dict())
    pos, src = big.pos_embed[0].detach(), one.pos_embed[0].detach()
    torch.testing.assert_close(pos[0], src[0])  # the class token's position is not resampled
    torch.testing.assert_close(pos[1:], src[1].expand(9, -1))  # one position spread over the grid, unchanged
    same = _vit(img_size=12)
    load_pretrained(same, big.state_dict())
    torch.testing.assert_close(same.pos_embed, big.pos_embed, rtol=0, atol=0)


def test_head_is_reinitialised_and_logged_when_the_class_count_differs(caplog):
    source = _vit(img_size=8, num_classes=10)
    target = _vit(img_size=8, num_classes=3)
    with caplog.at_level(logging.WARNING, logger="models.vision.vit"):
        load_pretrained(target, source.state_dict(), "pretrained.pth")
    assert "pretrained.pth: its head has 10 classes, the model 3; the head is re-initialised" in caplog.text
    assert target.head.weight.shape == (3, 16)
    torch.testing.assert_close(target.patch_embed.proj.weight, source.patch_embed.proj.weight)
    torch.testing.assert_close(
        target.encoder.layers[0].self_attn.in_proj_weight, source.encoder.layers[0].self_attn.in_proj_weight
    )
    same = _vit(img_size=8, num_classes=10)
    load_pretrained(same, source.state_dict())
    torch.testing.assert_close(same.head.weight, source.head.weight)  # same classes: the head is kept


def test_rgb_weights_adapt_to_grayscale_by_summing_channels():
    rgb = VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=2, embed_dim=16, depth=1, num_heads=2)
    gray = _vit(img_size=8, num_classes=2)
    load_pretrained(gray, rgb.state_dict())
    torch.testing.assert_close(gray.patch_embed.proj.weight, rgb.patch_embed.proj.weight.sum(1, keepdim=True))


def test_rgb_weights_adapt_to_grayscale_in_the_first_stem_convolution():
    rgb = VisionTransformer(8, 1, 3, 2, 16, 1, 2, stem_channels=(4, 8))
    gray = VisionTransformer(8, 1, 1, 2, 16, 1, 2, stem_channels=(4, 8))
    load_pretrained(gray, rgb.state_dict())
    first = rgb.patch_embed.stem[0].conv.weight
    torch.testing.assert_close(gray.patch_embed.stem[0].conv.weight, first.sum(1, keepdim=True))
    torch.testing.assert_close(gray.patch_embed.proj.weight, rgb.patch_embed.proj.weight)  # reads the stem, unchanged


@pytest.mark.parametrize(
    "source,match",
    [
        (dict(global_pool="avg"), "trained with global_pool='avg' .* set model.global_pool=avg"),
        (
            dict(patch_size=1, stem_channels=(4,)),
            r"a convolutional stem of widths \[4\] .* set model.stem_channels=\[4\]",
        ),
        (
            dict(patch_size=2),
            r"does not fit this ViT: patch_embed.proj.weight is \(16, 1, 4, 4\) in the model and \(16, 1, 2, 2\) in the file",
        ),
    ],
)
def test_checkpoints_that_do_not_fit_are_refused_with_the_reason(source, match):
    with pytest.raises(ValueError, match=match):
        load_pretrained(_vit(img_size=8), _vit(img_size=8, **source).state_dict())


def test_learned_positions_into_a_vit_with_positions_in_attention_are_refused_naming_positions():
    with pytest.raises(ValueError) as err:
        load_pretrained(
            _vit(img_size=8, positions="rope_axial"), _vit(img_size=8).state_dict(), "model.init_from=x.pth"
        )
    message = str(err.value)
    assert "\n" not in message and message.startswith("model.init_from=x.pth has learned positions (pos_embed)")
    assert message.endswith("set model.positions=learned")


# timm's ViTs with LayerScale and registers, built small and random: VisionTransformer (DINOv2 with registers,
# DeiT-3's no_embed_class, class-token-free "gap" ViTs) and Eva (Naver's RoPE ViTs, timm's RoPE ViTs with registers)
SMALL_TIMM = dict(img_size=32, patch_size=4, in_chans=1, num_classes=7, embed_dim=48, depth=2, num_heads=3)
TIMM_WITH_LAYER_SCALE_AND_REGISTERS = [
    ("vit_small_patch14_reg4_dinov2", {}, dict(register_tokens=4, init_values=1e-5)),
    ("vit_base_patch16_224", dict(reg_tokens=3, init_values=0.1), dict(register_tokens=3, init_values=0.1)),
    (
        "vit_betwixt_patch16_reg4_gap_256",
        {},
        dict(register_tokens=4, init_values=1e-5, class_token=False, global_pool="avg"),
    ),
    ("vit_small_patch16_rope_mixed_224", {}, dict(positions="rope_mixed", init_values=1e-5)),
    ("vit_small_patch16_rope_224", {}, dict(positions="rope_axial", init_values=1e-5)),
    (
        "vit_betwixt_patch16_rope_reg4_gap_256",
        dict(ref_feat_shape=(8, 8)),  # the grid of these images, as (16, 16) is at 256 px
        dict(positions="rope_axial", rope_theta=10000.0, rope_grid_indexing="ij", register_tokens=4)
        | dict(init_values=1e-5, class_token=False, global_pool="avg"),
    ),
    (
        "vit_mediumd_patch16_rope_reg1_gap_256",  # Eva's attention without biases
        dict(ref_feat_shape=(8, 8)),
        dict(positions="rope_axial", rope_theta=10000.0, rope_grid_indexing="ij", register_tokens=1)
        | dict(init_values=1e-5, class_token=False, global_pool="avg"),
    ),
]


@pytest.mark.parametrize(
    "name,theirs,ours", TIMM_WITH_LAYER_SCALE_AND_REGISTERS, ids=[t[0] for t in TIMM_WITH_LAYER_SCALE_AND_REGISTERS]
)
def test_timm_vits_with_layer_scale_and_registers_load_through_init_from_with_equal_logits(
    name, theirs, ours, tmp_path
):
    timm_model = _randomised(timm.create_model(name, pretrained=False, **SMALL_TIMM | theirs))
    path = tmp_path / "timm.safetensors"
    save_file(timm_model.state_dict(), str(path))
    model = ImageClassifier(**SMALL_TIMM, **ours, init_from=str(path)).model.eval()
    images = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        expected = timm_model(images)
        assert expected.std() > 0.1
        torch.testing.assert_close(model(images), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "theirs,ours,match",
    [
        (dict(init_values=1e-5), {}, r"has LayerScale \(ls1.gamma\); set model.init_values to a number"),
        ({}, dict(init_values=1e-5), r"lacks LayerScale \(ls1.gamma\); set model.init_values=null"),
        (dict(reg_tokens=4), {}, r"has 4 registers \(reg_token\), the model 0; set model.register_tokens=4"),
        (
            dict(class_token=False, global_pool="avg"),
            dict(global_pool="avg"),
            r"lacks a class token \(cls_token\); set model.class_token=false",
        ),
    ],
)
def test_timm_vits_of_another_layer_scale_register_count_or_class_token_are_refused_naming_the_key(theirs, ours, match):
    with pytest.raises(ValueError, match=match) as error:
        load_timm_state_dict(VisionTransformer(**SMALL_VIT | ours), _small_timm(**theirs).state_dict())
    assert "\n" not in str(error.value)


def test_timm_features_we_lack_are_named():
    state = _small_timm(pre_norm=True).state_dict()  # CLIP's norm before the blocks
    with pytest.raises(ValueError, match=r"the model lacks \['norm_pre.weight', 'norm_pre.bias'\]"):
        load_timm_state_dict(VisionTransformer(**SMALL_VIT), state)


def test_timm_positions_that_fit_no_layout_are_refused_naming_the_file():
    state = _small_timm(reg_tokens=2).state_dict()
    state["pos_embed"] = state["pos_embed"][:, :-1]  # 3 prefix positions and 63 patches
    with pytest.raises(ValueError, match=r"^x.pth: pos_embed has 66 positions, not a square patch grid after 3 class"):
        load_timm_state_dict(VisionTransformer(**SMALL_VIT | dict(register_tokens=2)), state, "x.pth")


def test_missing_weights_file_names_the_key():
    with pytest.raises(FileNotFoundError, match="model.init_from: /no/such.pth does not exist"):
        read_checkpoint("/no/such.pth")


def _classifier(**kwargs) -> ImageClassifier:
    args = dict(num_classes=10, in_chans=1, img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2) | kwargs
    return ImageClassifier(**args)


def test_init_from_a_lightning_checkpoint_then_freeze_the_backbone(tmp_path):
    source = _classifier()
    path = tmp_path / "best.ckpt"
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, path)
    tuned = _classifier(num_classes=4, init_from=str(path), freeze_backbone=True)
    torch.testing.assert_close(tuned.model.pos_embed, source.model.pos_embed)
    trainable = {n for n, p in tuned.named_parameters() if p.requires_grad}
    assert trainable == {"model.head.weight", "model.head.bias"}


def test_layer_decay_scales_learning_rates_from_the_head_down():
    module = _classifier(layer_decay=0.5, lr=1.0)
    module.trainer = type(
        "T",
        (),
        {
            "train_dataloader": [],
            "num_training_batches": 10,
            "accumulate_grad_batches": 1,
            "max_steps": -1,
            "max_epochs": 1,
        },
    )()
    groups = module.configure_optimizers()["optimizer"].param_groups
    lr_of = {id(p): g["initial_lr"] for g in groups for p in g["params"]}  # before warmup scales it
    named = dict(module.model.named_parameters())
    # timm's grouping: embeddings, block 0, block 1 with the final norm, head -> 0.5 ** (3, 2, 1, 0)
    assert lr_of[id(named["pos_embed"])] == 0.125
    assert lr_of[id(named["encoder.layers.0.linear1.weight"])] == 0.25
    assert lr_of[id(named["encoder.layers.1.linear1.weight"])] == lr_of[id(named["encoder.norm.weight"])] == 0.5
    assert lr_of[id(named["head.weight"])] == 1.0
    decay_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert (
        decay_of[id(named["pos_embed"])] == decay_of[id(named["head.bias"])] == 0.0 < decay_of[id(named["head.weight"])]
    )


def test_layer_decay_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"model.layer_decay=1.5 must be in \(0, 1\]"):
        _classifier(layer_decay=1.5)


def test_a_checkpoint_without_the_models_stem_is_refused_naming_stem_channels():
    with pytest.raises(
        ValueError, match=r"widths \[\] \(\[\]: none\), the model \[4, 8\]; set model.stem_channels=\[\]"
    ):
        load_pretrained(_vit(img_size=8, patch_size=1, stem_channels=(4, 8)), _vit(img_size=8).state_dict())
