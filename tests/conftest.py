import collections
import gc
import os
from pathlib import Path

import pytest

os.environ["WANDB_MODE"] = "disabled"  # tests never start a W&B run
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")  # spawned DDP workers too

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


def tiny_detector(**network) -> dict:
    """`ObjectDetector`'s arguments for the tests' tiny DETR on `TINY_TRUNK`: 3 classes, 4 queries, then ``network``
    (`from conftest import tiny_detector`)."""
    trunk = dict(name="backbone", out_index="backbone_out_index", norm="backbone_norm")
    trunk |= dict(trainable_layers="trainable_backbone_layers")
    return dict(
        num_classes=3,
        **{ours: TINY_TRUNK[key] for key, ours in trunk.items()},
        backbone_kwargs={k: TINY_TRUNK[k] for k in ("layers", "channels", "stem_width")},
        num_queries=4,
        **network,
    )


# configs/text/shakespeare_char_cpu.yaml at nanoGPT's CPU-example size (4 x 128, context 64, batch 12), validated
# in every epoch: the language-model CLI tests' overrides (`from conftest import LM_SMALL`)
LM_SMALL = (
    "--model.init_args.d_model=128",
    "--data.init_args.block_size=64",
    "--model.init_args.max_positions=64",
    "--data.init_args.batch_size=12",
    "--trainer.check_val_every_n_epoch=1",
    "--trainer.precision=32-true",
)

# the smallest ViT and DETR the CLI tests train (`from conftest import TINY_VIT, TINY_DETR`)
TINY_VIT = ("--model.init_args.depth=1", "--model.init_args.embed_dim=16", "--model.init_args.num_heads=2")
TINY_DETR = (
    "--model.init_args.d_model=16",
    "--model.init_args.nhead=2",
    "--model.init_args.num_encoder_layers=1",
    "--model.init_args.num_decoder_layers=1",
    "--model.init_args.dim_feedforward=32",
    "--model.init_args.num_queries=4",
    "--model.init_args.backbone_kwargs={layers: [1, 1, 1, 1], channels: [8, 16, 32, 64], stem_width: 8}",
)


def config_args(config: str, root: Path | str, *overrides: str) -> tuple[str, ...]:
    """The `attnlab` arguments of a run of ``config`` whose run folder (``trainer.default_root_dir``) is ``root``,
    then ``overrides`` (`from conftest import config_args`)."""
    return ("--config", config, f"--trainer.default_root_dir={root}", *overrides)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Test tensors are tiny: one thread avoids oversubscribing CI's 2 cores (5-15x faster under load). A fixture, so
    that pytest-xdist's controller, which runs no test, starts its workers without importing torch first."""
    import torch

    torch.set_num_threads(1)


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


def pytest_collection_modifyitems(config, items):
    """The files with the most `slow` tests first, each file's tests in their order. `make test` hands files to its
    workers in this order (pytest-xdist --dist loadfile --no-loadscope-reorder), so both workers end on small files;
    xdist's own order (most tests first) left a 20-s one-test file to the end of one worker."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    first = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
    items.sort(key=lambda item: (-slow[item.path], first[item.path]))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The process exits next (a worker, or plain pytest): what the tests made is frozen out of the garbage collector,
    whose passes over it while the interpreter shuts down took seconds (`experiments.cli.main` does the same)."""
    gc.freeze()


def pytest_collection_finish(session):
    """What collection imported (torch, Lightning, the models, the test modules) lives as long as the process: frozen
    out of the garbage collector, so that its full passes during the tests go over what the tests made only."""
    gc.collect()
    gc.freeze()
