"""Every YAML in configs/ runs through the real CLI with fast_dev_run, so no config can rot.

Configs under configs/trainer and configs/logger are pieces composed onto an experiment; they run
on top of the embedded digits experiment.
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# configs/sweeps holds `attnlab sweep` files, not fit configs: tests/test_sweep.py checks every one of them
CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "sweeps")
PIECES = ("trainer", "logger")
# The paper's DETR-R50 resizes to 800-1333 px, and the one-GPU recipes take 64-256 examples a batch in 12 loader
# processes (one batch of the ViT-S/16 overhead config, 256 images of 224 px, took 97 s here): the same configs, on
# small images and small batches in the main process, keep this test fast (the text recipes too: 128 sentences a
# batch, or 32 blocks of 256 characters).
SMALL_DETR = [
    "--data.init_args.train_scales=[64]",
    "--data.init_args.val_size=64",
    "--data.init_args.max_size=96",
    "--data.init_args.batch_size=2",
]
SMALLER = {
    "configs/text/multi30k_en_de.yaml": ["--data.init_args.batch_size=8"],
    "configs/text/shakespeare_char.yaml": ["--data.init_args.batch_size=2", "--data.init_args.block_size=64"],
    "configs/text/shakespeare_char_cpu.yaml": ["--data.init_args.batch_size=2", "--data.init_args.block_size=64"],
    "configs/vision/fashion_mnist.yaml": ["--data.init_args.batch_size=8", "--data.init_args.num_workers=0"],
    "configs/vision/vit_s16_random.yaml": ["--data.init_args.batch_size=2", "--data.init_args.num_workers=0"],
    "configs/vision/timm_finetune.yaml": ["--data.init_args.batch_size=2", "--data.init_args.num_workers=0"],
    "configs/detection/coco.yaml": [*SMALL_DETR, "--data.init_args.crop=false"],
    "configs/detection/bccd.yaml": SMALL_DETR,
    "configs/detection/bccd_finetune.yaml": SMALL_DETR,
    # the pieces' last callback: Compile traces without generating code (inductor takes 25-40 s on a CPU), CUDA graphs
    # (reduce-overhead) are inductor's; Float8Training emulates float8 on the CPU (tests/test_float8.py)
    "configs/trainer/gpu.yaml": ["--trainer.callbacks.backend=eager"],
    "configs/trainer/gpu_cudagraphs.yaml": ["--trainer.callbacks.backend=eager", "--trainer.callbacks.mode=null"],
    "configs/trainer/fp8.yaml": ["--trainer.callbacks.emulate=true"],
}


def test_configs_exist():
    assert Path("configs/vision/digits.yaml") in CONFIGS


@pytest.mark.slow  # a fit through the CLI: seconds for the larger recipes, 45 s for all of them
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_config_runs_one_batch(attnlab, tmp_path, monkeypatch, config):
    monkeypatch.chdir(ROOT)  # data paths in configs are relative to the repository root
    missing = [p for p in re.findall(r"\.\./shared/data(?:/[\w./-]+)?", config.read_text()) if not Path(p).exists()]
    if missing:  # real datasets sit beside the repository in CI, not on every machine
        pytest.skip(f"{config} reads {missing[0]}, which is not on this machine (see ../shared/data/SOURCES.md)")
    if config.name == "fp8.yaml" and importlib.util.find_spec("torchao") is None:
        pytest.skip(f"{config} needs torchao, which is not installed: pip install -e '.[dev]'")
    stack = ["--config", "configs/vision/digits.yaml"] if config.parts[1] in PIECES else []
    code, _, err = attnlab(
        "fit",
        *stack,
        "--config",
        str(config),
        *SMALLER.get(str(config), []),
        "--trainer.fast_dev_run=true",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert code == 0, err
