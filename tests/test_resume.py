"""`attnlab fit --ckpt_path last` continues the stopped run: same folder, step counter and optimizer state."""

import csv
import json

import pytest
import torch

DIGITS = "configs/vision/digits.yaml"
ONE_EPOCH = ("--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1")


@pytest.mark.slow
def test_fit_ckpt_path_last_continues_the_run(attnlab, tmp_path, recwarn):
    root = f"--trainer.default_root_dir={tmp_path}"
    code, _, err = attnlab("fit", "--config", DIGITS, root, "--trainer.max_epochs=1", *ONE_EPOCH, "--ckpt_path", "last")
    assert code == 0, err
    assert "no 'last*.ckpt'" in err and "starting a new run" in err  # the same command starts a run ...
    run = tmp_path / "lightning_logs" / "version_0"
    first = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert first["global_step"] == 3

    code, _, err = attnlab("fit", "--config", DIGITS, root, "--trainer.max_epochs=2", *ONE_EPOCH, "--ckpt_path", "last")
    assert code == 0, err
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in err  # ... and continues it
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]  # same run folder
    second = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert second["global_step"] == 6 and second["epoch"] > first["epoch"]
    adam = second["optimizer_states"][0]["state"]
    assert all(int(s["step"]) == 6 for s in adam.values())  # Adam's moments kept counting: restored, not restarted
    steps = [int(r["step"]) for r in csv.DictReader((run / "metrics.csv").open()) if r.get("train/loss")]
    assert steps == [0, 1, 2, 3, 4, 5]  # the first run's rows are kept and the counter goes on
    assert not [w for w in recwarn if "will be deleted" in str(w.message)]  # nor does a warning say otherwise
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["resumed_from"].endswith("last.ckpt")
        and summary["global_step"] == 6
        and summary["status"] == "finished"
    )
