"""Fine-tuning DETR from pretrained detectors (`models.detection.pretrained`) and pretrained trunks (`models.detection.backbone`):
Hugging Face DETR against its own outputs, facebookresearch/detr and attnlab checkpoints, re-initialised heads,
and every bad input named in one line. Nothing downloads: the hub is switched off and its cache is empty."""

import argparse
import logging
from pathlib import Path

import huggingface_hub.constants
import pytest
import timm
import torch
import yaml
from builders import SMALL
from jsonargparse import ArgumentParser
from transformers import DetrConfig, DetrForObjectDetection, ResNetConfig

from models.detection.backbone import Backbone
from models.detection.detr import DETR
from models.detection.module import ObjectDetector

HF_SMALL = dict(
    d_model=32,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_layers=2,
    decoder_layers=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    num_queries=5,
    num_labels=3,
    use_pretrained_backbone=False,
)
NARROW = dict(
    layers=[1, 1, 1, 1], channels=[8, 16, 32, 64]
)  # a 1-block-per-stage ResNet-18, as HF's ResNetConfig below
HF_BACKBONES = {
    "timm": (dict(use_timm_backbone=True, backbone="resnet18"), {}),
    "hf_resnet": (
        dict(
            use_timm_backbone=False,
            backbone_config=ResNetConfig(
                embedding_size=64,
                hidden_sizes=[8, 16, 32, 64],
                depths=[1, 1, 1, 1],
                layer_type="basic",
                out_features=["stage4"],
            ),
        ),
        NARROW,
    ),
}


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    """No test here may reach the network, whatever the machine: the hub is offline and its cache empty."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))


def detector(init_from=None, num_classes=3, num_queries=5, backbone_kwargs=None, **kwargs) -> ObjectDetector:
    return ObjectDetector(
        num_classes=num_classes,
        backbone="resnet18",
        backbone_out_index=4,
        backbone_kwargs=backbone_kwargs,
        num_queries=num_queries,
        init_from=init_from,
        **{**SMALL, **kwargs},
    ).eval()


def padded_batch():
    """Two images of different sizes padded to (64, 80): pixels, our mask (True at padding), HF's pixel_mask (1 = image)."""
    images = torch.randn(2, 3, 64, 80, generator=torch.Generator().manual_seed(0))
    valid = torch.zeros(2, 64, 80, dtype=torch.long)
    valid[0], valid[1, :48, :56] = 1, 1
    images[1] *= valid[1]
    return images, valid == 0, valid


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Large random weights (2 / sqrt(fan-in)) and BatchNorm statistics. A fresh HF DETR's small weights leave the
    attention near uniform: packing k, q, v instead of q, k, v changed its logits by 1.5e-4 (the test's atol is 1e-4),
    with these by 0.07."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=g)
        t.copy_(
            noise.abs() + 0.5
            if name.endswith("running_var")
            else noise * 2 / t[0].numel() ** 0.5
            if t.dim() > 1
            else noise * 0.5
        )


def official_layout(model: DETR) -> dict:
    """What facebookresearch/detr's main.py saves: our keys with its backbone prefix, and its argparse args."""
    state = {
        k.replace("backbone.body.", "backbone.0.body.", 1): v
        for k, v in model.state_dict().items()
        if "num_batches" not in k
    }
    return {
        "model": state,
        "args": argparse.Namespace(lr=1e-4, backbone="resnet18", num_queries=5, coco_path="/data/coco"),
    }


@pytest.mark.parametrize("backbone", HF_BACKBONES, ids=str)
@torch.no_grad()
def test_a_hugging_face_detr_folder_gives_its_detections(tmp_path, backbone):
    hf_backbone, ours = HF_BACKBONES[backbone]
    torch.manual_seed(0)
    hf = DetrForObjectDetection(DetrConfig(**HF_SMALL, **hf_backbone)).eval()
    randomise(hf)
    hf.save_pretrained(tmp_path / "hf-detr")
    images, mask, pixel_mask = padded_batch()
    expected = hf(pixel_values=images, pixel_mask=pixel_mask)
    out = detector(str(tmp_path / "hf-detr"), backbone_kwargs=ours)(images, mask)
    torch.testing.assert_close(out["pred_logits"], expected.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(out["pred_boxes"], expected.pred_boxes, atol=1e-4, rtol=0)
    assert not torch.allclose(out["pred_logits"][0], out["pred_logits"][1], atol=1e-3)  # the two images differ


def test_a_hugging_face_config_states_what_shapes_do_not(tmp_path):
    DetrForObjectDetection(DetrConfig(**HF_SMALL, use_timm_backbone=True, backbone="resnet18")).save_pretrained(
        tmp_path / "hf"
    )
    with pytest.raises(
        ValueError, match="has 4 heads \\(encoder_attention_heads in config.json\\), the model model.nhead=8"
    ):
        detector(str(tmp_path / "hf"), nhead=8)


@pytest.mark.parametrize("layout", ["official", "attnlab"])
@torch.no_grad()
def test_official_and_attnlab_checkpoints_load(tmp_path, layout):
    torch.manual_seed(0)
    source = detector()
    path = tmp_path / ("detr.pth" if layout == "official" else "best.ckpt")
    saved = (
        official_layout(source.model)
        if layout == "official"
        else {"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams), "epoch": 3}
    )  # holds criterion.* too
    torch.save(saved, path)
    torch.manual_seed(1)
    loaded = detector(str(path))
    images, mask, _ = padded_batch()
    expected, out = source(images, mask), loaded(images, mask)
    torch.testing.assert_close(out["pred_logits"], expected["pred_logits"])
    torch.testing.assert_close(out["pred_boxes"], expected["pred_boxes"])


def test_other_class_and_query_counts_re_initialise_the_head_and_queries(tmp_path, caplog):
    torch.manual_seed(0)
    source = detector().model  # 3 classes + no object, 5 queries
    torch.save(official_layout(source), tmp_path / "detr.pth")
    with caplog.at_level(logging.WARNING, logger="models.detection.pretrained"):
        model = detector(str(tmp_path / "detr.pth"), num_classes=6, num_queries=7).model
    (record,) = caplog.records
    assert (
        "class_embed re-initialised for 6 classes (the file has 3; its no-object row is kept, last)"
        in record.getMessage()
    )
    assert "7 object queries re-initialised (the file has 5)" in record.getMessage()
    assert model.class_embed.weight.shape == (7, 32) and model.query_embed.weight.shape == (7, 32)
    torch.testing.assert_close(model.class_embed.weight[-1], source.class_embed.weight[-1])  # no object stays last
    torch.testing.assert_close(model.class_embed.bias[-1], source.class_embed.bias[-1])
    assert not torch.allclose(model.class_embed.weight[:3], source.class_embed.weight[:3])
    assert not torch.allclose(model.query_embed.weight[:5], source.query_embed.weight)
    torch.testing.assert_close(model.input_proj.weight, source.input_proj.weight)
    torch.testing.assert_close(
        model.transformer.decoder.layers[1].multihead_attn.in_proj_weight,
        source.transformer.decoder.layers[1].multihead_attn.in_proj_weight,
    )


def test_a_two_stage_focal_checkpoint_fine_tunes_to_other_classes(tmp_path, caplog):
    """Shapes -> BCCD: both classifiers (decoder and encoder cells) get fresh rows for the new classes, with no
    no-object row under focal classes; everything else, the cells' box head included, comes from the file."""
    torch.manual_seed(0)
    source = detector(query_type="encoder", class_loss="focal")
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, tmp_path / "best.ckpt")
    with caplog.at_level(logging.WARNING, logger="models.detection.pretrained"):
        model = detector(str(tmp_path / "best.ckpt"), num_classes=2, query_type="encoder", class_loss="focal").model
    message = caplog.records[0].getMessage()
    assert "class_embed re-initialised for 2 classes (the file has 3)" in message
    assert "proposals.enc_class_embed re-initialised for 2 classes (the file has 3)" in message
    assert model.class_embed.weight.shape == model.proposals.enc_class_embed.weight.shape == (2, 32)
    assert not torch.allclose(model.class_embed.weight, source.model.class_embed.weight[:2])
    torch.testing.assert_close(
        model.proposals.enc_bbox_embed.layers[0].weight, source.model.proposals.enc_bbox_embed.layers[0].weight
    )


def test_a_checkpoint_of_another_architecture_names_the_first_tensor_that_differs(tmp_path):
    torch.save(official_layout(detector(dim_feedforward=48).model), tmp_path / "detr.pth")
    with pytest.raises(
        ValueError,
        match=f"model.init_from: {tmp_path / 'detr.pth'} does not fit this DETR: "
        "transformer.encoder.layers.0.linear1.weight is \\(64, 32\\) in the model and \\(48, 32\\) in the file",
    ):
        detector(str(tmp_path / "detr.pth"))
    torch.save(official_layout(detector(num_decoder_layers=3).model), tmp_path / "deeper.pth")
    with pytest.raises(
        ValueError,
        match=r"does not fit this DETR: the model lacks \['transformer.decoder.layers.2.self_attn.in_proj_weight', .*\(18 in all\)",
    ):
        detector(str(tmp_path / "deeper.pth"))


def test_bad_init_from_sources_are_named_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model.init_from: {tmp_path / 'missing.pth'} does not exist"):
        detector(str(tmp_path / "missing.pth"))
    with pytest.raises(
        ValueError, match="model.init_from=facebook/detr-resnet-50: not a local path, and offline .* --local-dir DIR"
    ):
        detector("facebook/detr-resnet-50")
    (tmp_path / "folder").mkdir()
    with pytest.raises(FileNotFoundError, match="is a folder without config.json"):
        detector(str(tmp_path / "folder"))


def test_a_checkpoint_holding_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return exec, (f"open({str(marker)!r}, 'w')",)

    torch.save({"model": {"class_embed.weight": torch.zeros(4, 32)}, "args": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(
        ValueError, match=f"model.init_from: {tmp_path / 'evil.pth'} was refused: it holds pickled code"
    ):
        detector(str(tmp_path / "evil.pth"))
    assert not marker.exists()


def test_backbone_pretrained_offline_names_the_local_file_setting():
    with pytest.raises(
        ValueError,
        match="model.backbone_pretrained=true: .* \\(offline\\); give a local file instead: model.backbone_weights=PATH",
    ):
        Backbone("resnet18", 4, "frozen_bn", 3, pretrained=True)


def test_backbone_weights_fill_the_trunk_from_a_local_timm_file(tmp_path):
    torch.manual_seed(0)
    resnet = timm.create_model("resnet18", pretrained=False)  # a whole classifier, fc included
    resnet.layer4[0].downsample[1].running_var.uniform_(0.5, 2.0)
    torch.save(resnet.state_dict(), tmp_path / "resnet18.pth")
    trunk = detector(backbone_weights=str(tmp_path / "resnet18.pth")).model.backbone.body
    torch.testing.assert_close(trunk.layer3[1].conv2.weight, resnet.layer3[1].conv2.weight)
    torch.testing.assert_close(trunk.layer4[0].downsample[1].running_var, resnet.layer4[0].downsample[1].running_var)


def test_the_finetune_config_is_the_papers_detr_r50():
    """The official detr-r50 checkpoint fills configs/detection/bccd_finetune.yaml whole (but the class head): its
    architecture is ObjectDetector's defaults, the paper's (pinned by test_detr.py::test_reference_defaults)."""
    config = yaml.safe_load((Path(__file__).parents[1] / "configs/detection/bccd_finetune.yaml").read_text())["model"][
        "init_args"
    ]
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ObjectDetector)  # its own defaults and, through **network, build_detr's and DETR's
    defaults = parser.get_defaults()
    for key in (
        "backbone",
        "backbone_out_index",
        "backbone_norm",
        "d_model",
        "nhead",
        "num_encoder_layers",
        "num_decoder_layers",
        "dim_feedforward",
        "num_queries",
        "attention",
        "backbone_kwargs",
    ):
        assert config.get(key, defaults[key]) == defaults[key], key
    assert config["init_from"] is None  # the user names the downloaded file; tests never download
