"""A run records the files of one's own behind its attention block (path, sha256, a copy) in config.yaml,
summary.json and W&B; `attnlab compare` says when the runs of one cell ran different contents of one file."""

import hashlib
import json
import sys
from functools import partial

import pytest
from conftest import config_args
from wandb_stub import WandbRun

from experiments.provenance import class_paths
from experiments.tracking import WandbLogger
from models.core.attention import AttentionConfig

DIGITS = "configs/vision/digits.yaml"
MODULE = "own_softmax_for_provenance"  # a name no other test imports: each run below imports the file anew
SOURCE = '''from torch import nn


class PlainSoftmax(nn.Module):
    """softmax over the keys, as a class of one's own: the same arithmetic as the built-in, on the reference path."""

    def forward(self, scores, blocked):
        return scores.softmax(-1)
'''


@pytest.fixture
def own_file(tmp_path, monkeypatch):
    """The researcher's file, importable as MODULE; forgotten by the import system after the test."""
    folder = tmp_path / "mine"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder / f"{MODULE}.py"
    sys.modules.pop(MODULE, None)


def _fit(attnlab, root, normalization: str, seed: int, *args: str):
    """A 2-step digits fit in ``root`` -> its run folder, after a fresh import of the file (a new process would)."""
    sys.modules.pop(MODULE, None)
    limits = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1")
    code, _, err = attnlab(
        "fit",
        *config_args(DIGITS, root, *limits, f"--seed_everything={seed}", *args),
        f"--model.init_args.attention.normalization={normalization}",
    )
    assert code == 0, err
    return root / "lightning_logs" / "version_0"


@pytest.mark.slow
def test_a_run_records_its_own_attention_file_and_compare_names_an_edit(attnlab, own_file, tmp_path, monkeypatch):
    own_file.write_text(SOURCE)
    before = hashlib.sha256(own_file.read_bytes()).hexdigest()
    wandb_run = WandbRun()
    monkeypatch.setattr(WandbLogger, "experiment", property(lambda self: wandb_run))
    loggers = "[{class_path: experiments.tracking.CSVLogger}, {class_path: experiments.tracking.WandbLogger}]"
    path = f"{MODULE}.PlainSoftmax"
    first = _fit(attnlab, tmp_path / "own" / "seed0", path, 0, f"--trainer.logger={loggers}")
    own_file.write_text(SOURCE.replace("softmax(-1)", "softmax(dim=-1)"))  # the researcher edits the file
    after = hashlib.sha256(own_file.read_bytes()).hexdigest()
    second = _fit(attnlab, tmp_path / "own" / "seed1", path, 1)
    builtin = _fit(attnlab, tmp_path / "builtin", "softmax", 0)

    for run, sha256, text in ((first, before, SOURCE), (second, after, own_file.read_text())):
        record = {"field": "normalization", "class_path": path, "path": str(own_file.resolve()), "sha256": sha256}
        summary = json.loads((run / "summary.json").read_text())
        assert summary["attention_sources"] == [{**record, "copy": f"attention_sources/{MODULE}.py"}]
        assert (run / "attention_sources" / f"{MODULE}.py").read_text() == text
        head = (run / "config.yaml").read_text().splitlines()[:2]
        assert head[0].startswith("# attention sources") and head[1].endswith(f"{own_file.resolve()} sha256={sha256}")
    assert (
        wandb_run.config["attention_sources"] == json.loads((first / "summary.json").read_text())["attention_sources"]
    )
    # the comment keeps config.yaml a config that `attnlab fit --config` takes
    code, out, err = attnlab("fit", "--config", str(first / "config.yaml"), "--print_config")
    assert code == 0 and path in out, err

    summary = json.loads((builtin / "summary.json").read_text())
    assert summary["attention_sources"] == [] and not (builtin / "attention_sources").exists()
    assert "attention sources" not in (builtin / "config.yaml").read_text()
    # equal arithmetic, equal FLOPs: the built-in's SDPA and the reference path's matmuls
    assert summary["flops_per_sample"] == json.loads((first / "summary.json").read_text())["flops_per_sample"]

    code, _, err = attnlab("compare", str(first), str(second), str(builtin), "--out", str(tmp_path / "report"))
    assert code == 0, err
    (warning,) = [line for line in err.splitlines() if line.startswith("attnlab: warning:")]
    assert str(own_file.resolve()) in warning and "seed0" in warning and "seed1" in warning
    assert before[:12] in warning and after[:12] in warning and "builtin" not in warning
    assert (
        f"**Warning:** {warning.removeprefix('attnlab: warning: ')}" in (tmp_path / "report" / "report.md").read_text()
    )


class Outer:
    class Inner:
        pass


@pytest.mark.parametrize(
    "block, paths",
    [
        (AttentionConfig(), {}),
        ({"similarity": "dot", "normalization": "my.Norm", "kernel": None}, {"normalization": "my.Norm"}),
        ({"normalization": {"class_path": "my.TopK", "init_args": {"k": 8}}}, {"normalization": "my.TopK"}),
        ({"kernel": partial(Outer.Inner, k=2)}, {"kernel": f"{__name__}.Outer.Inner"}),
        ({"similarity": Outer}, {"similarity": f"{__name__}.Outer"}),
        (None, {}),
    ],
)
def test_class_paths_of_a_block_in_each_form_it_takes(block, paths):
    assert class_paths(block) == paths
