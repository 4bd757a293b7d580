"""`attnlab compare` against any numeric setting of a sweep, as against the learning rate: a class's own init_args
field (``model.init_args.attention.normalization.init_args.k``) as the x axis of a plot and a table, each point the
mean and 95% t-interval over the seeds, and each point paired by seed with the reference point."""

import json
from pathlib import Path

import pytest
import yaml
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
KEY = "model.init_args.attention.normalization.init_args.k"
KS = [2, 4, 8]
TOPK = {"class_path": "my_attention.TopKSoftmax", "init_args": {"k": 8}}


def _final_loss(k: int, qk_norm, seed: int) -> float:
    """Chosen numbers: a lower loss at larger k, seeds apart by 0.1 (0.3 at k=2), QK-norm 0.2 lower."""
    return (
        2.0 - k / 10 + (0.3 if k == 2 else 0.1) * seed - (0.2 if qk_norm else 0.0) + (0.05 * seed**2 if k == 8 else 0)
    )


@pytest.fixture
def k_sweep(tmp_path, monkeypatch):
    """A recorded sweep of k in 2, 4, 8 x qk_norm null/layernorm x seeds 0-2 over a TopKSoftmax set in overrides."""
    from experiments import sweep as sweeps

    monkeypatch.chdir(ROOT)
    grid = {KEY: KS, "model.init_args.attention.qk_norm": [None, "layernorm"]}
    spec = {"name": "topk", "configs": ["configs/vision/digits.yaml"], "grid": grid, "seeds": [0, 1, 2]}
    spec.update(overrides={"model.init_args.attention.normalization": TOPK}, root=str(tmp_path / "sweep"))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = sweeps.load(tmp_path / "s.yaml")
    sweeps.record(sweep)
    for run in sweep.runs():
        final = _final_loss(run.cell[KEY], run.cell["model.init_args.attention.qk_norm"], run.seed)
        folder = run.folder / "lightning_logs" / "version_0"
        folder.mkdir(parents=True)
        summary = {"status": "finished", "modality": "vision", "best": {"monitor": "val/loss", "value": final}}
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / "metrics.csv").write_text(f"step,train/loss,val/loss\n0,4.0,\n20,2.5,{final}\n")
    return sweep.root


def _paired_row(a: list[float], b: list[float]) -> list[str]:
    diffs = [x - y for x, y in zip(a, b)]
    low, high = stats.ttest_1samp(diffs, 0).confidence_interval(0.95)
    p = stats.ttest_rel(a, b).pvalue
    return [str(len(a)), f"{sum(diffs) / len(diffs):+.3g}", f"{low:.3g} to {high:.3g}", f"{p:.2g}"]


def _mean_half(values: list[float]) -> str:
    mean = sum(values) / len(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=stats.sem(values))
    return f"{mean:.3g} ± {(high - low) / 2:.3g}"


def test_a_numeric_init_args_field_is_an_axis_with_intervals_and_pairs_by_seed(k_sweep, tmp_path):
    from experiments.compare import build_report, find_runs

    result = build_report(find_runs([str(k_sweep)]), tmp_path / "report")
    assert result["plots"]["against/digits_val_loss_against_k"].is_file()
    report = result["report"].read_text()
    assert f"### digits: final val/loss against {KEY}" in report
    # each point: the mean and 95% t-interval over the seeds, one line per qk_norm
    loss = {(k, q): [_final_loss(k, q, s) for s in range(3)] for k in KS for q in (None, "layernorm")}
    row = " | ".join(_mean_half(loss[k, None]) for k in KS)
    assert "| series | 2 | 4 | 8 |" in report and f"| digits: qk_norm=null | {row} |" in report
    # each point against k=2, the first grid value, paired by seed within its line
    table = report.split("Each point against k=2")[1].split("\n\n")[1]
    assert table.splitlines()[0] == "| series | k | n | difference vs k=2 | 95% CI | p (paired t) |"
    for k in (4, 8):
        for q, label in ((None, "null"), ("layernorm", "layernorm")):
            expected = ["digits: qk_norm=" + label, str(k), *_paired_row(loss[k, q], loss[2, q])]
            assert "| " + " | ".join(expected) + " |" in table


def test_the_baseline_names_the_reference_point_of_the_axis(k_sweep, tmp_path):
    from experiments.compare import build_report, find_runs

    result = build_report(find_runs([str(k_sweep)]), tmp_path / "report", baseline="k=8")
    report = result["report"].read_text()
    table = report.split("Each point against k=8")[1].split("\n\n")[1]
    loss = {k: [_final_loss(k, "layernorm", s) for s in range(3)] for k in KS}
    expected = ["digits: qk_norm=layernorm", "2", *_paired_row(loss[2], loss[8])]
    assert "| " + " | ".join(expected) + " |" in table
    # and the paired comparisons of the cells go against k=8 too
    assert {row[0] for row in result["paired_rows"]} == {
        f"digits, k={k} vs k=8 (qk_norm={q})" for k in (2, 4) for q in ("null", "layernorm")
    }


def test_outside_a_sweep_a_number_that_varies_between_runs_is_an_axis(tmp_path):
    from experiments.compare import build_report, find_runs

    for k in KS:
        for seed in (0, 1):
            run = tmp_path / "runs" / f"k{k}" / f"seed{seed}" / "lightning_logs" / "version_0"
            run.mkdir(parents=True)
            final = _final_loss(k, None, seed)
            summary = {"status": "finished", "modality": "vision", "experiment": str(run.parent.parent)}
            (run / "summary.json").write_text(json.dumps({**summary, "best": {"monitor": "val/loss", "value": final}}))
            (run / "metrics.csv").write_text(f"step,val/loss\n20,{final}\n")
            normalization = {"class_path": "my_attention.TopKSoftmax", "init_args": {"k": k}}
            config = {"seed_everything": seed, "model": {"init_args": {"attention": {"normalization": normalization}}}}
            (run / "config.yaml").write_text(yaml.safe_dump(config))
    result = build_report(find_runs([str(tmp_path / "runs")]), tmp_path / "report")
    assert "### vision: final val/loss against model.init_args.attention.normalization.init_args.k" in (
        result["report"].read_text()
    )
    loss = {k: [_final_loss(k, None, s) for s in (0, 1)] for k in KS}
    assert [row[0] for row in result["paired_rows"]] == ["vision, k=4 vs k=2", "vision, k=8 vs k=2"]
    assert "| vision | 8 | " + " | ".join(_paired_row(loss[8], loss[2])) + " |" in result["report"].read_text()
