"""Tracking without a network: the W&B mode decision, the nested config W&B receives, logger folders."""

import csv
import json
import math
import os
import re
import socket
from pathlib import Path

import pytest
import yaml
from conftest import LM_SMALL, config_args
from jsonargparse import Namespace
from wandb_stub import WandbRun

from experiments import tracking
from experiments.tracking import WandbLogger, prepare, wandb_mode

DIGITS = "configs/vision/digits.yaml"


def _fit_digits(attnlab, root, *args: str, batches: int, val_batches: int = 1) -> tuple[int, str, str]:
    """`attnlab fit` of the digits config in ``root`` for one epoch of ``batches`` training and ``val_batches``
    validation batches, then ``args``: (exit code, stdout, stderr)."""
    limits = (f"--trainer.limit_train_batches={batches}", f"--trainer.limit_val_batches={val_batches}")
    return attnlab("fit", *config_args(DIGITS, root, "--trainer.max_epochs=1", *limits, *args))


def test_wandb_mode_is_offline_unless_the_user_configured_wandb(tmp_path):
    empty = tmp_path / "none"
    assert wandb_mode({}, netrc_file=str(empty)) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "x" * 40}, netrc_file=str(empty)) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x" * 40}) == "disabled"  # the environment wins
    assert wandb_mode({"WANDB_MODE": "dryrun"}) == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_mode({}, netrc_file=str(netrc)) == "online"
    netrc.write_text("machine example.com login a password b\n")
    assert wandb_mode({}, netrc_file=str(netrc)) == "offline"


def test_the_logger_never_sets_wandb_mode_for_the_process(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = WandbLogger(mode="offline")
    assert logger._wandb_init["mode"] == "offline" and not logger._offline
    assert os.environ["WANDB_MODE"] == "disabled"


def test_the_resolved_config_reaches_wandb_nested_with_linked_values(attnlab, tmp_path, monkeypatch):
    """LoggedConfig hands W&B the CLI config as one nested dict (no flat copies) and the config file."""
    run = WandbRun()
    monkeypatch.setattr(WandbLogger, "experiment", property(lambda self: run))
    logger = "--trainer.logger=[{class_path: experiments.tracking.WandbLogger, init_args: {mode: offline}}]"  # the run is the stub above
    code, _, err = _fit_digits(attnlab, tmp_path, logger, batches=1)
    assert code == 0, err
    assert set(run.config) >= {"trainer", "model", "data", "seed_everything"} and "lr" not in run.config
    init_args = run.config["model"]["init_args"]
    assert (
        init_args["patch_size"] == 2 and init_args["num_classes"] == 10 and init_args["img_size"] == 8
    )  # linked from the data
    assert run.config["trainer"]["default_root_dir"] == str(tmp_path)
    saved = yaml.safe_load(open(run.saved[0]))
    assert saved["model"]["init_args"]["embed_dim"] == 64
    assert {"attention/sink_mass", "attention/sink_heads", "attention/out_max", "attention/out_kurtosis"} <= set(
        run.logged
    )  # the model summary of the attention statistics at the end


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.mark.slow
def test_an_unreachable_wandb_server_falls_back_to_offline_and_says_so_once(attnlab, tmp_path, monkeypatch):
    """WANDB_MODE=online with a key, but the server refuses connections: the run trains and logs offline."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    # wandb's own "logged in as" line asks the server who the key belongs to first, in a wait of its own (10 s)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = "--trainer.logger=[{class_path: experiments.tracking.WandbLogger, init_args: {init_timeout: 1}}]"
    wandb.teardown()  # wandb reads the environment once per process: from here on, this test's
    try:
        code, out, err = _fit_digits(attnlab, tmp_path, logger, batches=2)
    finally:
        wandb.finish()  # Lightning leaves the run open: later tests would reuse it
        wandb.teardown()  # and read their own environment
    assert code == 0, err
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    assert err.count("attnlab: W&B online run could not start (") == 1
    assert f"logging offline to {offline}; upload it later with `wandb sync {offline}`" in err
    assert os.environ["WANDB_MODE"] == "online"  # the fallback is this logger's, not the process's
    assert json.loads(next(tmp_path.glob("**/summary.json")).read_text())["wandb"][0]["mode"] == "offline"


def test_a_wandb_mode_that_does_not_exist_is_one_line_before_training(attnlab, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "onlin")
    code, _, err = attnlab(
        "fit",
        "--config",
        DIGITS,
        "--config",
        "configs/logger/wandb.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_epochs=1",
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "attnlab: error: trainer.logger: W&B mode='onlin'; expected online, offline or disabled (WANDB_MODE)"
    )
    assert not list(tmp_path.glob("**/*.ckpt"))


def test_prepare_puts_loggers_in_the_experiment_folder():
    cfg = Namespace(
        fit=Namespace(
            ckpt_path=None,
            trainer=Namespace(
                default_root_dir="runs/x",
                logger=[
                    Namespace(
                        class_path="experiments.tracking.CSVLogger",
                        init_args=Namespace(save_dir=None, name="lightning_logs"),
                    ),
                    Namespace(class_path="experiments.tracking.WandbLogger", init_args=Namespace(save_dir="elsewhere")),
                ],
            ),
        )
    )
    prepare(cfg, "fit")
    assert cfg.fit.trainer.logger[0].init_args.save_dir == "runs/x"
    assert cfg.fit.trainer.logger[1].init_args.save_dir == "elsewhere"  # an explicit folder stays


def test_prepare_resumes_the_last_run_into_its_folder_and_wandb_run(tmp_path, capsys):
    run = tmp_path / "lightning_logs" / "version_3"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    runs = [{"id": "off", "mode": "disabled"}, {"id": "abc", "mode": "offline"}]
    (run / "summary.json").write_text(json.dumps({"wandb": runs}))
    csv_logger = Namespace(class_path="experiments.tracking.CSVLogger", init_args=Namespace(name="lightning_logs"))
    wandb = Namespace(class_path="experiments.tracking.WandbLogger", init_args=Namespace(id=None))
    cfg = Namespace(ckpt_path="last", trainer=Namespace(default_root_dir=str(tmp_path), logger=[csv_logger, wandb]))
    prepare(Namespace(fit=cfg), "fit")
    assert (
        cfg.ckpt_path == str(run / "checkpoints" / "last.ckpt") and "attnlab: resuming from" in capsys.readouterr().err
    )
    assert csv_logger.init_args.version == "version_3" and wandb.init_args.id == "abc"


def test_default_callbacks_are_fresh_objects():
    first, second = tracking.default_callbacks(), tracking.default_callbacks()
    assert [type(c).__name__ for c in first] == [
        "Throughput",
        "GradientNorm",
        "RunSummary",
        "NonFiniteLoss",
        "ExactResume",
        "LastCheckpoint",
        "TimeBudget",
        "LearningRateLog",
    ]
    assert all(a is not b for a, b in zip(first, second))


def test_summary_of_a_tiny_run(attnlab, tmp_path):
    code, _, err = _fit_digits(attnlab, tmp_path, "--trainer.log_every_n_steps=1", batches=4, val_batches=2)
    assert code == 0, err
    run = tmp_path / "lightning_logs" / "version_0"
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "finished" and s["modality"] == "vision" and s["dataset"] == "DigitsDataModule"
    assert s["params"]["total"] == s["params"]["trainable"] > 100_000
    assert s["global_step"] == 4 and s["best"]["monitor"] == "val/acc" and 0 <= s["best"]["value"] <= 1
    # 4 layers x 4 heads; [CLS] + 16 patches of 2x2 pixels on an 8x8 image
    final = s["attention"]["final"]
    assert [layer["name"] for layer in final["layers"]] == [f"encoder.layers.{i}.self_attn" for i in range(4)]
    assert all(
        len(layer["entropy"]) == 4 and 0 < min(layer["entropy"]) and max(layer["entropy"]) <= math.log(17)
        for layer in final["layers"]
    )  # <= log 17
    assert all(0 < d < 8 * 2**0.5 for layer in final["layers"] for d in layer["distance"])
    assert s["attention"]["init"]["layers"][0]["name"] == "encoder.layers.0.self_attn"
    # the model's sinks and outliers reach the loggers (here metrics.csv) as summary.json reduces them
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    logged = {
        k.removeprefix("attention/"): float(v) for r in rows for k, v in r.items() if k.startswith("attention/") and v
    }
    assert logged == {k: pytest.approx(v) for k, v in final["summary"].items() if v is not None}
    assert logged.keys() == {"sink_mass", "sink_heads", "out_max", "out_kurtosis"}  # no registers in this ViT
    assert (
        s["throughput"]["tokens_per_s"] == pytest.approx(s["throughput"]["samples_per_s"] * 17)
        and s["throughput"]["tokens_per_s"] > 0
    )
    assert s["flops_per_sample"] > 0 and s["grad_norm"]["first"] > 0
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"perf/samples_per_s", "perf/tokens_per_s", "train/grad_norm", "train/loss", "val/acc"} <= set(header)
    # LearningRateMonitor's keys, one per parameter group of AdamW (decayed matrices, the rest)
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2"} <= set(header)
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    lrs = [float(r["lr-AdamW/pg1"]) for r in rows if r.get("lr-AdamW/pg1")]
    assert len(lrs) == 4 and lrs[-1] > lrs[0] >= 0  # at each of the 4 steps, rising in the warmup
    assert (run / "attention.png").stat().st_size > 0


def test_the_trainer_takes_lightnings_profilers_and_profiles_nothing_by_default(capsys):
    from experiments.cli import main

    def printed(*args):
        with pytest.raises(SystemExit):
            main(["fit", "--config", DIGITS, *args, "--print_config"])
        return yaml.safe_load(capsys.readouterr().out)["trainer"]["profiler"]

    assert printed() is None  # Lightning's default: its pass-through profiler
    assert printed("--trainer.profiler=simple") == "simple"


def readme_logged_keys() -> list[str]:
    """The keys the README promises in every modality's metrics.csv."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = re.search(r"Logged keys are the same in every modality:\s*((?:`[^`]+`[,.]?\s*)+)", readme)
    return re.findall(r"`([^`]+)`", listed.group(1))


ONE_STEP_EACH = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1")
MODALITIES = {
    "vision": ("configs/vision/digits.yaml", "--model.init_args.depth=1"),
    "translation": ("configs/text/toy_en_de.yaml", "--data.init_args.cache_dir={tmp}/data"),
    "language model": (
        "configs/text/shakespeare_char_cpu.yaml",
        "--data.init_args.cache_dir={tmp}/data",
        "--data.init_args.path=null",
        *LM_SMALL,
    ),
    "detection": (
        "configs/detection/shapes.yaml",
        "--data.data_dir={tmp}/data",
        "--data.num_train=8",
        "--data.num_val=4",
        "--data.batch_size=4",
        "--trainer.check_val_every_n_epoch=1",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("modality", MODALITIES)
def test_metrics_csv_has_the_readmes_logged_keys_in_every_modality(attnlab, tmp_path, modality):
    config, *overrides = MODALITIES[modality]
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    code, _, err = attnlab(
        "fit", *config_args(config, tmp_path, *ONE_STEP_EACH, "--trainer.log_every_n_steps=1", *overrides)
    )
    assert code == 0, err
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    promised = readme_logged_keys()
    assert "train/loss" in promised and "val/<metric>" in promised
    keys = {"val/<metric>" if key.startswith("val/") else key for key in header}
    assert set(promised) <= keys, f"{modality}: {sorted(set(promised) - keys)} not in metrics.csv"
    # Lightning names a value logged both per step and per epoch KEY_step and KEY_epoch
    assert not [key for key in header if key.endswith(("_step", "_epoch"))]
