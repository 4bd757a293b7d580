"""`attnlab compare` names what each run's attention was and says what it cannot: a column for every field of the
attention block that differs between the runs (and register_tokens, init_values), a one-line error for a
``--baseline`` no run has, ``--output`` for ``--out``, a note on intervals from fewer than 5 seeds, and a seeds
figure laid out in rows of at most 4 panels."""

import json
from pathlib import Path

import pytest
import yaml

from experiments.compare.runs import STATS
from experiments.runfolder import Summary

ROOT = Path(__file__).resolve().parents[1]
BLOCK = {"similarity": "scaled_dot", "qk_norm": None, "normalization": "softmax", "gate": None}
SINKS = [
    {"attention": {"normalization": "softmax"}},
    {"attention": {"normalization": "sigmoid"}},
    {"attention": {"normalization": "softmax", "gate": "elementwise"}},
    {"register_tokens": 4},
]


def _run(folder: Path, best: float, hparams: dict | None = None, seed: int = 0) -> None:
    run = folder / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    summary = {"status": "finished", "modality": "vision", "experiment": str(folder), "hparams": hparams or {}}
    (run / "summary.json").write_text(json.dumps({**summary, "best": {"monitor": "val/acc", "value": best}}))
    (run / "config.yaml").write_text(yaml.safe_dump({"seed_everything": seed, "model": {"init_args": hparams}}))


def test_runs_and_cells_get_a_column_for_each_attention_field_that_differs(tmp_path):
    from experiments.compare import build_report, find_runs

    clipped = {"class_path": "models.core.attend.ClippedSoftmax", "init_args": {"alpha": 4}}
    settings = {
        "softmax": {"attention": BLOCK, "register_tokens": 0},
        "clipped": {"attention": {**BLOCK, "normalization": clipped}, "register_tokens": 0},
        "gated": {"attention": {**BLOCK, "gate": "elementwise"}, "register_tokens": 4},
    }
    for name, hparams in settings.items():
        for seed in (0, 1):
            _run(tmp_path / "runs" / name / f"seed{seed}", 0.8 + seed / 10, hparams, seed)
    result = build_report(find_runs([str(tmp_path / "runs")]), tmp_path / "report")
    runs = {row[0]: dict(zip(result["columns"], row)) for row in result["rows"]}
    assert result["columns"][3:8] == ["similarity", "positions", "normalization", "gate", "register_tokens"]
    assert "qk_norm" not in result["columns"]  # the same in every run
    assert [(r["normalization"], r["gate"], r["register_tokens"]) for r in runs.values()] == [
        ("ClippedSoftmax(alpha=4)", "none", "0"),
        ("ClippedSoftmax(alpha=4)", "none", "0"),
        ("softmax", "elementwise", "4"),
        ("softmax", "elementwise", "4"),
        ("softmax", "none", "0"),
        ("softmax", "none", "0"),
    ]
    cells = {row[0]: dict(zip(result["cell_columns"], row)) for row in result["cell_rows"]}
    assert result["cell_columns"][:6] == ["cell", "modality", "normalization", "gate", "register_tokens", "n"]
    assert cells["clipped"]["normalization"] == "ClippedSoftmax(alpha=4)" and cells["gated"]["gate"] == "elementwise"


def test_a_class_is_shown_by_its_name_and_arguments_and_by_its_module_only_where_two_share_a_name():
    from experiments.compare.tables import class_names, readable

    values = ["softmax", "a.b.TopK", {"class_path": "c.TopK", "init_args": {"k": 8, "t": 0.5}}, "x.ReluNorm", None]
    names = class_names(values)
    assert [readable(v, names) for v in values] == ["softmax", "b.TopK", "c.TopK(k=8, t=0.5)", "ReluNorm", "none"]


def _sinks_sweep(tmp_path: Path, seeds: list[int]) -> Path:
    """A recorded sweep of SINKS over ``seeds`` whose runs give val/acc 0.5 + cell / 10 + seed / 100 + seed² / 1000."""
    from experiments import sweep as sweeps

    spec = {"name": "sinks", "configs": ["configs/vision/digits.yaml"], "grid": {"model.init_args": SINKS}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**spec, "seeds": seeds, "root": str(tmp_path / "sweep")}, sort_keys=False))
    sweep = sweeps.load(path)
    sweeps.record(sweep)
    for run in sweep.runs():
        i = SINKS.index(run.cell["model.init_args"])
        _run(run.folder, 0.5 + i / 10 + run.seed / 100 + run.seed**2 / 1000, seed=run.seed)
    return sweep.root


@pytest.fixture
def sinks_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    return _sinks_sweep(tmp_path, [0, 1, 2])


@pytest.mark.parametrize(
    ("baseline", "line"),
    [
        (
            "normalisation=softmax",
            "--baseline normalisation=softmax: no run has key 'normalisation'; known keys: normalization, gate, "
            "register_tokens; did you mean 'normalization'?",
        ),
        (
            "normalization=softmax3",
            "--baseline normalization=softmax3: no run has normalization=softmax3; known values: softmax, sigmoid",
        ),
    ],
)
def test_a_baseline_no_run_has_is_one_line_with_the_known_keys_or_values(
    attnlab, sinks_sweep, tmp_path, baseline, line
):
    code, out, err = attnlab("compare", str(sinks_sweep), "--out", str(tmp_path / "report"), "--baseline", baseline)
    assert (code, err) == (2, f"attnlab: error: {line}\n")
    assert not (tmp_path / "report").exists()  # refused before anything is written


def test_a_baseline_names_a_field_inside_a_grid_value(attnlab, sinks_sweep, tmp_path):
    code, out, err = attnlab(
        "compare", str(sinks_sweep), "--out", str(tmp_path / "report"), "--baseline", "gate=elementwise"
    )
    assert code == 0, err
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    assert [row[0] for row in table["paired_rows"] if row[1] == "val/acc"] == [
        "digits, normalization=softmax vs normalization=softmax,gate=elementwise",
        "digits, normalization=sigmoid vs normalization=softmax,gate=elementwise",
        "digits, register_tokens=4 vs normalization=softmax,gate=elementwise",
    ]
    # normalization=softmax is held by two cells: the one that sets no other field is the reference
    code, out, err = attnlab(
        "compare", str(sinks_sweep), "--out", str(tmp_path / "r2"), "--baseline", "normalization=softmax"
    )
    assert code == 0 and "- digits, normalization=sigmoid vs normalization=softmax: +0.1 val/acc" in out


def test_output_is_another_name_for_out(attnlab, sinks_sweep, tmp_path):
    code, out, err = attnlab("compare", str(sinks_sweep), "--output", str(tmp_path / "elsewhere"))
    assert code == 0, err
    assert (tmp_path / "elsewhere" / "report.md").is_file()


def test_cells_of_fewer_than_5_seeds_are_marked_and_the_report_says_why_once(sinks_sweep, tmp_path):
    from experiments.compare import build_report, find_runs

    result = build_report(find_runs([str(sinks_sweep)]), tmp_path / "report")
    assert {row[result["cell_columns"].index("n")] for row in result["cell_rows"]} == {"3*"}
    report = result["report"].read_text()
    # Student's t quantiles from a printed table: t(0.975; 2) = 4.303, t(0.975; 4) = 2.776
    note = (
        "\\* n=3: the t-interval is wide (its half-width is t × the standard error, t = 4.3 at n=3 against 2.78 at "
        "n=5); 5 or more seeds give a usable interval."
    )
    assert report.count(note) == 1 and report.count("usable interval") == 1


def test_cells_of_5_seeds_get_no_mark_and_no_note(tmp_path, monkeypatch):
    from experiments.compare import build_report, find_runs

    monkeypatch.chdir(ROOT)
    root = _sinks_sweep(tmp_path, [0, 1, 2, 3, 4])
    result = build_report(find_runs([str(root)]), tmp_path / "report")
    assert {row[result["cell_columns"].index("n")] for row in result["cell_rows"]} == {"5"}
    assert "usable interval" not in result["report"].read_text()


def _cell(group: str, name: str, seeds: int = 3) -> dict:
    """A cell with every statistic of STATS, as `experiments.compare.runs.group_cells` gives it."""
    runs = [
        {
            "seed": s,
            "summary": Summary(best={"monitor": "val/acc", "value": 0.5 + s / 10}),
            "final": {k: s for k, _ in STATS},
        }
        for s in range(seeds)
    ]
    return {"group": group, "label": f"{group}/{name}", "runs": runs, "monitor": "val/acc"}


def test_the_seeds_figure_puts_at_most_4_panels_in_a_row_and_each_group_on_rows_of_its_own():
    from experiments.compare.plots import seeds_figure

    cells = [_cell("digits", "normalization=softmax"), _cell("digits", "register_tokens=4"), _cell("text", "x=1")]
    fig = seeds_figure(cells)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 2 * (1 + len(STATS))  # per group: the best metric and every statistic
    rows = {}
    for ax in panels:
        rows.setdefault(round(ax.get_subplotspec().rowspan.start), []).append(ax.get_title().split(":")[0])
    assert max(len(titles) for titles in rows.values()) == 4
    assert all(len(set(titles)) == 1 for titles in rows.values())  # a row holds one group's panels
    width, height = fig.get_size_inches()
    assert 0.5 <= width / height <= 2  # not a strip


def test_a_sweeps_cells_and_runs_outside_it_in_one_group_are_named_and_paired(tmp_path, monkeypatch):
    """configs/compare/vision.yaml's sweep cells form the group "vision", as runs of the vision modality outside a
    sweep do: every cell is named by each setting that varies in the group."""
    from experiments import sweep as sweeps
    from experiments.compare import build_report, find_runs

    monkeypatch.chdir(ROOT)
    spec = {"name": "v", "configs": ["configs/compare/vision.yaml"], "seeds": [0, 1], "root": str(tmp_path / "sweep")}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**spec, "grid": {"model.init_args.lr": [0.1, 0.2]}}))
    sweep = sweeps.load(tmp_path / "s.yaml")
    sweeps.record(sweep)
    for run in sweep.runs():
        _run(run.folder, 0.5 + run.cell["model.init_args.lr"] + run.seed / 100, seed=run.seed)
    for seed in (0, 1):
        _run(tmp_path / "alone" / f"seed{seed}", 0.9 + seed / 50, {"lr": 0.3}, seed)
    result = build_report(find_runs([str(tmp_path / "sweep"), str(tmp_path / "alone")]), tmp_path / "report")
    assert [row[0] for row in result["cell_rows"]] == ["alone", "vision/lr=0.1", "vision/lr=0.2"]
    # the first cell, outside the sweep, is the reference
    assert [line.split(":")[0] for line in result["conclusions"]] == [
        "vision, lr=0.1 vs lr=0.3",
        "vision, lr=0.2 vs lr=0.3",
    ]
