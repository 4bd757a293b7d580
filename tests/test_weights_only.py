"""`--weights_only false`: the user's trust in a checkpoint that `--ckpt_path last` or `best` finds. By default
such a checkpoint holding a pickled object is refused before any of it runs; with the flag it is unpickled and
used. A file named in `--ckpt_path` is read as tensors only either way."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from experiments.cli import main

DIGITS = "configs/vision/digits.yaml"
TINY = (
    "--trainer.accelerator=cpu",
    "--trainer.limit_train_batches=3",
    "--trainer.limit_val_batches=1",
    "--trainer.limit_test_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_model_summary=false",
    "--model.init_args.depth=1",
    "--model.init_args.embed_dim=16",
    "--model.init_args.num_heads=2",
)
REFUSED = "was refused: it holds pickled code or objects other than tensors (posix.system); "


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``: not plain data, and its unpickling shows."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    """A run folder after a one-epoch fit: best.ckpt and last.ckpt at global step 3."""
    root = tmp_path_factory.mktemp("fitted")
    main(["fit", "--config", DIGITS, f"--trainer.default_root_dir={root}", "--trainer.max_epochs=1", *TINY])
    return root


@pytest.mark.parametrize(
    "subcommand, alias, printed",
    [
        ("test", "best", "test/acc"),
        ("validate", "last", "val/acc"),
        ("fit", "last", "attnlab: best val/acc="),
    ],
)
def test_weights_only_false_unpickles_the_checkpoint_that_last_or_best_finds(
    attnlab, fitted, tmp_path, subcommand, alias, printed
):
    root = tmp_path / "run"
    shutil.copytree(fitted, root)
    found = root / "lightning_logs" / "version_0" / "checkpoints" / f"{alias}.ckpt"
    marker = tmp_path / "unpickled"
    checkpoint = torch.load(found, weights_only=True)
    torch.save({**checkpoint, "note": _Payload(marker)}, found)
    # fit goes on for a second epoch; an evaluation has one step
    args = (
        subcommand,
        "--config",
        DIGITS,
        f"--trainer.default_root_dir={root}",
        "--trainer.max_epochs=2",
        *TINY,
        "--ckpt_path",
        alias,
    )

    code, _, err = attnlab(*args)
    assert code == 2 and not marker.exists()
    assert err.strip().splitlines()[-1].startswith(f"attnlab: error: ckpt_path: {found} {REFUSED}")

    code, out, err = attnlab(*args, "--weights_only", "false")
    assert code == 0, err[-3000:]
    assert marker.exists() and printed in out  # unpickled (the user trusts this file), and the run went on
    if subcommand == "fit":
        assert torch.load(found, weights_only=True)["global_step"] == 6  # resumed at step 3, trained the second epoch


def test_a_checkpoint_named_in_ckpt_path_is_read_as_tensors_even_with_weights_only_false(attnlab, tmp_path):
    marker = tmp_path / "unpickled"
    named = tmp_path / "named.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": _Payload(marker)}}, named)
    code, _, err = attnlab(
        "test",
        "--config",
        DIGITS,
        f"--trainer.default_root_dir={tmp_path}",
        "--ckpt_path",
        str(named),
        "--weights_only",
        "false",
    )
    assert code == 2 and not marker.exists()
    assert err.strip().splitlines()[-1].startswith(f"attnlab: error: ckpt_path: {named} {REFUSED}")
