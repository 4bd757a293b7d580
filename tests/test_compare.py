"""`attnlab compare` on two tiny real runs that differ only in the similarity function."""

import json
import os
import socket
from pathlib import Path

import pytest
import yaml
from builders import gone_pid
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
DIGITS = "configs/vision/digits.yaml"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from experiments.cli import main

    root = tmp_path_factory.mktemp("runs")
    for similarity in ("scaled_dot", "dot"):
        main(
            [
                "fit",
                "--config",
                DIGITS,
                f"--trainer.default_root_dir={root}/vision/{similarity}",
                "--trainer.max_epochs=1",
                "--trainer.limit_train_batches=4",
                "--trainer.limit_val_batches=2",
                "--trainer.log_every_n_steps=1",
                f"--model.init_args.attention.similarity={similarity}",
            ]
        )
    return root


@pytest.mark.slow
def test_report_has_a_row_per_run_the_plots_and_the_sqrt_d_section(attnlab, two_runs, tmp_path):
    code, out, err = attnlab("compare", str(two_runs), "--out", str(tmp_path / "report"))
    assert code == 0, err
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert set(rows) == {"scaled_dot", "dot"}  # experiment folders below their common parent
    assert {r["modality"] for r in rows.values()} == {"vision"} and rows["dot"]["similarity"] == "dot"
    assert rows["dot"]["params"] == rows["scaled_dot"]["params"] != "-"
    assert rows["dot"]["best"].startswith("val/acc = ") and rows["dot"]["distance"].endswith("pixels")
    for plot in ("loss_curves.png", "attention_entropy.png", "attention_distance.png", "sqrt_d.png"):
        assert (tmp_path / "report" / plot).stat().st_size > 10_000, plot
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## What the √d scaling does" in report and "| dot | vision |" in report
    # the seeds' argument, measured: without 1/√d (d = 16) the logits spread ~16x wider at initialisation
    scaling = {row[1]: dict(zip(table["scaling_columns"], row)) for row in table["scaling_rows"]}
    assert float(scaling["dot"]["logit var init"]) > 8 * float(scaling["scaled_dot"]["logit var init"])
    assert float(scaling["dot"]["max weight init"]) > float(scaling["scaled_dot"]["max weight init"])
    assert f"attnlab: report written to {tmp_path / 'report' / 'report.md'}" in out and "| scaled_dot | vision |" in out


def test_compare_names_a_folder_without_runs(attnlab, tmp_path):
    code, _, err = attnlab("compare", str(tmp_path))
    assert code == 2 and f"attnlab: error: {tmp_path}: no run (summary.json) below it" in err


def _unfinished_run(folder: Path, status: str, pid: int | None = None) -> Path:
    """A run folder whose summary.json says ``status``, written by process ``pid`` of this host."""
    run = folder / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    where = {"pid": pid, "host": socket.gethostname()} if pid else {}
    summary = {"status": status, "modality": "vision", "experiment": str(folder), **where}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_compare_lists_the_runs_that_did_not_finish_with_their_state(attnlab, tmp_path):
    _unfinished_run(tmp_path / "a", "running", gone_pid())
    _unfinished_run(tmp_path / "b", "interrupted")
    code, _, err = attnlab("compare", str(tmp_path))
    listed = "a/lightning_logs/version_0 (killed), b/lightning_logs/version_0 (interrupted); "
    assert code == 2 and f"attnlab: error: {tmp_path}: no run below it finished: {listed}" in err


def test_the_table_shows_a_run_whose_process_is_gone_as_killed(attnlab, tmp_path):
    killed = _unfinished_run(tmp_path / "killed", "running", gone_pid())
    alive = _unfinished_run(tmp_path / "alive", "running", os.getpid())
    code, out, err = attnlab("compare", str(killed), str(alive), "--out", str(tmp_path / "report"))
    assert code == 0, err
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    status = {row[0]: dict(zip(table["columns"], row))["status"] for row in table["rows"]}
    assert status == {"killed": "killed", "alive": "running"}


@pytest.mark.slow
def test_report_goes_to_wandb_as_a_table_and_images(attnlab, two_runs, tmp_path, logged):
    import wandb

    code, out, err = attnlab("compare", str(two_runs), "--out", str(tmp_path / "report"), "--wandb", "team/attnlab")
    assert code == 0, err
    assert isinstance(logged["compare/runs"], wandb.Table) and len(logged["compare/runs"].data) == 2
    assert {"compare/loss", "compare/entropy", "compare/distance", "compare/scaling"} <= set(
        logged
    ) and "attnlab: W&B:" in out


# ---- cells: runs that differ only in the seed, aggregated (synthetic summaries, so the numbers are known)

SCORES = {"scaled_dot": [0.80, 0.85, 0.83], "dot": [0.70, 0.78, 0.71], "general": [0.82, 0.86, 0.80]}


def _fake_run(folder, best, entropy, config=None, summary=None):
    run = folder / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    layers = [
        {
            "name": "encoder.layers.0.self_attn",
            "kind": "self",
            "entropy": [entropy, entropy + 0.2],
            "max_weight": [0.5, 0.7],
        }
    ]
    (run / "summary.json").write_text(
        json.dumps(
            {
                "status": "finished",
                "modality": "vision",
                "experiment": str(folder),
                "best": {"monitor": "val/acc", "value": best},
                "attention": {
                    "final": {"unit": "pixels", "layers": layers, **({"summary": summary} if summary else {})}
                },
            }
        )
    )
    if config is not None:
        (run / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture
def logged(monkeypatch) -> dict:
    """What `attnlab compare --wandb` logs: under WANDB_MODE=disabled wandb.init returns a NoopRun, whose log we record."""
    from wandb.sdk.lib.noop_run import NoopRun

    logged = {}
    monkeypatch.setattr(NoopRun, "log", lambda self, data, *a, **k: logged.update(data), raising=False)
    return logged


@pytest.fixture
def sweep_root(tmp_path, monkeypatch):
    """A recorded 3-similarity x 3-seed sweep whose run folders hold summaries with chosen values."""
    from experiments import sweep as sweeps

    monkeypatch.chdir(ROOT)
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "sims",
                "configs": [DIGITS],
                "grid": {"model.init_args.attention.similarity": list(SCORES)},
                "seeds": [0, 1, 2],
                "root": str(tmp_path / "sweep"),
            }
        )
    )
    sweep = sweeps.load(path)
    sweeps.record(sweep)
    for run in sweep.runs():
        similarity = run.cell["model.init_args.attention.similarity"]
        summary = {key: _sinks(similarity, run.seed)[i] for i, key in enumerate(SINKS)}
        _fake_run(run.folder, SCORES[similarity][run.seed], 1.0 + run.seed + len(similarity) / 10, summary=summary)
    return sweep.root


SINKS = ("sink_mass", "sink_heads", "out_max", "out_kurtosis")


def _sinks(similarity: str, seed: int) -> tuple[float, ...]:
    """A run's sink mass, Sink^ε_1, max |x| and kurtosis, as its summary.json reduces them (chosen numbers)."""
    return 0.1 * seed + len(similarity) / 100, seed / 4, 10.0 + 3 * seed + len(similarity), 3.0 + seed**2


def _t_interval(values):
    mean = sum(values) / len(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=stats.sem(values))
    return mean, low, high


def test_cells_get_mean_and_95_percent_t_interval_over_seeds(sweep_root, tmp_path):
    from experiments.compare import build_report, find_runs

    result = build_report(find_runs([str(sweep_root)]), tmp_path / "report")
    rows = {row[0]: dict(zip(result["cell_columns"], row)) for row in result["cell_rows"]}
    assert list(rows) == [
        "digits/similarity=scaled_dot",
        "digits/similarity=dot",
        "digits/similarity=general",
    ]  # the grid's order
    for similarity, values in SCORES.items():
        row = rows[f"digits/similarity={similarity}"]
        mean, low, high = _t_interval(values)
        assert row["n"] == "3*" and row["seeds"] == "0,1,2" and row["modality"] == "vision"
        assert row["best"] == f"val/acc = {mean:.3g} ± {(high - low) / 2:.3g}"
        entropies = [1.1 + seed + len(similarity) / 10 for seed in range(3)]  # the mean over the layer's two heads
        mean, low, high = _t_interval(entropies)
        assert row["entropy (nats)"] == f"{mean:.3g} ± {(high - low) / 2:.3g}"
    report = (tmp_path / "report" / "report.md").read_text()
    assert "95% t-interval (scipy.stats.t with n - 1 degrees of freedom" in report and "scipy.stats.ttest_rel" in report
    assert (tmp_path / "report" / "seeds.png").stat().st_size > 10_000


def test_runs_and_cells_show_sinks_and_outliers_with_their_intervals(sweep_root, tmp_path):
    from experiments.compare import build_report, find_runs

    result = build_report(find_runs([str(sweep_root)]), tmp_path / "report")
    labels = ("sink mass", "sink heads", "max |x|", "kurtosis")
    cells = {row[0]: dict(zip(result["cell_columns"], row)) for row in result["cell_rows"]}
    for similarity in SCORES:
        row = cells[f"digits/similarity={similarity}"]
        for i, label in enumerate(labels):
            mean, low, high = _t_interval([_sinks(similarity, seed)[i] for seed in range(3)])
            assert row[label] == f"{mean:.3g} ± {(high - low) / 2:.3g}", label
    runs = [dict(zip(result["columns"], row)) for row in result["rows"]]
    first = next(r for r in runs if r["run"].endswith("similarity=dot/seed=0"))
    assert [first[label] for label in labels] == [f"{v:.3g}" for v in _sinks("dot", 0)]
    assert "Sink^ε_1, Gu et al. 2025" in (tmp_path / "report" / "report.md").read_text()


def test_each_cell_is_compared_with_the_first_grid_value_over_the_same_seeds(sweep_root, tmp_path):
    from experiments.compare import build_report, find_runs
    from experiments.compare.stats import interval, paired

    result = build_report(find_runs([str(sweep_root)]), tmp_path / "report")
    best = [dict(zip(result["paired_columns"], row)) for row in result["paired_rows"] if row[1] == "val/acc"]
    assert [row["comparison"] for row in best] == ["digits, dot vs scaled_dot", "digits, general vs scaled_dot"]
    diffs = [a - b for a, b in zip(SCORES["dot"], SCORES["scaled_dot"])]
    mean, low, high = _t_interval(diffs)
    p = stats.ttest_rel(SCORES["dot"], SCORES["scaled_dot"]).pvalue
    assert (
        best[0]["n"] == "3"
        and best[0]["difference"] == f"{mean:+.3g}"
        and best[0]["95% CI"] == f"{low:.3g} to {high:.3g}"
    )
    assert best[0]["p (paired t)"] == f"{p:.2g}"
    assert result["conclusions"][0] == (
        f"digits, dot vs scaled_dot: {mean:+.3g} val/acc (95% CI {low:.3g} to {high:.3g}, n=3, paired t-test p={p:.2g})"
    )
    # the helpers themselves, against scipy
    d = paired(SCORES["dot"], SCORES["scaled_dot"])
    assert (
        d["mean"] == pytest.approx(mean)
        and (d["low"], d["high"]) == pytest.approx((low, high))
        and d["p"] == pytest.approx(p)
    )
    assert interval([0.5])["half"] is None  # one seed: no interval


def test_baseline_names_the_reference_and_compare_prints_the_cells(attnlab, sweep_root, tmp_path):
    code, out, err = attnlab(
        "compare", str(sweep_root), "--out", str(tmp_path / "report"), "--baseline", "similarity=dot"
    )
    assert code == 0, err
    mean, low, high = _t_interval([a - b for a, b in zip(SCORES["general"], SCORES["dot"])])
    assert f"- digits, general vs dot: {mean:+.3g} val/acc (95% CI {low:.3g} to {high:.3g}, n=3" in out
    assert "vs scaled_dot" not in out and "| digits/similarity=dot | vision | 3* | 0,1,2 | val/acc = " in out
    code, _, err = attnlab("compare", str(sweep_root), "--baseline", "dot")
    assert code == 2 and "--baseline 'dot': expected KEY=VALUE" in err


def test_runs_outside_a_sweep_form_cells_by_their_config_without_the_seed(tmp_path):
    from experiments.compare import build_report, find_runs

    for similarity in ("scaled_dot", "dot"):
        for seed in (0, 1):
            config = {
                "seed_everything": seed,
                "trainer": {"default_root_dir": f"x/{seed}", "max_epochs": 3},
                "model": {"init_args": {"attention": {"similarity": similarity}}},
            }
            _fake_run(tmp_path / "runs" / similarity / f"seed{seed}", SCORES[similarity][seed], 1.0, config)
    result = build_report(find_runs([str(tmp_path / "runs")]), tmp_path / "report")
    rows = {row[0]: row for row in result["cell_rows"]}
    assert set(rows) == {"scaled_dot", "dot"} and {row[2] for row in rows.values()} == {"2*"}
    assert result["conclusions"][0].startswith(
        "vision, scaled_dot vs dot: "
    )  # outside a sweep the first cell is the reference


def test_cells_and_paired_comparisons_go_to_wandb_as_tables(attnlab, sweep_root, tmp_path, logged):
    import wandb

    code, _, err = attnlab("compare", str(sweep_root), "--out", str(tmp_path / "report"), "--wandb", "attnlab")
    assert code == 0, err
    assert len(logged["compare/cells"].data) == 3 and isinstance(logged["compare/paired"], wandb.Table)
    assert (
        logged["compare/paired"].data[0][:3] == ["digits, dot vs scaled_dot", "val/acc", "3"]
        and "compare/seeds" in logged
    )


def _sweep_with(tmp_path, scores, statuses=None):
    """A recorded sweep over similarities x seeds 0-2 whose runs give ``scores[similarity][seed]`` (None: the run
    left no summary) and end with ``statuses`` (similarity, seed) -> status (default finished)."""
    from experiments import sweep as sweeps

    path = tmp_path / "s.yaml"
    spec = {
        "name": "sims",
        "configs": [DIGITS],
        "grid": {"model.init_args.attention.similarity": list(scores)},
        "seeds": [0, 1, 2],
    }
    path.write_text(yaml.safe_dump({**spec, "root": str(tmp_path / "sweep")}))
    sweep = sweeps.load(path)
    sweeps.record(sweep)
    for run in sweep.runs():
        similarity = run.cell["model.init_args.attention.similarity"]
        if scores[similarity][run.seed] is not None:
            _fake_run(run.folder, scores[similarity][run.seed], entropy=1.0)
            status = (statuses or {}).get((similarity, run.seed))
            if status:
                summary = run.folder / "lightning_logs" / "version_0" / "summary.json"
                summary.write_text(json.dumps({**json.loads(summary.read_text()), "status": status}))
    return sweep.root


def test_pairs_use_only_the_seeds_both_cells_finished_and_say_how_many(monkeypatch, tmp_path):
    from experiments.compare import build_report, find_runs

    monkeypatch.chdir(ROOT)
    scores = {"scaled_dot": [0.80, 0.85, 0.83], "dot": [0.70, 0.78, 0.71], "general": [0.82, None, 0.80]}
    root = _sweep_with(tmp_path, scores, statuses={("dot", 2): "failed"})  # dot's seed 2 failed, general's 1 is missing
    result = build_report(find_runs([str(root)]), tmp_path / "report")
    cells = {row[0]: row for row in result["cell_rows"]}
    assert [cells[f"digits/similarity={s}"][2:4] for s in scores] == [["3*", "0,1,2"], ["2*", "0,1"], ["2*", "0,2"]]
    best = {row[0]: row for row in result["paired_rows"] if row[1] == "val/acc"}
    for similarity, seeds in (("dot", [0, 1]), ("general", [0, 2])):
        a, b = [scores[similarity][s] for s in seeds], [scores["scaled_dot"][s] for s in seeds]
        low, high = stats.ttest_rel(a, b).confidence_interval()
        row = best[f"digits, {similarity} vs scaled_dot"]
        assert row[2] == "2" and row[4] == f"{low:.3g} to {high:.3g}"
        assert row[5] == f"{stats.ttest_rel(a, b).pvalue:.2g}"
    assert "n=2, paired t-test" in result["conclusions"][0]


def test_zero_variance_gives_a_zero_width_interval_and_no_p_value(monkeypatch, tmp_path):
    """Seeds that agree exactly: the mean ± 0, and the paired difference's interval is that difference; scipy's
    ttest_rel would say p = 0 (t = inf) or NaN (0/0), which is no evidence: the table says '-'."""
    import warnings

    from experiments.compare import build_report, find_runs
    from experiments.compare.stats import interval, paired

    monkeypatch.chdir(ROOT)
    root = _sweep_with(tmp_path, {"scaled_dot": [0.8, 0.8, 0.8], "dot": [0.7, 0.7, 0.7]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from a division by a zero spread either
        result = build_report(find_runs([str(root)]), tmp_path / "report")
        zero = interval([0.8, 0.8, 0.8])
        assert zero["half"] == 0.0 and zero == pytest.approx({"mean": 0.8, "n": 3, "half": 0, "low": 0.8, "high": 0.8})
        same = paired([0.5, 0.6], [0.5, 0.6])
        assert (same["mean"], same["half"], same["p"]) == (0.0, 0.0, None)
    cells = {row[0]: row for row in result["cell_rows"]}
    assert cells["digits/similarity=scaled_dot"][4] == "val/acc = 0.8 ± 0"
    best = next(row for row in result["paired_rows"] if row[1] == "val/acc")
    assert best == ["digits, dot vs scaled_dot", "val/acc", "3", "-0.1", "-0.1 to -0.1", "-"]
    assert result["conclusions"] == [
        "digits, dot vs scaled_dot: -0.1 val/acc (95% CI -0.1 to -0.1, n=3, paired t-test p=-)"
    ]


def test_cells_show_the_w8a8_change_of_the_monitored_metric_and_pair_it(monkeypatch, tmp_path):
    """summary.json's quantization (experiments.callbacks.W8A8): W8A8 - fp32 of the checkpoint's monitor (val/acc)
    per run, its mean and 95% t-interval per cell, and each cell against the reference paired over the seeds."""
    from experiments.compare import build_report, find_runs

    monkeypatch.chdir(ROOT)
    root = _sweep_with(tmp_path, {"scaled_dot": [0.9, 0.8, 0.85], "dot": [0.7, 0.75, 0.72]})
    drops = {"scaled_dot": [-0.01, -0.03, -0.02], "dot": [-0.2, -0.35, -0.1]}
    for similarity, values in drops.items():
        for seed, drop in enumerate(values):
            path = (
                root / "digits" / f"similarity={similarity}" / f"seed={seed}" / "lightning_logs/version_0/summary.json"
            )
            summary = json.loads(path.read_text())
            fp32 = {"val/acc": 0.5, "val/loss": 1.0}
            quantized = {"val/acc": 0.5 + drop, "val/loss": 9.0}  # the monitor's metric only counts
            path.write_text(json.dumps({**summary, "quantization": {"val": {"fp32": fp32, "w8a8": quantized}}}))
    result = build_report(find_runs([str(root)]), tmp_path / "report")
    cells = {row[0]: dict(zip(result["cell_columns"], row)) for row in result["cell_rows"]}
    for similarity, values in drops.items():
        mean, low, high = _t_interval(values)
        assert cells[f"digits/similarity={similarity}"]["W8A8 - fp32"] == f"{mean:.3g} ± {(high - low) / 2:.3g}"
    paired = [dict(zip(result["paired_columns"], row)) for row in result["paired_rows"] if row[1] == "W8A8 - fp32"]
    mean, low, high = _t_interval([a - b for a, b in zip(drops["dot"], drops["scaled_dot"])])
    assert [(r["comparison"], r["difference"], r["95% CI"]) for r in paired] == [
        ("digits, dot vs scaled_dot", f"{mean:+.3g}", f"{low:.3g} to {high:.3g}")
    ]
    assert paired[0]["p (paired t)"] == f"{stats.ttest_rel(drops['dot'], drops['scaled_dot']).pvalue:.2g}"


def test_a_run_scored_without_w8a8_shows_no_change(monkeypatch, tmp_path):
    from experiments.compare import build_report, find_runs

    monkeypatch.chdir(ROOT)
    root = _sweep_with(tmp_path, {"scaled_dot": [0.9, 0.8, 0.85]})
    result = build_report(find_runs([str(root)]), tmp_path / "report")
    assert [dict(zip(result["columns"], row))["W8A8 - fp32"] for row in result["rows"]] == ["-"] * 3
