"""A newcomer's first hour without a surprise: a checkpoint of another model or other data is refused before
anything is restored or written; options are never abbreviated; a YAML error names file:line:column; a fit that
never validated says so, and `--ckpt_path best` then points at `last`; `--optimizer` is refused for models that
build their own. Every refusal is one `attnlab: error:` line with status 2."""

import contextlib
import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_DETR, TINY_VIT, config_args

from experiments.callbacks import PredictionWriter
from experiments.cli import main

DIGITS = "configs/vision/digits.yaml"
TOY = "configs/text/toy_en_de.yaml"
SHAPES = "configs/detection/shapes.yaml"
ONE_BATCH = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=1",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
)


def shapes_data(folder: Path) -> tuple[str, ...]:
    return (
        f"--data.init_args.data_dir={folder}",
        "--data.init_args.num_train=4",
        "--data.init_args.num_val=2",
        "--data.init_args.batch_size=2",
    )


def fitted(root: Path, *args: str) -> str:
    """`attnlab fit` in-process with ``args`` into ``root``; its stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        main(["fit", *args, f"--trainer.default_root_dir={root}"])
    return err.getvalue()


@pytest.fixture(scope="module")
def vit_run(tmp_path_factory) -> Path:
    """A digits ViT's run folder after one batch (8x8 images, 1 channel, 10 classes): best.ckpt and last.ckpt."""
    root = tmp_path_factory.mktemp("vit")
    fitted(root, "--config", DIGITS, *ONE_BATCH, *TINY_VIT)
    return root


@pytest.fixture(scope="module")
def detr_run(tmp_path_factory) -> tuple[Path, str]:
    """A tiny DETR's run folder after one epoch of shapes.yaml, which validates every second epoch (so it never
    did), and the fit's stderr."""
    root = tmp_path_factory.mktemp("detr")
    data = shapes_data(tmp_path_factory.mktemp("shapes"))
    err = fitted(root, "--config", SHAPES, *data, "--trainer.max_epochs=1", *TINY_DETR)
    return root, err


def checkpoint(root: Path, alias: str) -> Path:
    return root / "lightning_logs" / "version_0" / "checkpoints" / f"{alias}.ckpt"


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("attnlab: error:")]


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_vit_checkpoint_given_to_a_text_config_is_one_line(attnlab, vit_run, tmp_path, subcommand):
    given = checkpoint(vit_run, "best")
    sentences = tmp_path / "in.en"  # predict reads them: it would run, and write predictions.jsonl, if not refused
    sentences.write_text("A dog sleeps in the park.\n")
    extra = (f"--data.init_args.predict_file={sentences}",) if subcommand == "predict" else ()
    root = tmp_path / "run"
    code, _, err = attnlab(subcommand, *config_args(TOY, root), *extra, "--ckpt_path", str(given))
    expected = (
        f"attnlab: error: --ckpt_path {given} holds a models.vision.ImageClassifier; "
        "this config trains models.text.TranslationModule"
    )
    assert code == 2 and errors(err) == [expected], err
    assert files_under(root) == []  # no run folder, config.yaml or predictions.jsonl


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_detr_checkpoint_given_to_the_vit_config_is_one_line(attnlab, detr_run, tmp_path, subcommand):
    given = checkpoint(detr_run[0], "last")
    root = tmp_path / "run"
    code, _, err = attnlab(subcommand, *config_args(DIGITS, root), "--ckpt_path", str(given))
    expected = (
        f"attnlab: error: --ckpt_path {given} holds a models.detection.ObjectDetector; "
        "this config trains models.vision.ImageClassifier"
    )
    assert code == 2 and errors(err) == [expected], err
    assert files_under(root) == []


@pytest.mark.parametrize("subcommand, alias", [("test", "best"), ("fit", "last")])
def test_a_checkpoint_of_another_model_found_by_best_or_last_is_one_line(attnlab, vit_run, tmp_path, subcommand, alias):
    shutil.copytree(vit_run / "lightning_logs" / "version_0" / "checkpoints", tmp_path / "v" / "checkpoints")
    before = files_under(tmp_path)
    code, _, err = attnlab(subcommand, *config_args(TOY, tmp_path), "--ckpt_path", alias)
    found = tmp_path / "v" / "checkpoints" / f"{alias}.ckpt"
    assert code == 2 and errors(err) == [
        f"attnlab: error: --ckpt_path {found} holds a models.vision.ImageClassifier; "
        "this config trains models.text.TranslationModule"
    ], err
    assert files_under(tmp_path) == before


def test_a_checkpoint_of_other_data_names_the_linked_facts(attnlab, vit_run, tmp_path):
    given = checkpoint(vit_run, "best")
    assert torch.load(given, weights_only=True)["hyper_parameters"]["img_size"] == 8  # sklearn's digits are 8x8
    root = tmp_path / "run"
    code, _, err = attnlab(
        "validate", *config_args(DIGITS, root), "--data.init_args.img_size=16", "--ckpt_path", str(given)
    )
    assert code == 2 and errors(err) == [
        f"attnlab: error: --ckpt_path {given} holds a models.vision.ImageClassifier of img_size=8; this config's "
        f"data gives img_size=16: use the data settings of {given.parent.parent / 'config.yaml'}"
    ], err
    assert files_under(root) == []


def test_a_fit_that_never_validated_says_so_and_best_points_at_last(attnlab, detr_run, tmp_path):
    root, fit_err = detr_run
    last = checkpoint(root, "last")
    assert last.is_file() and not checkpoint(root, "best").exists()
    assert (
        "attnlab: warning: this fit ran no validation (trainer.check_val_every_n_epoch=2 > trainer.max_epochs=1), "
        f"so no best checkpoint was chosen; its weights are in {last}"
    ) in fit_err.splitlines()
    data = shapes_data(tmp_path / "shapes")
    code, _, err = attnlab("test", *config_args(SHAPES, root), *data, *TINY_DETR, "--ckpt_path", "best")
    assert code == 2 and errors(err) == [
        f"attnlab: error: --ckpt_path best: no 'best*.ckpt' under {root}/, but a last one is there: "
        f"pass --ckpt_path last to use {last}"
    ], err


def test_a_fit_that_validated_gives_no_warning(vit_run, tmp_path):
    assert "ran no validation" not in fitted(tmp_path, "--config", DIGITS, *ONE_BATCH, *TINY_VIT)


def test_a_fit_ended_by_max_steps_inside_an_epoch_says_so(tmp_path):
    err = fitted(
        tmp_path, "--config", DIGITS, *TINY_VIT, "--trainer.max_steps=2", "--trainer.check_val_every_n_epoch=2"
    )
    assert (
        "this fit ran no validation (trainer.max_steps=2 ended it at step 2, before epoch 2 was over "
        "(trainer.check_val_every_n_epoch=2))" in err
    )


class _Trainer(SimpleNamespace):
    world_size, global_rank = 1, 0


def test_predictions_appear_whole_or_not_at_all(tmp_path):
    out = tmp_path / "predictions.jsonl"
    out.write_text('{"label": "from the previous run"}\n')
    batch = {"label": torch.tensor([1, 2])}
    trainer = _Trainer(default_root_dir=str(tmp_path))
    writer = PredictionWriter()
    writer.on_predict_start(trainer, None)
    writer.write_on_batch_end(trainer, None, batch, None, None, 0, 0)
    writer.on_exception(trainer, None, RuntimeError("a failed batch"))
    assert out.read_text() == '{"label": "from the previous run"}\n' and files_under(tmp_path) == [out]

    writer.on_predict_start(trainer, None)
    writer.write_on_batch_end(trainer, None, batch, None, None, 0, 0)
    assert out.read_text() == '{"label": "from the previous run"}\n'  # not yet replaced
    writer.on_predict_end(trainer, None)
    assert [json.loads(line) for line in out.read_text().splitlines()] == [{"label": 1}, {"label": 2}]
    assert files_under(tmp_path) == [out]


@pytest.mark.parametrize("typo", [["--trainer.max_epoch=1"], ["--trainer.max_epoch", "1"]])
def test_an_abbreviated_option_is_refused_naming_the_full_one(attnlab, tmp_path, typo):
    code, _, err = attnlab("fit", *config_args(DIGITS, tmp_path / "run"), *typo)
    assert code == 2 and errors(err) == [
        "attnlab: error: --trainer.max_epoch: no such option; did you mean --trainer.max_epochs? "
        "(options are never abbreviated)"
    ], err
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "tool, args, abbreviated",
    [("sweep", ["configs/sweeps/ablation.yaml", "--dry"], "--dry"), ("compare", ["--tit", "x", "runs"], "--tit")],
)
def test_sweep_and_compare_options_are_never_abbreviated(attnlab, tool, args, abbreviated):
    code, out, err = attnlab(tool, *args)
    assert code == 2 and f"attnlab {tool}: error: unrecognized arguments: {abbreviated}" in err, out + err


def test_a_yaml_syntax_error_names_file_line_and_column(attnlab, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: 2\n  precision: 32-true\n model: 3\n")  # line 4 indented by one
    code, _, err = attnlab("fit", "--config", DIGITS, "--config", str(bad))
    # PyYAML reports the block mapping ending at line 4, column 2 (the one-space indent), started at line 1
    assert code == 2 and errors(err) == [
        f"attnlab: error: {bad}:4:2: not valid YAML: expected <block end>, but found '<block mapping start>' "
        "(while parsing a block mapping at 1:1)"
    ], err


@pytest.mark.parametrize(
    "args",
    [
        ["--optimizer=torch.optim.SGD"],
        ["--lr_scheduler=torch.optim.lr_scheduler.StepLR", "--lr_scheduler.step_size=3"],
        ["--config", "OWN"],  # the same in a config file
    ],
)
def test_an_optimizer_for_a_model_that_builds_its_own_is_refused(attnlab, tmp_path, args):
    own = tmp_path / "sgd.yaml"
    own.write_text("optimizer:\n  class_path: torch.optim.SGD\n  init_args: {lr: 0.1}\n")
    args = [str(own) if a == "OWN" else a for a in args]
    code, _, err = attnlab("fit", *config_args(DIGITS, tmp_path / "run"), *args)
    key, value = (
        ("lr_scheduler", "torch.optim.lr_scheduler.StepLR") if "StepLR" in args[0] else ("optimizer", "torch.optim.SGD")
    )
    assert code == 2 and errors(err) == [
        f"attnlab: error: {key}={value}: models.vision.ImageClassifier builds its own optimizer and learning-rate "
        "schedule (models/optim.py), which this setting would replace; change its model.init_args instead: "
        "lr, weight_decay, layer_decay, warmup_epochs, min_lr_ratio"
    ], err
    assert not (tmp_path / "run").exists()
