"""The real `attnlab` CLI on a tiny generated shapes dataset: fit, test and predict, and bad data as
one-line errors."""

import csv
import json

import pytest
import yaml

SHAPES = "configs/detection/shapes.yaml"


@pytest.mark.slow
def test_fit_test_predict_on_tiny_shapes(attnlab, tmp_path):
    common = (
        "--config",
        SHAPES,
        f"--trainer.default_root_dir={tmp_path / 'run'}",
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
                "model": {"class_path": "models.detr_module.ObjectDetector"},
                "data": {
                    "class_path": "datamodules.coco.CocoDataModule",
                    "init_args": {"images": str(tmp_path / "images"), "annotations": str(tmp_path / "labels.json")},
                },
            }
        )
    )
    code, _, err = attnlab("fit", "--config", str(config), "--trainer.fast_dev_run=true")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert len(errors) == 1 and "labels.json: not a COCO instances file" in errors[0]
