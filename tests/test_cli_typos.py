"""A user's slip in a key, a config file's place or a module's path is one line that names the fix: a typo in the
attention block or in a --config file's `trainer:`, a class path beside the user but not importable, `attnlab -c FILE
fit`, and `fit --help` without the optimizers that every attnlab model refuses."""

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import yaml
from conftest import config_args

from models.class_paths import missing_module
from models.core.attention import AttentionConfig

DIGITS = "configs/vision/digits.yaml"
FIELDS = ", ".join(
    field.name for field in dataclasses.fields(AttentionConfig)
)  # the block's fields, as a user reads them
NOT_IMPORTABLE = "is in the working directory: run with PYTHONPATH=. (or install it)"


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("attnlab: error:")]


@pytest.mark.parametrize(
    "typo, meant",
    [("normalisation", "normalization"), ("similarty", "similarity"), ("qknorm", "qk_norm"), ("gates", "gate")],
)
def test_a_typo_in_the_attention_block_names_the_field_it_means(attnlab, typo, meant):
    code, _, err = attnlab("fit", "--config", DIGITS, f"--model.init_args.attention.{typo}=softmax", "--print_config")
    assert code == 2 and errors(err) == [
        f"attnlab: error: model.init_args.attention: {typo!r} is not a field of the attention block; "
        f"did you mean {meant!r}? (fields: {FIELDS})"
    ], err


def test_a_typo_in_the_attention_block_of_a_config_file_names_the_file(attnlab, tmp_path):
    typo = tmp_path / "british.yaml"
    typo.write_text(yaml.safe_dump({"model": {"init_args": {"attention": {"normalisation": "softmax"}}}}))
    code, _, err = attnlab("fit", *config_args(DIGITS, tmp_path / "run", "--config", str(typo)))
    assert code == 2 and errors(err) == [
        f"attnlab: error: {typo}: model.init_args.attention: 'normalisation' is not a field of the attention block; "
        f"did you mean 'normalization'? (fields: {FIELDS})"
    ], err


@pytest.mark.parametrize("printed", [(), ("--print_config",)], ids=["run", "print_config"])  # jsonargparse's 2 words
def test_a_typo_under_trainer_in_a_config_file_names_the_file_and_the_key(attnlab, tmp_path, printed):
    typo = tmp_path / "short.yaml"
    typo.write_text("trainer: {max_epoch: 2}\n")
    code, _, err = attnlab("fit", *config_args(DIGITS, tmp_path / "run", "--config", str(typo), *printed))
    assert code == 2 and errors(err) == [
        f"attnlab: error: {typo}: trainer.max_epoch is not an option; did you mean trainer.max_epochs?"
    ], err


def test_an_unknown_model_key_in_a_config_file_names_the_file(attnlab, tmp_path):
    typo = tmp_path / "deep.yaml"
    typo.write_text(yaml.safe_dump({"model": {"init_args": {"depthh": 3}}}))
    code, _, err = attnlab("fit", "--config", DIGITS, "--config", str(typo), "--print_config")
    assert code == 2 and errors(err) == [
        f"attnlab: error: {typo}: model: 'depthh' is not an option of models.vision.ImageClassifier; "
        "did you mean 'depth'?"
    ], err


@pytest.fixture
def beside_the_user(tmp_path, monkeypatch):
    """A working directory holding a researcher's files, and not on the import path (`attnlab` run from there)."""
    (tmp_path / "my_attention.py").write_text(
        "import torch\n\nclass Sigmoid(torch.nn.Module):\n"
        "    def forward(self, logits, mask=None):\n        return torch.sigmoid(logits)\n"
    )
    (tmp_path / "my_callbacks.py").write_text(
        "from pytorch_lightning import Callback\n\nclass Quiet(Callback):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".")])
    for name in ("my_attention", "my_callbacks"):  # another test's module of that name, imported in this process
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.invalidate_caches()
    return Path.cwd()


def test_a_class_path_beside_the_user_but_not_importable_says_how_to_import_it(attnlab, beside_the_user):
    digits = str(Path(__file__).parents[1] / DIGITS)
    code, _, err = attnlab("fit", "--config", digits, "--trainer.callbacks+=my_callbacks.Quiet", "--print_config")
    assert code == 2 and errors(err) == [
        f"attnlab: error: trainer.callbacks: module 'my_callbacks' is not importable, but ./my_callbacks.py {NOT_IMPORTABLE}"
    ], err
    own = "--model.init_args.attention.normalization=my_attention.Sigmoid"
    code, _, err = attnlab("fit", "--config", digits, own, "--print_config")
    [line] = errors(err)
    assert code == 2 and line.startswith("attnlab: error: model.init_args.attention.normalization: ")
    assert line.endswith(f"; module 'my_attention' is not importable, but ./my_attention.py {NOT_IMPORTABLE}"), line


def test_a_missing_module_is_named_as_python_names_it_unless_its_file_is_here(beside_the_user, monkeypatch):
    assert (
        missing_module("my_attention")
        == f"module 'my_attention' is not importable, but ./my_attention.py {NOT_IMPORTABLE}"
    )
    assert missing_module("attnlab_nowhere.norms") == "No module named 'attnlab_nowhere.norms'"
    monkeypatch.syspath_prepend(str(beside_the_user))  # importable after all: the file is not the cause
    assert missing_module("my_attention.inner") == "No module named 'my_attention.inner'"


def test_a_config_before_the_subcommand_is_the_subcommands(attnlab, tmp_path):
    code, before, err = attnlab("-c", DIGITS, "fit", "--print_config")
    assert code == 0, err
    code, after, err = attnlab("fit", "-c", DIGITS, "--print_config")
    assert code == 0 and before == after, err
    assert yaml.safe_load(before)["model"]["class_path"] == "models.vision.ImageClassifier"
    # LightningCLI's own form, a file of sections for the subcommands, is still read before the subcommand
    sections = tmp_path / "sections.yaml"
    sections.write_text("fit:\n  trainer: {min_epochs: 3}\n")
    code, out, err = attnlab("-c", str(sections), "fit", "-c", DIGITS, "--print_config")
    assert code == 0 and yaml.safe_load(out)["trainer"]["min_epochs"] == 3, err
    code, out, _ = attnlab("--help")
    assert code == 0 and "`attnlab -c FILE fit` is `attnlab fit -c FILE`" in " ".join(out.split())


def test_fit_help_leaves_out_the_optimizers_that_are_refused(attnlab, tmp_path):
    code, out, _ = attnlab("fit", "--help")
    assert code == 0 and "--trainer.max_epochs" in out
    for refused in ("--optimizer", "--lr_scheduler", "torch.optim.SGD", "torch.optim.lr_scheduler"):
        assert refused not in out
    # still parsed: kept in a printed (and saved) config, and refused in one line for a model that builds its own
    code, out, err = attnlab("fit", "--config", DIGITS, "--optimizer=torch.optim.SGD", "--print_config")
    assert code == 0 and yaml.safe_load(out)["optimizer"]["class_path"] == "torch.optim.SGD", err
    code, _, err = attnlab("fit", *config_args(DIGITS, tmp_path / "run"), "--optimizer=torch.optim.SGD")
    assert code == 2 and errors(err) == [
        "attnlab: error: optimizer=torch.optim.SGD: models.vision.ImageClassifier builds its own optimizer and "
        "learning-rate schedule (models/optim.py), which this setting would replace; change its model.init_args "
        "instead: lr, weight_decay, layer_decay, warmup_epochs, min_lr_ratio"
    ], err


def test_the_hidden_optimizer_is_still_dumped_after_the_help_is_shown():
    from torch.optim import Optimizer

    from experiments.trainer_cli import AttnlabParser

    parser = AttnlabParser(exit_on_error=False)
    parser.add_optimizer_args((Optimizer,))
    assert "--optimizer" not in parser.format_help()
    config = parser.parse_args(["--optimizer=torch.optim.SGD", "--optimizer.lr=0.1"])
    assert yaml.safe_load(parser.dump(config))["optimizer"]["class_path"] == "torch.optim.SGD"
