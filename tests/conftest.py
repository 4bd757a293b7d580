import os

import pytest

os.environ["WANDB_MODE"] = "disabled"  # tests never start a W&B run
os.environ["HF_HUB_OFFLINE"] = "1"


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
