"""`attnlab compare` against swept numbers: learning-rate sensitivity and metric-vs-number plots with bands."""

import json
import math
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RATES = [0.001, 0.01, 0.1]


def _final_losses(qk_norm, seed):
    """Final val/loss per learning rate: without QK-norm the largest rate diverges (NaN)."""
    if qk_norm is None:
        return [2.0 + 0.3 * seed, 1.5, math.nan]
    return [1.6, 1.5, 1.7 + 0.3 * seed]


@pytest.fixture
def lr_sweep(tmp_path, monkeypatch):
    """A recorded sweep of 3 learning rates x qk_norm null/layernorm x 3 seeds; every run starts at loss 4."""
    from experiments import sweep as sweeps

    monkeypatch.chdir(ROOT)
    path = tmp_path / "s.yaml"
    grid = {"model.init_args.lr": RATES, "model.init_args.attention.qk_norm": [None, "layernorm"]}
    spec = {"name": "lr", "configs": ["configs/vision/digits.yaml"], "grid": grid, "seeds": [0, 1, 2]}
    path.write_text(yaml.safe_dump({**spec, "root": str(tmp_path / "sweep")}, sort_keys=False))
    sweep = sweeps.load(path)
    sweeps.record(sweep)
    for run in sweep.runs():
        qk_norm, lr = run.cell["model.init_args.attention.qk_norm"], run.cell["model.init_args.lr"]
        final = _final_losses(qk_norm, run.seed)[RATES.index(lr)]
        folder = run.folder / "lightning_logs" / "version_0"
        folder.mkdir(parents=True)
        summary = {"status": "finished", "modality": "vision", "best": {"monitor": "val/loss", "value": final}}
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / "metrics.csv").write_text(
            "step,train/loss_step,train/max_attn_logit,val/loss,val/loss@1x,val/loss@2x\n"
            f"0,4.0,1.0,,,\n10,3.0,{100 * lr},{final + 0.5},,\n20,2.5,,{final},{final},{final + 1}\n"
        )
    return sweep.root


def test_lr_sensitivity_is_the_mean_capped_final_loss_minus_the_best():
    from experiments.compare.stats import lr_sensitivity

    # capped at the initial loss 4: [2, 1.5, 4 (diverged)] -> mean 2.5, best 1.5
    assert lr_sensitivity([(2.0, 4.0), (1.5, 4.0), (math.nan, 4.0)]) == pytest.approx(1.0)
    assert lr_sensitivity([(2.0, 4.0), (5.0, 4.0), (None, 4.0)]) == pytest.approx((2 + 4 + 4) / 3 - 2)
    assert lr_sensitivity([(1.0, 4.0), (1.0, 4.0)]) == 0.0


def test_report_gives_lr_sensitivity_over_seeds_and_plots_loss_against_lr_and_eval_points(lr_sweep, tmp_path):
    from scipy import stats

    from experiments.compare import build_report, find_runs

    result = build_report(find_runs([str(lr_sweep)]), tmp_path / "report")
    rows = {label: (n, text) for label, n, text in result["lr_sensitivity"]}
    # per seed: without QK-norm 1.0 + 0.1·seed (1.0, 1.1, 1.2), with it 0.1 + 0.1·seed (0.1, 0.2, 0.3)
    half = stats.t.ppf(0.975, 2) * 0.1 / math.sqrt(3)
    assert rows == {
        "digits: qk_norm=null": ("3", f"1.1 ± {half:.3g}"),
        "digits: qk_norm=layernorm": ("3", f"0.2 ± {half:.3g}"),
    }
    # paired over the seeds, QK-norm lowers it by 0.9 in each: an interval of zero width and no p-value
    assert result["lr_sensitivity_pairs"] == [
        ["digits: qk_norm=layernorm vs digits: qk_norm=null", "3", "-0.9", "-0.9 to -0.9", "-"]
    ]
    plots = result["plots"]
    assert plots["against/digits_val_loss_against_lr"].is_file() and plots["against/val_loss_at_x"].is_file()
    assert plots["against/digits_train_max_attn_logit_against_lr"].is_file()
    report = result["report"].read_text()
    assert "## Against the swept numbers" in report and "digits: final val/loss against model.init_args.lr" in report
    assert "val/loss at 1x, 2x" in report and "Learning-rate sensitivity" in report
    # the values behind each plot: without QK-norm the largest rate diverged in every seed (no value), the smallest
    # ends at 2.0 + 0.3·seed (sample sd 0.3); with QK-norm at 0.1, 1.7 + 0.3·seed at 1x and one more at 2x
    h = f"{stats.t.ppf(0.975, 2) * 0.3 / math.sqrt(3):.3g}"
    assert f"| digits: qk_norm=null | 2.3 ± {h} | 1.5 ± 0 | - |" in report
    assert "| series | 1x | 2x |" in report and f"| digits/lr=0.1,qk_norm=layernorm | 2 ± {h} | 3 ± {h} |" in report


@pytest.mark.parametrize("missing", [3, 1, 0], ids=["last", "middle", "first"])
def test_each_series_lr_sensitivity_is_paired_with_the_first_of_its_group_over_common_seeds(missing):
    """A seed missing from one series: the others pair by seed (written out by hand below), not by position."""
    from scipy import stats

    from experiments.compare.tables import sensitivity_rows

    none, ln = {0: 1.0, 1: 1.4, 2: 0.9, 3: 2.0}, {0: 0.3, 1: 0.5, 2: 0.4, 3: 1.6}
    per_series = {"none": none, "ln": {s: v for s, v in ln.items() if s != missing}, "rms": {5: 0.1}}
    rows, pairs = sensitivity_rows(per_series)
    assert [row[:2] for row in rows] == [["none", "4"], ["ln", "3"], ["rms", "1"]]
    # the pairs by seed ("rms" shares no seed: no pair)
    a, b = {
        3: ([0.3, 0.5, 0.4], [1.0, 1.4, 0.9]),
        1: ([0.3, 0.4, 1.6], [1.0, 0.9, 2.0]),
        0: ([0.5, 0.4, 1.6], [1.4, 0.9, 2.0]),
    }[missing]
    diffs = [x - y for x, y in zip(a, b)]
    ci = stats.ttest_1samp(diffs, 0).confidence_interval(0.95)
    p = stats.ttest_rel(a, b).pvalue
    assert pairs == [["ln vs none", "3", f"{sum(diffs) / 3:+.3g}", f"{ci.low:.3g} to {ci.high:.3g}", f"{p:.2g}"]]


def test_swept_series_band_is_the_t_interval_over_seeds(lr_sweep):
    from experiments.compare.curves import band, swept_series
    from experiments.compare.runs import find_runs, group_cells, load_runs

    cells = group_cells(load_runs(find_runs([str(lr_sweep)])))
    (line,) = [s for s in swept_series(cells, "model.init_args.lr", "val/loss") if s["label"].endswith("layernorm")]
    points = dict(band(line["points"]))
    assert sorted(points) == RATES
    assert points[0.1]["mean"] == pytest.approx(2.0) and points[0.1]["n"] == 3
    assert points[0.01]["half"] == 0.0  # every seed 1.5
