"""Sweep cells named by the settings they vary, in run folders and report labels alike (``normalization=sigmoid``,
``normalization=clipped,alpha=4``), and sweeps begun under the earlier names (``init_args={attention={...}}``) still
found, resumed, listed by `attnlab sweep --status` and compared."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from experiments import sweep as sweeps
from experiments.runfolder import short_names

ROOT = Path(__file__).resolve().parents[1]
DIGITS = "configs/vision/digits.yaml"
SINKS = [  # a sinks sweep's grid: whole blocks of settings over the config's
    {"attention": {"normalization": "softmax"}},
    {"attention": {"normalization": "sigmoid"}},
    {"attention": {"normalization": "softmax", "gate": "elementwise"}},
    {"register_tokens": 4},
]
# the folders the sweep of SINKS made before cells were named by their settings (written by hand from such a sweep)
OLD = [
    "init_args={attention={normalization=softmax}}",
    "init_args={attention={normalization=sigmoid}}",
    "init_args={attention={normalization=softmax,gate=elementwise}}",
    "init_args={register_tokens=4}",
]
NEW = ["normalization=softmax", "normalization=sigmoid", "normalization=softmax,gate=elementwise", "register_tokens=4"]


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the repository root


def _write(tmp_path: Path, grid: dict, seeds=(0, 1), **spec) -> Path:
    path = tmp_path / "s.yaml"
    spec = {
        "name": "s",
        "configs": [DIGITS],
        "grid": grid,
        "seeds": list(seeds),
        "root": str(tmp_path / "root"),
        **spec,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_cell_is_named_by_the_leaves_it_sets_with_the_shortest_names_that_differ(tmp_path):
    runs = sweeps.load(_write(tmp_path, {"model.init_args": SINKS}, seeds=[0])).runs()
    assert [r.name for r in runs] == [f"digits/{name}/seed=0" for name in NEW]
    clipped = {"class_path": "clipped", "init_args": {"alpha": 4}}
    grid = {"model.init_args.attention.normalization": [clipped], "model.init_args.lr": [0.1]}
    (run,) = sweeps.load(_write(tmp_path, grid, seeds=[0])).runs()
    assert run.name == "digits/normalization=clipped,alpha=4,lr=0.1/seed=0"
    assert run.folder == tmp_path / "root" / "digits" / "normalization=clipped,alpha=4,lr=0.1" / "seed=0"
    # two keys that end alike keep as much of their path as tells them apart; init_args is never part of a name
    keys = ["model.init_args.attention.normalization.init_args.k", "model.init_args.attention.similarity.init_args.k"]
    assert short_names([*keys, "model.init_args.lr"]) == dict(
        zip([*keys, "model.init_args.lr"], ["normalization.k", "similarity.k", "lr"])
    )


def test_a_grid_over_an_init_args_field_names_its_cells_by_the_field_and_sets_it_after_the_class(tmp_path):
    topk = {"class_path": "my_attention.TopKSoftmax", "init_args": {"k": 8}}
    key = "model.init_args.attention.normalization.init_args.k"
    sweep = sweeps.load(
        _write(tmp_path, {key: [2, 4, 8]}, seeds=[0], overrides={"model.init_args.attention.normalization": topk})
    )
    runs = sweep.runs()
    assert [r.name for r in runs] == [f"digits/k={k}/seed=0" for k in (2, 4, 8)]
    command = sweep.command(runs[0])
    assert command[-2:] == [
        '--model.init_args.attention.normalization={"class_path": "my_attention.TopKSoftmax", "init_args": {"k": 8}}',
        f"--{key}=2",
    ]  # the class first, then the grid's value of its field


def _old_sweep(tmp_path: Path) -> tuple[Path, Path]:
    """The SINKS sweep over seeds 0 and 1 as the earlier naming left it: sweep.json and the run folders under OLD;
    seed 0 finished everywhere, seed 1 of the first cell interrupted with a last.ckpt, the others never started."""
    file, root = _write(tmp_path, {"model.init_args": SINKS}), tmp_path / "root"
    runs = {}
    for seed in (0, 1):
        for old, cell in zip(OLD, SINKS):
            name = f"digits/{old}/seed={seed}"
            status = "done" if seed == 0 else "interrupted" if old == OLD[0] else "pending"
            runs[name] = {"config": DIGITS, "cell": {"model.init_args": cell}, "cell_name": f"digits/{old}"}
            runs[name].update(seed=seed, folder=str(root / name), status=status)
            if status == "pending":
                continue
            run = root / name / "lightning_logs" / "version_0"
            (run / "checkpoints").mkdir(parents=True)
            (run / "checkpoints" / "last.ckpt").write_bytes(b"")
            value = 0.5 + SINKS.index(cell) / 10 + seed / 100
            summary = {"status": "finished" if seed == 0 else "interrupted", "modality": "vision"}
            summary.update(experiment=str(root / name), best={"monitor": "val/acc", "value": value})
            (run / "summary.json").write_text(json.dumps(summary))
    grid = {"model.init_args": SINKS}
    sweep = {"file": str(file), "name": "s", "launcher": "local", "seeds": [0, 1], "runs": runs}
    (root / "sweep.json").write_text(json.dumps({**sweep, "configs": {"digits": {"config": DIGITS, "grid": grid}}}))
    return file, root


def test_a_sweep_begun_under_the_old_names_resumes_in_its_folders(tmp_path, attnlab):
    file, root = _old_sweep(tmp_path)
    sweep = sweeps.load(file)
    plan = {run.name: how for run, how in sweeps.plan(sweep)}
    last = root / f"digits/{OLD[0]}/seed=1" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert plan == {
        **{f"digits/{old}/seed=0": "done" for old in OLD},
        f"digits/{OLD[0]}/seed=1": f"resume from {last}",
        **{f"digits/{old}/seed=1": "new" for old in OLD[1:]},  # recorded under the old names: they keep them
    }
    code, out, err = attnlab("sweep", str(file), "--status")
    assert code == 0, err
    assert out.splitlines()[:5] == [
        *(f"digits/{old}/seed=0: done" for old in OLD),
        f"digits/{OLD[0]}/seed=1: interrupted",
    ]
    assert "attnlab: sweep s: 4 done, 1 interrupted, 3 pending of 8" in out
    (root / "sweep.json").unlink()  # without the status file, the folders alone keep the old names
    assert [r.name for r in sweep.runs()][:5] == [*(f"digits/{old}/seed=0" for old in OLD), f"digits/{OLD[0]}/seed=1"]
    assert [r.name for r in sweep.runs()][5:] == [f"digits/{new}/seed=1" for new in NEW[1:]]


def test_compare_labels_an_old_sweeps_cells_and_comparisons_by_their_settings(tmp_path):
    from experiments.compare import build_report, find_runs

    _, root = _old_sweep(tmp_path)
    for name in OLD:  # the second seed of every cell finished
        run = root / f"digits/{name}/seed=1" / "lightning_logs" / "version_0"
        run.mkdir(parents=True, exist_ok=True)
        value = 0.5 + OLD.index(name) / 10 + 0.03
        (run / "summary.json").write_text(
            json.dumps(
                {
                    "status": "finished",
                    "modality": "vision",
                    "experiment": str(run.parent.parent),
                    "best": {"monitor": "val/acc", "value": value},
                }
            )
        )
    result = build_report(find_runs([str(root)]), tmp_path / "report")
    assert [row[0] for row in result["cell_rows"]] == [f"digits/{name}" for name in NEW]
    # runs by the folders below their common parent (root/digits), as the cell names them
    runs = [f"{name}/seed={seed}" for name in NEW for seed in (0, 1)]
    assert sorted(row[0] for row in result["rows"]) == sorted(runs)
    assert [row[0] for row in result["paired_rows"] if row[1] == "val/acc"] == [
        "digits, normalization=sigmoid vs normalization=softmax",
        "digits, normalization=softmax,gate=elementwise vs normalization=softmax",
        "digits, register_tokens=4 vs normalization=softmax",
    ]
    assert "{" not in (tmp_path / "report" / "report.md").read_text().split("Runs: ")[0]


def test_a_fresh_sweep_of_the_same_file_takes_the_new_names(tmp_path):
    sweep = sweeps.load(_write(tmp_path, {"model.init_args": SINKS}))
    sweeps.record(sweep)
    names = list(json.loads((sweep.root / "sweep.json").read_text())["runs"])
    assert names == [f"digits/{name}/seed={seed}" for seed in (0, 1) for name in NEW]
    assert sweep.command(sweep.runs()[0])[:3] == [sys.executable, "-m", "experiments.cli"]


def test_two_cells_that_would_share_a_folder_are_refused_before_any_run(tmp_path):
    from experiments.sweep.file import SweepError

    grid = {"model.init_args.attention.normalization": ["my_attention/TopK", "my_attention TopK"]}
    with pytest.raises(SweepError) as refused:
        sweeps.load(_write(tmp_path, grid))
    assert str(refused.value) == (
        f"{tmp_path / 's.yaml'}: grid: two cells would share the run folder 'digits/normalization=my_attention_TopK'; "
        "give them values that differ"
    )


@pytest.mark.slow
def test_the_check_before_any_run_parses_a_grid_over_a_class_field(tmp_path):
    """`check` hands each grid value to the real fit parser after the class the overrides name: a field of its
    init_args passes, a misspelt one is the one line that names the grid key."""
    from experiments.sweep.file import SweepError
    from experiments.sweep.runs import check

    clipped = {"class_path": "models.core.attend.ClippedSoftmax", "init_args": {"alpha": 4}}
    overrides = {"model.init_args.attention.normalization": clipped}
    key = "model.init_args.attention.normalization.init_args"
    check(sweeps.load(_write(tmp_path, {f"{key}.alpha": [2, 8]}, overrides=overrides)))
    with pytest.raises(SweepError) as refused:
        check(sweeps.load(_write(tmp_path, {f"{key}.alpa": [2]}, overrides=overrides)))
    assert str(refused.value).startswith(f"{tmp_path / 's.yaml'}: grid.{key}.alpa=2 (configs/vision/digits.yaml): ")
