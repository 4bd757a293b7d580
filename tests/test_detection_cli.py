"""The real `attnlab` CLI on a tiny generated shapes dataset: fit, test and predict, bad data and bad options
as one-line errors, and the detector's options as `attnlab` parses them (flat, with the network's defaults)."""

import csv
import dataclasses
import inspect
import json

import pytest
import yaml
from conftest import config_args, tiny_detector
from jsonargparse import ArgumentParser, Namespace

from models.detection.detr import DETR, build_detr
from models.detection.module import ObjectDetector

SHAPES = "configs/detection/shapes.yaml"
TINY = tiny_detector(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=2, dim_feedforward=32)


@pytest.mark.slow
def test_fit_test_predict_on_tiny_shapes(attnlab, tmp_path):
    common = config_args(
        SHAPES,
        tmp_path / "run",
        f"--data.data_dir={tmp_path / 'data'}",
        "--data.num_train=8",
        "--data.num_val=4",
        "--data.num_test=3",
        "--data.batch_size=4",
    )
    code, out, err = attnlab(
        "fit",
        *common,
        "--trainer.max_epochs=2",
        "--trainer.check_val_every_n_epoch=1",
        "--trainer.callbacks.num_images=2",
    )
    assert code == 0, err
    assert "attnlab: best val/AP50=" in out
    version = tmp_path / "run" / "lightning_logs" / "version_0"
    rows = [r for r in csv.DictReader((version / "metrics.csv").open()) if r.get("val/AP50")]
    assert len(rows) == 2 and all(0 <= float(r["val/AP50"]) <= 1 for r in rows) and all(r["val/AP_large"] for r in rows)
    assert len(list((version / "val_images").glob("epoch*_image*.png"))) == 4  # 2 images x 2 evaluations
    hparams = yaml.safe_load((version / "hparams.yaml").read_text())
    assert hparams["num_classes"] == 3  # linked from the DataModule

    code, out, err = attnlab("test", *common, "--ckpt_path", "best")
    assert code == 0, err
    assert "test/AP50" in out and "Average Precision  (AP) @[ IoU=0.50 " in out

    code, out, err = attnlab("predict", *common, "--ckpt_path", "last")
    assert code == 0, err
    results = json.loads((tmp_path / "run" / "predictions" / "results.json").read_text())
    assert len(results) == 3 * 10  # every query of the 3 test images, as COCO evaluation expects
    assert {r["category_id"] for r in results} <= {1, 2, 3} and {r["image_id"] for r in results} == {1, 2, 3}
    assert all(len(r["bbox"]) == 4 and 0 <= r["score"] <= 1 for r in results)
    assert len(list((tmp_path / "run" / "predictions" / "images").glob("*.png"))) == 3


def test_a_file_that_is_not_coco_is_a_one_line_error(attnlab, tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "labels.json").write_text(json.dumps({"images": [], "labels": []}))
    config = tmp_path / "coco.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"class_path": "models.detection.ObjectDetector"},
                "data": {
                    "class_path": "datamodules.detection.CocoDataModule",
                    "init_args": {"images": str(tmp_path / "images"), "annotations": str(tmp_path / "labels.json")},
                },
            }
        )
    )
    code, _, err = attnlab("fit", "--config", str(config), "--trainer.fast_dev_run=true")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert len(errors) == 1 and "labels.json: not a COCO instances file" in errors[0]


def test_print_config_shows_the_networks_keys_flat(attnlab):
    code, out, _ = attnlab("fit", "--config", SHAPES, "--print_config")
    assert code == 0
    options = yaml.safe_load(out)["model"]["init_args"]
    # the config's values, DETR's defaults and the loss's, each under model.init_args
    expected = {"backbone_out_index": 2, "d_model": 64, "dn_number": 0, "query_type": "vanilla", "cost_bbox": 5.0}
    assert {k: options[k] for k in expected} == expected


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "--model.init_args.d_modle=64",
            "model: 'd_modle' is not an option of models.detection.ObjectDetector; did you mean 'd_model'?",
        ),
        (
            "--model.init_args.backbone_norm=gn",
            "model.init_args.backbone_norm: expected one of 'frozen_bn', 'bn'. Got value: gn",
        ),
        ("--model.init_args.d_model=63", "model.d_model=63 must be even: half the channels encode y, half x"),
    ],
)
def test_a_bad_detector_option_is_one_line(attnlab, tmp_path, override, expected):
    code, _, err = attnlab("fit", *config_args(SHAPES, tmp_path, override))
    assert code == 2 and [line for line in err.splitlines() if line.startswith("attnlab: error:")] == [
        f"attnlab: error: {expected}"
    ], err


def test_the_detector_takes_the_networks_options_with_the_networks_defaults():
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ObjectDetector)
    defaults = parser.get_defaults()
    for network, built_there in ((build_detr, "detr"), (DETR, "backbone")):  # model.init_args.<name>
        for name, p in inspect.signature(network).parameters.items():
            if name != built_there:
                default = vars(defaults[name]) if isinstance(defaults[name], Namespace) else defaults[name]
                expected = dataclasses.asdict(p.default) if dataclasses.is_dataclass(p.default) else p.default
                assert default == expected, name  # a block (the attention's) by its fields
    built = ObjectDetector(**TINY)
    assert TINY.items() <= dict(built.hparams).items()  # recorded, so a checkpoint rebuilds the same network
    rebuilt = ObjectDetector(**built.hparams)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in built.state_dict().items()}
    assert len(built.criterion.weight_dict) == 2 * 3  # the last decoder layer's losses and one auxiliary layer's


def test_trunk_learning_rate_zero_freezes_the_trunk():
    frozen = ObjectDetector(lr_backbone=0, **TINY).model
    assert not any(p.requires_grad for p in frozen.backbone.parameters())
    assert all(p.requires_grad for n, p in frozen.named_parameters() if not n.startswith("backbone."))
    assert all(p.requires_grad for p in ObjectDetector(lr_backbone=1e-5, **TINY).model.backbone.parameters())
