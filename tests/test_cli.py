"""The real `attnlab` CLI end to end on the embedded digits, and its errors for bad input."""

import csv
import dataclasses
import inspect
import json
import re
import warnings
from pathlib import Path

import pytest
import yaml
from jsonargparse import ArgumentParser, Namespace

from models.text.lm import DecoderOnlyLM
from models.text.lm_module import LanguageModelModule
from models.text.seq2seq import Seq2SeqTransformer
from models.text.translation_module import TranslationModule
from models.vision.module import ImageClassifier
from models.vision.vit import VisionTransformer

DIGITS = "configs/vision/digits.yaml"


@pytest.mark.slow
def test_fit_test_predict_from_the_saved_checkpoint(attnlab, tmp_path):
    root = f"--trainer.default_root_dir={tmp_path}"
    code, out, err = attnlab("fit", "--config", DIGITS, root, "--trainer.max_epochs=6")
    assert code == 0, err
    assert "attnlab: best val/acc=" in out
    version = tmp_path / "lightning_logs" / "version_0"
    assert (version / "checkpoints" / "best.ckpt").exists() and (version / "checkpoints" / "last.ckpt").exists()
    saved = yaml.safe_load((version / "config.yaml").read_text())
    assert saved["model"]["init_args"]["patch_size"] == 2  # the resolved config is kept with the run
    val_acc = [float(r["val/acc"]) for r in csv.DictReader((version / "metrics.csv").open()) if r.get("val/acc")]
    assert len(val_acc) == 6 and val_acc[-1] > 0.5 > val_acc[0]  # it learns

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = attnlab("test", "--config", DIGITS, root, "--ckpt_path", "best")
    assert code == 0, err
    assert "best.ckpt" in err and "test/acc" in out
    # testing into a new version folder is no news to the user: ModelCheckpoint's note about it stays out
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]

    code, out, err = attnlab("predict", "--config", DIGITS, root, "--ckpt_path", "last")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == 270 and set(rows[0]) == {"label", "score", "target"}
    assert sum(r["label"] == r["target"] for r in rows) / len(rows) > 0.5


BLOCK = dict(similarity="scaled_dot", qk_norm=None, normalization="softmax", gate=None, kernel=None)
BLOCK |= dict(window=None, memory_budget_mib=4.0)  # the attention block's defaults, as --print_config shows them


def test_model_facts_are_linked_from_the_datamodule(attnlab, tmp_path):
    one_batch = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1")
    code, out, err = attnlab("fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", *one_batch)
    assert code == 0, err
    hparams = yaml.safe_load(next(tmp_path.glob("**/hparams.yaml")).read_text())
    assert (hparams["num_classes"], hparams["in_chans"], hparams["img_size"]) == (10, 1, 8)


def test_a_fit_without_a_monitored_checkpoint_names_its_checkpoint(attnlab, tmp_path):
    # Lightning's own ModelCheckpoint (no monitor) keeps the latest checkpoint and has no best score
    one_batch = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1")
    code, out, err = attnlab(
        "fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--trainer.callbacks=[]", *one_batch
    )
    assert code == 0, err
    saved = next(tmp_path.glob("**/checkpoints/*.ckpt"))
    assert f"attnlab: checkpoint {saved}" in out and "attnlab: best" not in out
    # the output is the run's: no advertisement, no deprecation from Lightning's internals, no model table of 0 FLOPs
    for noise in ("litlogger", "LeafSpec", "Total FLOPs", "tensorboardX"):
        assert noise not in out + err


def test_print_config_shows_every_knob(attnlab):
    code, out, _ = attnlab("fit", "--config", DIGITS, "--print_config")
    assert code == 0
    cfg = yaml.safe_load(out)
    assert {"patch_size", "embed_dim", "depth", "num_heads", "attention", "lr"} <= set(cfg["model"]["init_args"])
    attention = cfg["model"]["init_args"]["attention"]
    assert attention == BLOCK
    assert cfg["data"]["init_args"]["batch_size"] == 64 and cfg["trainer"]["max_epochs"] == 40


NETWORKS = [
    (ImageClassifier, VisionTransformer, {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}),
    (TranslationModule, Seq2SeqTransformer, {"src_vocab_size": 11, "tgt_vocab_size": 13, "d_model": 16, "nhead": 2}),
    (LanguageModelModule, DecoderOnlyLM, {"vocab_size": 11, "d_model": 16, "nhead": 2, "num_layers": 1}),
]


@pytest.mark.parametrize("module, network, given", NETWORKS, ids=lambda x: getattr(x, "__name__", ""))
def test_a_module_takes_its_networks_options_with_the_networks_defaults(module, network, given):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(module)
    defaults = parser.get_defaults()
    for name, p in inspect.signature(network).parameters.items():  # model.init_args.<name>, defaulted by the network
        default = defaults[name]
        default = vars(default) if isinstance(default, Namespace) else default  # a block (the attention's): its fields
        expected = None if p.default is inspect.Parameter.empty else p.default
        assert default == (dataclasses.asdict(expected) if dataclasses.is_dataclass(expected) else expected), name
    built = module(**given)
    assert given.items() <= dict(built.hparams).items()  # recorded, so a checkpoint rebuilds the same network
    rebuilt = module(**built.hparams)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in built.state_dict().items()}


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "--model.init_args.depthh=3",
            "model: 'depthh' is not an option of models.vision.ImageClassifier; did you mean 'depth'?",
        ),
        ("--model.init_args.depth=three", "model.init_args.depth: expected int, got 'three'"),
        (
            "--model.init_args.attention.similarity=cosine",
            "model.init_args.attention.similarity: expected one of 'scaled_dot', 'dot', 'general'; "
            "expected dot import path string: cosine",
        ),
        (  # the keys that moved into the attention block
            "--model.init_args.similarity=dot",
            "model: 'similarity' is not an option of models.vision.ImageClassifier; did you mean 'attention.similarity'?",
        ),
        (
            "--model.init_args.qk_norm=layernorm",
            "model: 'qk_norm' is not an option of models.vision.ImageClassifier; did you mean 'attention.qk_norm'?",
        ),
        (
            "--model.init_args.attention.normalization=attnlab_nowhere.Norm",
            "model.init_args.attention.normalization: expected one of 'softmax', 'softmax1', 'clipped', 'sigmoid'; "
            "No module named 'attnlab_nowhere', got 'attnlab_nowhere.Norm'",
        ),
        (
            "--model.init_args.attention.gate=perhead",
            "model.init_args.attention.gate: expected one of 'headwise', 'elementwise', got 'perhead'",
        ),
        (
            "--model.init_args.patch_size=3",
            "model.patch_size=3 does not divide the image size 8; choose a divisor of 8",
        ),
        ("--data.init_args.batch_size=0", "data.batch_size=0 must be >= 1"),
        ("--trainer.max_epochs=x", "trainer.max_epochs: expected int, got 'x'"),
    ],
)
def test_bad_config_fails_before_training_with_one_line(attnlab, tmp_path, override, expected):
    code, out, err = attnlab("fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", override)
    lines = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert code == 2 and lines == [f"attnlab: error: {expected}"], err
    assert not list(tmp_path.glob("**/*.ckpt"))  # nothing trained


def test_unknown_key_in_a_yaml_file_names_the_key(attnlab, tmp_path):
    cfg = yaml.safe_load(Path(DIGITS).read_text())
    cfg["model"]["init_args"]["num_layers"] = 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    code, _, err = attnlab("fit", "--config", str(bad))
    assert code == 2 and "'num_layers' is not an option of models.vision.ImageClassifier" in err


def test_test_without_a_fitted_run_says_what_to_do(attnlab, tmp_path):
    code, _, err = attnlab("test", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", "--ckpt_path", "best")
    assert code == 2 and f"no 'best*.ckpt' under {tmp_path}/; run `attnlab fit`" in err


def test_help_lists_every_subcommand(attnlab):
    from experiments.cli import TOOLS

    code, out, _ = attnlab("--help")
    assert code == 0
    listed = set(re.findall(r"^    (\w+) ", out, re.M))
    assert {"fit", "validate", "test", "predict", "compare"} | set(TOOLS) <= listed


def test_a_block_field_set_to_null_keeps_the_blocks_other_fields(attnlab):
    code, out, _ = attnlab(
        "fit",
        "--config",
        DIGITS,
        "--model.init_args.attention.similarity=dot",
        "--model.init_args.attention.qk_norm=layernorm",
        "--model.init_args.attention.qk_norm=null",
        "--print_config",
    )
    attention = yaml.safe_load(out)["model"]["init_args"]["attention"]
    assert code == 0
    assert attention == BLOCK | {"similarity": "dot"}
