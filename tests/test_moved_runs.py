"""Run folders and sweeps copied or moved to another place, as to another disk or machine: `attnlab compare` names
runs by where their folders are now and does without checkpoints moved away; `attnlab sweep` resumes a copied sweep
in its new folder (given by a relative or an absolute root), leaving the original as it was. Their summary.json,
sweep.json and checkpoints still name the place they were written in (tests/data/before_rooms: /tmp/old/...)."""

import contextlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import config_args

from experiments.cli import main
from experiments.compare.runs import read_metrics

pytestmark = pytest.mark.slow  # CLI fits and sweeps in this process, a few seconds each

REPO = Path(__file__).resolve().parents[1]
BEFORE = REPO / "tests" / "data" / "before_rooms"
DIGITS = "configs/vision/digits.yaml"
TINY = {
    "trainer.limit_train_batches": 2,
    "trainer.limit_val_batches": 1,
    "trainer.num_sanity_val_steps": 0,
    "trainer.log_every_n_steps": 1,
    "model.init_args.depth": 1,
    "model.init_args.embed_dim": 16,
    "model.init_args.num_heads": 2,
}
FLAGS = tuple(f"--{key}={value}" for key, value in TINY.items())


def files_and_times(folder: Path) -> dict[Path, int]:
    return {p.relative_to(folder): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def table_rows(report: Path) -> dict[str, dict[str, str]]:
    table = json.loads((report / "table.json").read_text())
    return {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}


def test_compare_names_copied_runs_by_their_folders_now(attnlab, tmp_path):
    for family in ("lm", "translation", "vit", "detr"):  # each summary.json says /tmp/old/<name>; mt for translation
        shutil.copytree(BEFORE / family, tmp_path / "old" / family)
    shutil.copytree(BEFORE / "lm", tmp_path / "again" / "lm")  # the same run twice: two rows, told apart
    code, out, err = attnlab("compare", str(tmp_path / "old"), str(tmp_path / "again"), "--out", str(tmp_path / "r"))
    assert code == 0, err
    rows = table_rows(tmp_path / "r")
    assert set(rows) == {"old/lm", "old/translation", "old/vit", "old/detr", "again/lm"}, rows
    assert {row["status"] for row in rows.values()} == {"finished"}
    assert rows["old/lm"]["best"] == rows["again/lm"]["best"] == "val/loss = 4.237"
    assert f"`{tmp_path / 'old' / 'translation'}`" in (tmp_path / "r" / "report.md").read_text()


def test_compare_of_runs_whose_checkpoints_were_moved_says_what_it_leaves_out(attnlab, tmp_path):
    runs = tmp_path / "runs"
    (tmp_path / "elsewhere").mkdir()
    for name, more in (("plain", ()), ("registers", ("--model.init_args.register_tokens=1",))):
        code, _, err = attnlab("fit", *config_args(DIGITS, runs / name, *FLAGS, "--trainer.max_epochs=1", *more))
        assert code == 0, err
        shutil.move(runs / name / "lightning_logs" / "version_0" / "checkpoints", tmp_path / "elsewhere" / name)
    code, out, err = attnlab("compare", str(runs), "--out", str(tmp_path / "report"))
    assert code == 0, err
    assert set(table_rows(tmp_path / "report")) == {"plain", "registers"}
    gone = runs / "plain" / "lightning_logs" / "version_0" / "checkpoints" / "best.ckpt"  # the figure's first row
    line = f"The [CLS] attention maps are left out: {gone}: no best checkpoint"
    assert [x for x in err.splitlines() if x.startswith("attnlab: ")] == [
        f"attnlab: {line} (ModelCheckpoint with filename: best saves it)"
    ], err
    assert line in (tmp_path / "report" / "report.md").read_text()


class _Ended(SimpleNamespace):
    """What the fake spawn returns: a run already ended, with `subprocess.Popen`'s poll, wait and returncode."""

    def poll(self) -> int:
        return self.returncode

    wait = poll


@pytest.fixture
def in_process(monkeypatch):
    """The sweep's runs as `attnlab fit` in this process (`launch.spawn` is the launchers' one way to start a run),
    each run's output in its log."""
    from experiments.sweep import launch

    def spawn(command: list[str], env: dict[str, str], log: Path, own_session: bool = False) -> _Ended:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                main(command[3:])  # [python, -m, experiments.cli, fit, ...]
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        return _Ended(returncode=code)

    monkeypatch.setattr(launch, "spawn", spawn)


def stopped_after_its_first_epoch(root: Path, name: str) -> None:
    """Make the sweep's run ``name``, which trained one epoch and saved last.ckpt, one that SIGTERM stopped there."""
    summary = root / name / "lightning_logs" / "version_0" / "summary.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "status": "interrupted"}))
    status = json.loads((root / "sweep.json").read_text())
    status["runs"][name]["status"] = "interrupted"
    (root / "sweep.json").write_text(json.dumps(status))


@pytest.mark.parametrize("roots", ["relative", "absolute"])
def test_a_sweep_copied_to_another_folder_resumes_there(attnlab, in_process, tmp_path, monkeypatch, roots):
    """The sweep's long run stopped after one epoch of two; the sweep is copied, and run again in the copy: the
    finished run is skipped, the stopped one continues from the copy's last.ckpt, keeping its best score."""
    first, there = tmp_path / "a", tmp_path / "b"
    if roots == "relative":  # a project folder (config, sweep file, runs/) copied whole, run from inside it
        (first / "configs").mkdir(parents=True)
        shutil.copy(REPO / DIGITS, first / "configs" / "digits.yaml")
        spec, config, root, again = {}, "configs/digits.yaml", Path("runs/sweeps/moved"), ()
    else:  # the sweep's root alone copied, named by --root
        first.mkdir()
        spec, config, root = {"root": str(first / "root")}, str(REPO / DIGITS), first / "root"
        again = ("--root", str(there / "root"))
    spec = {"name": "moved", "configs": [config], "grid": {"trainer.max_epochs": [1, 2]}, "seeds": [0], **spec}
    (first / "s.yaml").write_text(yaml.safe_dump({**spec, "overrides": TINY}, sort_keys=False))
    monkeypatch.chdir(first)
    code, _, err = attnlab("sweep", "s.yaml", "--no-report", "--", "--trainer.max_epochs=1")
    assert code == 0, err
    stopped_after_its_first_epoch(first / root, "digits/max_epochs=2/seed=0")
    if roots == "relative":
        shutil.copytree(first, there)
    else:
        shutil.copytree(root, there / "root")
    original = files_and_times(first)

    monkeypatch.chdir(there if roots == "relative" else first)
    code, out, err = attnlab("sweep", "s.yaml", *again)
    assert code == 0, out + err
    new_root = root if roots == "relative" else there / "root"
    run = new_root / "digits" / "max_epochs=2" / "seed=0" / "lightning_logs" / "version_0"
    assert "digits/max_epochs=1/seed=0 is done, skipped" in out
    assert f"digits/max_epochs=2/seed=0 started (resume from {run / 'checkpoints' / 'last.ckpt'})" in out
    runs = json.loads((new_root / "sweep.json").read_text())["runs"]
    assert {entry["status"] for entry in runs.values()} == {"done"}
    assert {entry["folder"] for entry in runs.values()} == {str(new_root / name) for name in runs}
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4  # one epoch on
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt", "last.ckpt"]  # no best-v1.ckpt
    summary = json.loads((run / "summary.json").read_text())
    scores = [value for _, value in read_metrics(run)["val/acc"]]
    assert len(scores) == 2 and summary["status"] == "finished"
    assert summary["best"]["value"] == pytest.approx(max(scores))  # the epoch before the copy counts too
    assert Path(summary["best"]["checkpoint"]).resolve().parent == (run / "checkpoints").resolve()
    assert f"attnlab: report written to {new_root / 'report' / 'report.md'}" in out
    assert files_and_times(first) == original  # the sweep it was copied from is left as it was
