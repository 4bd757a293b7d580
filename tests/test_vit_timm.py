"""timm's ViTs by name (`models.vision.timm_names`): ``model.init_from: timm:NAME[=FILE]`` reads the architecture from timm's
registry and gives timm's logits; a setting that contradicts timm's is refused in one line naming the key.

The oracle is timm: its model of each name, built with random weights, whose state dict attnlab loads by name.
Two blocks instead of the registry's 12 keep the tests short: timm's ``create_model`` is given ``depth=2`` for the
oracle and for attnlab's reading of the registry alike; every other setting is the name's own."""

import functools
import logging
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
import yaml
from safetensors.torch import save_file
from torch import nn

import models.vision.timm_names
from models.vision.module import NETWORK_DEFAULTS, ImageClassifier
from models.vision.pretrained import load_pretrained, read_init_from
from models.vision.timm_names import _mlp_ratio, fill_from_timm
from models.vision.vit import VisionTransformer

ROOT = Path(__file__).resolve().parents[1]
DEPTH = 2


@pytest.fixture
def two_blocks(monkeypatch):
    """attnlab reads timm's registry for two-block models (the oracle's depth)."""
    monkeypatch.setattr(models.vision.timm_names, "create_model", functools.partial(timm.create_model, depth=DEPTH))


def random_timm(name: str) -> nn.Module:
    """timm's model ``name`` with two blocks and random weights at a scale that keeps activations of order one, and
    LayerScale's gammas at 1: at timm's 1e-5 every block is nearly the identity, and a wrong head count or RoPE
    would hide. The mixed RoPE's learned frequencies keep timm's start."""
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, depth=DEPTH, num_classes=1000).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("gamma", "gamma_1", "gamma_2")):
                p.fill_(1.0)
            elif key.endswith("weight") and p.ndim > 1:
                p.normal_(0.0, p[0].numel() ** -0.5)  # fan-in
            elif key.endswith("weight"):
                p.normal_(1.0, 0.1)  # norms
            elif key.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "rope" not in key:
                p.normal_(0.0, 1.0)  # class and register tokens, learned positions
    return model


# name, image size: timm's own for each (the data's size is linked to the model; the RoPE grid of
# vit_base_patch16_rope_reg1_gap_256 agrees with timm's at 256 px only)
ARCHITECTURES = [
    ("vit_small_patch16_rope_mixed_224", 224),
    pytest.param("vit_base_patch16_rope_reg1_gap_256", 256, marks=pytest.mark.slow),  # 2-3 s each
    ("vit_small_patch14_reg4_dinov2", 518),
    pytest.param("vit_base_patch16_224", 224, marks=pytest.mark.slow),
    ("vit_medium_patch16_gap_256", 256),  # the mean of the finally normed tokens
]


@pytest.mark.parametrize("name,img_size", ARCHITECTURES)
def test_timm_models_load_by_name_with_timms_logits(two_blocks, tmp_path, name, img_size):
    theirs = random_timm(name)
    path = tmp_path / "timm.safetensors"
    save_file(theirs.state_dict(), str(path))
    network = NETWORK_DEFAULTS | dict(img_size=img_size)  # every setting, defaults too, as the CLI gives them
    module = ImageClassifier(**network, init_from=f"timm:{name}={path}")
    images = torch.randn(1, 3, img_size, img_size)
    with torch.no_grad():
        expected, got = theirs(images), module.model.eval()(images)
    scale = expected.abs().max()
    assert expected.std() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)
    assert module.hparams.depth == DEPTH and module.hparams.num_heads == theirs.blocks[0].attn.num_heads


@pytest.mark.parametrize(
    "name,given,message",
    [
        (
            "vit_base_patch16_rope_reg1_gap_256",
            dict(rope_theta=100.0),
            "model.rope_theta=100.0 contradicts timm's vit_base_patch16_rope_reg1_gap_256 (rope_theta=10000.0); "
            "remove it or set 10000.0",
        ),
        (
            "vit_base_patch16_rope_reg1_gap_256",
            dict(num_heads=6),
            "model.num_heads=6 contradicts timm's vit_base_patch16_rope_reg1_gap_256 (num_heads=12); remove it or set 12",
        ),
        (
            "vit_small_patch16_rope_224",
            dict(rope_grid_indexing="ij"),
            "model.rope_grid_indexing=ij contradicts timm's vit_small_patch16_rope_224 (rope_grid_indexing=xy); "
            "remove it or set xy",
        ),
        (
            "vit_small_patch14_reg4_dinov2",
            dict(register_tokens=2, patch_size=8, init_values=None),
            "model.patch_size=8, model.register_tokens=2 contradict timm's vit_small_patch14_reg4_dinov2 "
            "(patch_size=14, register_tokens=4); remove them or set these",
        ),
        (  # a written value equal to ViT-B/16's (12 heads) is a setting, not "unset": refused like any other
            "vit_small_patch16_rope_224",
            dict(num_heads=12, embed_dim=768),
            "model.embed_dim=768, model.num_heads=12 contradict timm's vit_small_patch16_rope_224 "
            "(embed_dim=384, num_heads=6); remove them or set these",
        ),
    ],
    ids=["rope_theta", "num_heads", "rope_grid_indexing", "two keys", "equal to ViT-B/16's"],
)
def test_a_setting_that_contradicts_timms_is_refused_in_one_line(name, given, message):
    with pytest.raises(ValueError) as error:
        ImageClassifier(**given, init_from=f"timm:{name}=never_read.safetensors")
    assert str(error.value) == message


def test_settings_left_at_attnlabs_defaults_take_timms():
    """The issue's silent row: rope_grid_indexing=xy (our default) for a model of timm's ij grid; and the rest."""
    network = fill_from_timm("timm:vit_base_patch16_rope_reg1_gap_256", dict(NETWORK_DEFAULTS), NETWORK_DEFAULTS)
    assert {k: network[k] for k in ("positions", "rope_theta", "rope_grid_indexing", "num_heads")} == dict(
        positions="rope_axial", rope_theta=10000.0, rope_grid_indexing="ij", num_heads=12
    )
    assert (network["register_tokens"], network["class_token"], network["global_pool"]) == (1, False, "avg")
    assert network["init_values"] == 1e-5 and network["img_size"] == NETWORK_DEFAULTS["img_size"]  # the data's


@pytest.mark.parametrize("hidden,width", [(6144, 1408), (1414, 1408), (230, 224)])
def test_the_mlp_ratio_read_from_timm_gives_back_its_hidden_width(hidden, width):
    """timm's hidden width is int(width · ratio) of its own ratio; ours from hidden / width, which rounds below
    the hidden width for some widths (1408: EVA-giant's)."""
    mlp = VisionTransformer(embed_dim=width, num_heads=1, depth=1, mlp_ratio=_mlp_ratio(hidden, width))
    assert mlp.encoder.layers[0].linear1.out_features == hidden


@pytest.mark.parametrize(
    "init_from,message",
    [
        ("timm:vit_smal_patch16_224", "timm knows no model vit_smal_patch16_224; did you mean vit_small_patch16_224?"),
        ("timm:vit_small_patch16_224.in1k", "timm's vit_small_patch16_224 has no pretrained tag 'in1k'; its tags: "),
        ("timm:resnet18", "attnlab's ViT lacks what timm's model uses: the class ResNet (attnlab reads timm's"),
        ("timm:vit_base_patch16_clip_224", "attnlab's ViT lacks what timm's model uses: norm_pre (a norm before"),
        ("timm:eva02_tiny_patch14_224", "learned positions and RoPE together (EVA-02)"),
    ],
    ids=["unknown name", "unknown tag", "not a ViT", "norm_pre", "EVA-02"],
)
def test_names_and_models_attnlab_cannot_read_are_refused_in_one_line(init_from, message):
    with pytest.raises(ValueError) as error:
        fill_from_timm(init_from, {}, NETWORK_DEFAULTS)
    assert str(error.value).startswith(f"model.init_from={init_from}: ") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_rope_grid_other_than_timms_reference_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="models.vision.timm_names"):
        fill_from_timm("timm:vit_base_patch16_rope_reg1_gap_256", dict(img_size=224), NETWORK_DEFAULTS)
    assert "timm scales its RoPE positions to a 16x16 patch grid (ref_feat_shape)" in caplog.text
    assert "at this 14x14 grid (224 px) the rotations differ from timm's; they agree at 256 px" in caplog.text


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline, whose endpoint refuses connections should a test go online."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    return tmp_path / "hub-cache"


def test_timms_hub_weights_of_a_name_are_read_from_the_cache_offline(hub, two_blocks):
    """``timm:NAME``: the hub repository of timm's default tag, from huggingface_hub's cache (where timm keeps it)."""
    repository = hub / f"models--{timm.models.get_pretrained_cfg('vit_tiny_patch16_224').hf_hub_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    snapshot = repository / "snapshots" / commit
    snapshot.mkdir(parents=True)
    theirs = random_timm("vit_tiny_patch16_224")
    save_file(theirs.state_dict(), str(snapshot / "model.safetensors"))
    ours = ImageClassifier(init_from="timm:vit_tiny_patch16_224").model.eval()
    images = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(images), theirs(images), rtol=1e-4, atol=1e-4)


def test_timms_hub_weights_absent_offline_name_the_folder_form(hub):
    with pytest.raises(ValueError) as error:
        read_init_from("timm:vit_small_patch16_224")
    message = str(error.value)
    assert message.startswith("model.init_from=timm:vit_small_patch16_224=timm/vit_small_patch16_224.augreg_in21k")
    assert "HF_HUB_OFFLINE=1" in message and "then model.init_from=timm:vit_small_patch16_224=DIR" in message


def test_the_timm_finetune_config_agrees_with_timms_registry(two_blocks, tmp_path):
    """configs/vision/timm_finetune.yaml's model, with a local file of timm's weights for its name, and the data's
    facts (FashionMNIST at 224 px: one channel, ten classes)."""
    config = yaml.safe_load((ROOT / "configs/vision/timm_finetune.yaml").read_text())["model"]["init_args"]
    name = config["init_from"].removeprefix("timm:").partition("=")[0]
    path = tmp_path / "timm.safetensors"
    save_file(random_timm(name).state_dict(), str(path))
    module = ImageClassifier(**config | dict(init_from=f"timm:{name}={path}", img_size=224, in_chans=1, num_classes=10))
    assert (module.hparams.embed_dim, module.hparams.num_heads, module.hparams.patch_size) == (384, 6, 16)
    assert module.model(torch.randn(2, 1, 224, 224)).shape == (2, 10)


SMALL = dict(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=16, depth=1, num_heads=2)


@pytest.mark.parametrize(
    "source,target,message",
    [
        (
            dict(global_pool="avg", fc_norm=False),
            dict(global_pool="avg"),
            "x.pth was trained with global_pool='token'; set model.global_pool=token, or model.fc_norm=false for "
            "the mean of the finally normed tokens",
        ),
        (dict(global_pool="avg"), dict(global_pool="avg", fc_norm=False), "x.pth has a norm after pooling (fc_norm); "),
        ({}, dict(fc_norm=True), "x.pth has a final norm over the tokens (encoder.norm); set model.fc_norm=null"),
    ],
    ids=["gap into avg", "avg into gap", "token into token with fc_norm"],
)
def test_a_checkpoint_normed_elsewhere_is_refused_naming_fc_norm(source, target, message):
    """timm's ``*_gap_*`` ViTs average the finally normed tokens (fc_norm=false), its "avg" ViTs norm the mean."""
    with pytest.raises(ValueError) as error:
        load_pretrained(
            VisionTransformer(**SMALL, **target), VisionTransformer(**SMALL, **source).state_dict(), "x.pth"
        )
    assert str(error.value).startswith(message)
