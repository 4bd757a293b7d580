"""Names from before the rooms keep working: every class path the configs of 033b175 named imports as the class of
today and is printed by its one public name; a config with old class paths trains; a checkpoint and run folders
written before the move restore and compare (tests/data/before_rooms, written by 033b175)."""

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import TINY_VIT, config_args
from jsonargparse._util import get_import_path, import_object

from experiments.renames import MOVED, current, renamed

BEFORE = Path(__file__).parent / "data" / "before_rooms"
DIGITS = "configs/vision/digits.yaml"

ONE_BATCH = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1")

# every class path in configs/ and docs/examples/ at 033b175 (`git grep`), with the name configs give it now
OLD_TO_NEW = {
    "datamodules.coco.CocoDataModule": "datamodules.detection.CocoDataModule",
    "datamodules.random_images.RandomImagesDataModule": "datamodules.vision.RandomImagesDataModule",
    "datamodules.synthetic.ShapesDataModule": "datamodules.detection.ShapesDataModule",
    "datamodules.text.ParallelTextDataModule": "datamodules.text.ParallelTextDataModule",
    "datamodules.text.TextCorpusDataModule": "datamodules.text.TextCorpusDataModule",
    "datamodules.vision.DigitsDataModule": "datamodules.vision.DigitsDataModule",
    "datamodules.vision.TorchvisionDataModule": "datamodules.vision.TorchvisionDataModule",
    "datamodules.voc.VocDataModule": "datamodules.detection.VocDataModule",
    "experiments.attention_maps.AttentionMapLogger": "experiments.callbacks.AttentionMapLogger",
    "experiments.detection_callbacks.DetectionImages": "experiments.callbacks.DetectionImages",
    "experiments.detection_callbacks.DetectionWriter": "experiments.callbacks.DetectionWriter",
    "experiments.text_callbacks.LanguageModelSamples": "experiments.callbacks.LanguageModelSamples",
    "experiments.text_callbacks.TranslationSamples": "experiments.callbacks.TranslationSamples",
    "experiments.interrupts.LastCheckpoint": "experiments.callbacks.LastCheckpoint",
    "models.detr_module.ObjectDetector": "models.detection.ObjectDetector",
    "models.text_module.LanguageModelModule": "models.text.LanguageModelModule",
    "models.text_module.TranslationModule": "models.text.TranslationModule",
    "models.vit_module.ImageClassifier": "models.vision.ImageClassifier",
    "models.attend.ClippedSoftmax": "models.core.attend.ClippedSoftmax",  # a sweep grid's variant
    "models.attend.SigmoidAttention": "models.core.attend.SigmoidAttention",
}


@pytest.mark.parametrize("old, new", OLD_TO_NEW.items())
def test_an_old_class_path_imports_the_class_of_today_and_prints_as_its_one_name(old, new):
    assert current(old) == new
    cls = import_object(new)  # as jsonargparse resolves a config's class_path
    assert import_object(old) is cls
    assert get_import_path(cls) == new  # what --print_config and a run's config.yaml write


def test_every_moved_module_has_a_home_that_imports():
    for old, homes in MOVED.items():
        for home in homes:
            assert import_object(f"{home}.__name__") == home, old


def test_a_run_folders_json_reads_with_todays_names():
    summary = json.loads((BEFORE / "translation" / "summary.json").read_text())
    assert summary["model"] == "models.text_module.TranslationModule"  # as 033b175 wrote it
    assert renamed(summary)["model"] == "models.text.TranslationModule"
    assert renamed({"a": ["models.attend.ClippedSoftmax", 3, "/tmp/x.y"]}) == {
        "a": ["models.core.attend.ClippedSoftmax", 3, "/tmp/x.y"]
    }


def test_a_config_with_old_class_paths_trains_and_is_saved_with_todays(attnlab, tmp_path):
    config = yaml.safe_load(Path(DIGITS).read_text())
    config["model"]["class_path"] = "models.vit_module.ImageClassifier"
    callbacks = config["trainer"]["callbacks"]
    callbacks.append({"class_path": "experiments.interrupts.LastCheckpoint"})
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(config))
    code, _, err = attnlab("fit", *config_args(str(old), tmp_path / "run"), *ONE_BATCH, *TINY_VIT)
    assert code == 0, err
    saved = (tmp_path / "run" / "lightning_logs" / "version_0" / "config.yaml").read_text()
    assert "class_path: models.vision.ImageClassifier" in saved and "vit_module" not in saved
    assert "class_path: experiments.callbacks.LastCheckpoint" in saved


def test_a_checkpoint_and_run_folders_from_before_the_move_restore_and_compare(attnlab, tmp_path):
    code, out, err = attnlab(
        "validate",
        *config_args(DIGITS, tmp_path / "now"),
        *TINY_VIT,
        "--trainer.limit_val_batches=1",
        "--ckpt_path",
        str(BEFORE / "vit" / "checkpoints" / "last.ckpt"),
    )
    assert code == 0, err
    assert "val/acc" in out
    for name in ("vit", "lm"):  # run folders as `attnlab compare` finds them: <experiment>/lightning_logs/version_N
        shutil.copytree(BEFORE / name, tmp_path / "runs" / name / "lightning_logs" / "version_0")
    code, out, err = attnlab("compare", str(tmp_path / "runs"), "--out", str(tmp_path / "report"))
    assert code == 0, err
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert set(rows) == {"vit", "lm"} and {rows["vit"]["modality"], rows["lm"]["modality"]} == {"vision", "text"}
