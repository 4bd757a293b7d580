"""Two-process DDP on CPU (gloo) through the real CLI, one run per modality on tiny data.

The ViT run is `attnlab fit --trainer.devices=2` in a process of its own (`processes.CLIProcess`: as started by
the `attnlab` script), with Lightning's launcher starting the second as it would for a user: `python attnlab ARGS`
(a DDP launch inside pytest would re-run pytest in the child): two processes with half the batch each must
follow the same loss curve as one process with the whole batch. DDP averages the gradients of the two halves, which
is the gradient of the whole batch (dropout off, same sample order via DistributedSampler). The text and detection
runs start their two processes as torchrun does (`processes.torchrun`).
"""

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from processes import CLIProcess, torchrun, wait_all

pytestmark = pytest.mark.slow  # every test launches DDP runs of the CLI in subprocesses
ROOT = Path(__file__).resolve().parents[1]
TINY = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.accelerator=cpu",
    "--trainer.strategy=ddp",
    "--trainer.log_every_n_steps=1",
)
PROBE = '''
import json
import pytorch_lightning as pl


class GlobalLoss(pl.Callback):
    """The training loss of the whole (global) batch at every step, written by rank 0."""

    def __init__(self, output: str):
        self.output, self.losses = output, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean")))

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            json.dump({"losses": self.losses, "world_size": trainer.world_size}, open(self.output, "w"))
'''


def environment(tmp_path: Path, wandb: str = "disabled") -> dict[str, str]:
    """This process's environment for a run in ``tmp_path`` (which is on the Python path) with W&B in mode ``wandb``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_MODE=wandb,
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        WANDB_BASE_URL="http://127.0.0.1:9",  # nothing reaches a network
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
    )
    return env


def val_column(run: Path, key: str) -> list[float]:
    return [float(r[key]) for r in csv.DictReader((run / "metrics.csv").open()) if r.get(key)]


def test_vit_two_processes_with_half_batches_follow_one_process_with_full_batches(attnlab, tmp_path, monkeypatch):
    """The one-process run is in-process (`strategy: auto`, the same ResumableSampler order as DDP's
    DistributedSampler); the two-process one is a DDP launch of the CLI."""
    (tmp_path / "ddp_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    common = (
        "--config",
        "configs/vision/digits.yaml",
        *TINY,
        "--model.init_args.drop_rate=0",
        "--model.init_args.drop_path_rate=0",
    )
    runs = {}
    for devices, batch in ((1, 32), (2, 16)):
        root = tmp_path / f"devices{devices}"
        probe = (
            f"--trainer.callbacks+={{class_path: ddp_probe.GlobalLoss, init_args: {{output: {root / 'losses.json'}}}}}"
        )
        args = (
            *common,
            *(("--config", "configs/logger/wandb.yaml") if devices == 2 else ("--trainer.strategy=auto",)),
            f"--trainer.default_root_dir={root}",
            f"--trainer.devices={devices}",
            f"--data.init_args.batch_size={batch}",
            probe,
        )
        if devices == 1:
            code, _, err = attnlab("fit", *args)
            assert code == 0, err[-3000:]
        else:
            launch = CLIProcess(["fit", *args], environment(tmp_path, wandb="offline"), tmp_path / "logs")
            assert launch.wait(timeout=400) == 0, launch.stderr()[-3000:]
        runs[devices] = (root, json.loads((root / "losses.json").read_text()))
    (one, curve1), (two, curve2) = runs[1], runs[2]
    assert curve1["world_size"] == 1 and curve2["world_size"] == 2 and len(curve1["losses"]) == 4
    assert curve2["losses"] == pytest.approx(curve1["losses"], rel=1e-5, abs=1e-6)
    run1, run2 = one / "lightning_logs" / "version_0", two / "lightning_logs" / "version_0"
    assert val_column(run2, "val/loss") == pytest.approx(
        val_column(run1, "val/loss"), rel=1e-5
    )  # sync_dist: the mean over both halves
    w1 = torch.load(run1 / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    w2 = torch.load(run2 / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    # 1e-4, not 1e-6: the key bias gets a zero gradient in exact arithmetic (softmax ignores a shift), and
    # Adam turns the rounding noise left in it into steps of up to lr; every other weight agrees to 1e-6
    assert all(torch.allclose(w1[k], w2[k], atol=1e-4) for k in w1)
    # only rank 0 made a W&B run (offline, in the experiment folder) and wrote the run folder
    assert len(list((two / "wandb").glob("offline-run-*"))) == 1 and sorted(
        p.name for p in (two / "lightning_logs").iterdir()
    ) == ["version_0"]
    summary = json.loads((run2 / "summary.json").read_text())
    assert (
        summary["trainer"]["world_size"] == 2
        and summary["wandb"][0]["mode"] == "offline"
        and summary["status"] == "finished"
    )
    assert "wandb sync" in launch.out.read_text()
    # the nested, resolved config is in the offline run's record
    record = next((two / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    assert b'"init_args"' in record and b'"patch_size"' in record


MODALITIES = {
    "text": ("configs/text/toy_en_de.yaml", ()),
    "detection": (
        "configs/detection/shapes.yaml",
        (
            "--data.init_args.num_train=32",
            "--data.init_args.num_val=8",
            "--data.init_args.num_test=8",
            "--data.init_args.batch_size=4",
            "--trainer.check_val_every_n_epoch=1",
        ),
    ),
}


@pytest.mark.parametrize("modality", sorted(MODALITIES))
def test_two_process_run(tmp_path, modality):
    config, extra = MODALITIES[modality]
    if not (ROOT / config).exists():
        pytest.skip(f"{config} is not in the repository")
    data_dir = ("--data.init_args.data_dir=" + str(tmp_path / "data"),) if modality == "detection" else ()
    run_root = f"--trainer.default_root_dir={tmp_path / 'run'}"
    args = ["fit", "--config", config, *TINY, *extra, *data_dir, "--trainer.devices=2", run_root]
    ranks = torchrun(args, environment(tmp_path), tmp_path / "logs")
    assert wait_all(ranks, timeout=300) == [0, 0], ranks[0].stderr()[-3000:] + ranks[1].stderr()[-3000:]
    # the metrics logged at an epoch's end are already over both ranks; Lightning is not left to suspect otherwise
    assert not [line for r in ranks for line in r.stderr().splitlines() if "sync_dist=True" in line]
    run = tmp_path / "run" / "lightning_logs" / "version_0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["trainer"]["world_size"] == 2 and summary["modality"] == modality
    assert summary["global_step"] == 4 and summary["best"]["value"] is not None
    assert val_column(run, "val/loss") and summary["attention"]["final"]["layers"]
