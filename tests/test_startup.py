"""`attnlab --help`, `attnlab compare` and `attnlab sweep --help` start without Lightning, torch or the models (each
run in a fresh interpreter that then names what it imported), every subcommand is described by a whole sentence, and
`attnlab` as a process leaves the garbage collector nothing to pass over when it exits."""

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "pytorch_lightning", "lightning_fabric", "torchmetrics", "timm", "transformers", "models"}


def run_fresh(args: list[str]) -> tuple[str, set[str]]:
    """`attnlab ARGS` in a new interpreter: its output, and the top-level packages of HEAVY it imported."""
    script = f"""
import json, sys
from experiments.cli import main
try:
    main({args!r})
except SystemExit as exit_:
    assert not exit_.code, exit_.code
print(json.dumps(sorted({{name.partition(".")[0] for name in sys.modules}})))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "1000"}  # one line per subcommand in --help
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    *out, imported = done.stdout.splitlines()
    return "\n".join(out), HEAVY & set(json.loads(imported))


@pytest.mark.parametrize("args", [["--help"], ["-c", "any.yaml", "-h"], ["compare", "--help"], ["sweep", "--help"]])
def test_help_imports_neither_lightning_nor_torch_nor_the_models(args):
    _, imported = run_fresh(args)
    assert imported == set()


def test_compare_reads_run_folders_without_lightning_torch_or_the_models(tmp_path):
    run = tmp_path / "runs" / "digits" / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    summary = {"status": "finished", "modality": "vision", "best": {"monitor": "val/acc", "value": 0.5}}
    (run / "summary.json").write_text(json.dumps(summary))
    out, imported = run_fresh(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "report")])
    assert "val/acc = 0.5" in out and (tmp_path / "report" / "report.md").is_file()
    assert imported == set()


def listed_subcommands(help_text: str) -> dict[str, str]:
    """The `name  description` lines of `attnlab --help` (printed 1000 columns wide: one line each)."""
    return dict(re.findall(r"^ {4}(\w+) +(\S.*)$", help_text, re.M))


@pytest.fixture(scope="module")
def listed() -> dict[str, str]:
    return listed_subcommands(run_fresh(["--help"])[0])


def test_every_subcommand_is_listed_with_a_whole_sentence(listed):
    assert set(listed) == {"fit", "validate", "test", "predict", "compare", "sweep"}
    for name, line in listed.items():
        assert line.endswith("."), f"{name}: {line!r} stops mid-sentence"


@pytest.mark.parametrize("name", ["fit", "validate", "test", "predict"])
def test_a_trainer_subcommands_help_opens_with_the_line_attnlab_help_lists(attnlab, monkeypatch, listed, name):
    monkeypatch.setenv("COLUMNS", "1000")
    code, out, _ = attnlab(name, "--help")
    assert code == 0 and f"\n{listed[name]}\n" in out


def test_only_the_process_entry_freezes_what_it_made_before_the_interpreter_exits(attnlab):
    """`attnlab` as a process (``main()`` on sys.argv) leaves the garbage collector nothing to pass over at exit;
    ``main(args)`` called in a longer-lived process (these tests, a sweep's in-process runs) must leave it whole."""
    script = "import gc, sys\nfrom experiments.cli import main\nsys.argv = ['attnlab', '--help']\nmain()\n"
    script += "print(gc.get_freeze_count())"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and int(done.stdout.splitlines()[-1]) > 1000, done.stderr
    before = gc.get_freeze_count()
    assert attnlab("--help")[0] == 0 and gc.get_freeze_count() == before
