import os

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"  # tests never start a W&B run
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned DDP workers too
# Test tensors are tiny: one thread avoids oversubscribing CI's 2 cores (5-15x faster under load).
torch.set_num_threads(1)

# A 1-block-per-stage ResNet-18 of 8-64 channels, trained whole, for DETR tests (`Backbone`'s arguments;
# `from conftest import TINY_TRUNK`): layer3's output, stride 16.
TINY_TRUNK = dict(
    name="resnet18",
    out_index=3,
    norm="bn",
    trainable_layers=5,
    layers=[1, 1, 1, 1],
    channels=[8, 16, 32, 64],
    stem_width=8,
)


@pytest.fixture
def attnlab(capsys):
    """Run the real `attnlab` CLI in-process; returns (exit code, stdout, stderr)."""
    from experiments.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            main(list(args))
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err

    return run
