"""Two-process FSDP on CPU (gloo) through the real CLI: every forward pass outside the training steps
(attention statistics, FLOPs and attention figure of the run summary, sample text, DETR's validation
drawings, ViT attention maps) runs on sharded weights without a hang or a crash, and the configs'
gradient clipping by norm works (Lightning's FSDP plugin refuses it; the modules clip through FSDP).

Lightning refuses ``strategy: fsdp`` without a GPU, and torch's FSDP refuses a CPU module unless told
its device: the strategy below only passes ``device_id=cpu``; it is Lightning's FSDPStrategy otherwise
(one FSDP unit over the whole LightningModule, as ``--trainer.strategy=fsdp`` gives). Between the steps
the weights are sharded, so a forward pass run directly on the model fails unless every process
gathers them first (`models.distributed.full_weights`). The two processes are started as torchrun starts
them (`processes.torchrun`).
"""

import json
import os

import pytest
from conftest import LM_SMALL
from processes import torchrun, wait_all

STRATEGY = """
import torch
from pytorch_lightning.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel


class CPUFSDP(FSDPStrategy):
    def _setup_model(self, model):
        return FullyShardedDataParallel(module=model, device_id=torch.device("cpu"), sharding_strategy=self.sharding_strategy, **self.kwargs)
"""
TINY = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=2",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.accelerator=cpu",
    "--trainer.devices=2",
    "--trainer.log_every_n_steps=1",
)
RUNS = {
    "translation": (
        "configs/text/toy_en_de.yaml",
        ("--data.init_args.cache_dir={data}",),
        ("val_samples.md", "val_sacrebleu_signature.md"),
    ),
    "language_model": (
        "configs/text/shakespeare_char_cpu.yaml",
        (
            "--data.init_args.cache_dir={data}",
            "--data.init_args.path=null",
            "--trainer.callbacks.tokens=20",
            "--trainer.val_check_interval=2",
            *LM_SMALL,
        ),
        ("val_samples.md",),
    ),
    "detection": (
        "configs/detection/shapes.yaml",
        (
            "--data.init_args.data_dir={data}",
            "--data.init_args.num_train=8",
            "--data.init_args.num_val=4",
            "--data.init_args.batch_size=2",
            "--trainer.check_val_every_n_epoch=1",
        ),
        ("val_images/epoch0000_image1.png",),
    ),
    "vision": (
        "configs/vision/digits.yaml",
        ("--trainer.callbacks+=experiments.callbacks.AttentionMapLogger", "--trainer.callbacks.num_images=2"),
        ("attention_maps/epoch_0/image_0.png",),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(RUNS))
def test_fsdp_run_on_two_cpu_processes(tmp_path, run):
    config, extra, files = RUNS[run]
    (tmp_path / "cpu_fsdp.py").write_text(STRATEGY)
    (tmp_path / "fsdp.yaml").write_text("trainer:\n  strategy:\n    class_path: cpu_fsdp.CPUFSDP\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="disabled", PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    args = [
        "fit",
        "--config",
        config,
        "--config",
        str(tmp_path / "fsdp.yaml"),
        *TINY,
        *(a.format(data=tmp_path / "data") for a in extra),
        f"--trainer.default_root_dir={tmp_path / 'run'}",
    ]
    ranks = torchrun(args, env, tmp_path / "logs")
    try:
        codes = wait_all(ranks, timeout=300)
    except TimeoutError:  # a forward pass on one process only waits for the other forever
        pytest.fail(f"the FSDP {run} run hung")
    assert codes == [0, 0], ranks[0].stderr()[-3000:] + ranks[1].stderr()[-3000:]
    version = tmp_path / "run" / "lightning_logs" / "version_0"
    summary = json.loads((version / "summary.json").read_text())
    assert (
        summary["status"] == "finished"
        and summary["trainer"]["world_size"] == 2
        and summary["trainer"]["strategy"] == "CPUFSDP"
    )
    assert (
        summary["attention"]["init"]["layers"]
        and summary["attention"]["final"]["layers"]
        and summary["flops_per_sample"] > 0
    )
    assert (version / "attention.png").is_file()
    for name in files:
        assert (version / name).is_file(), name
