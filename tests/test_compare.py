"""`attnlab compare` on two tiny real runs that differ only in the similarity function."""
import json

import pytest

DIGITS = "configs/vision/digits.yaml"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    from experiments.cli import main

    root = tmp_path_factory.mktemp("runs")
    for similarity in ("scaled_dot", "dot"):
        main(["fit", "--config", DIGITS, f"--trainer.default_root_dir={root}/vision/{similarity}", "--trainer.max_epochs=1",
              "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=1",
              f"--model.init_args.similarity={similarity}"])
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
    assert code == 2 and f"attnlab: error: {tmp_path}: no finished run (summary.json) below it" in err


@pytest.mark.slow
def test_report_goes_to_wandb_as_a_table_and_images(attnlab, two_runs, tmp_path, monkeypatch):
    import wandb
    from wandb.sdk.lib.noop_run import NoopRun  # what wandb.init returns under WANDB_MODE=disabled

    logged = {}
    monkeypatch.setattr(NoopRun, "log", lambda self, data, *a, **k: logged.update(data), raising=False)
    code, out, err = attnlab("compare", str(two_runs), "--out", str(tmp_path / "report"), "--wandb", "team/attnlab")  # WANDB_MODE=disabled
    assert code == 0, err
    assert isinstance(logged["compare/runs"], wandb.Table) and len(logged["compare/runs"].data) == 2
    assert {"compare/loss", "compare/entropy", "compare/distance", "compare/scaling"} <= set(logged) and "attnlab: W&B:" in out
