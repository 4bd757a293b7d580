"""The steps of `benchmarks.gpu_check`, each run in a process of its own: what the machine is, the CUDA-marked
tests, and each part of the benchmarks' gpu section (`benchmarks.sections.GPU_PARTS`). Each writes its Markdown
to ``result`` and returns the process's exit status."""

from __future__ import annotations

import importlib
import platform
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# every package of ours, and the libraries a figure needs: each must import on the GPU machine
IMPORTS = (
    "models",
    "datamodules.detection.coco",
    "datamodules.vision.random_images",
    "experiments.trainer_cli",
    "experiments.callbacks",
    "experiments.tracking",
    "experiments.sweep.runs",
    "benchmarks.sections",
    "jsonargparse",
    "pycocotools.coco",
    "pytorch_lightning",
    "timm",
    "torchao.float8",
    "torchmetrics",
    "transformers",
)


def env_step() -> tuple[int, str]:
    """The device, the versions, and an import of each of `IMPORTS`."""
    rows = [["python", platform.python_version()], ["torch", torch.__version__]]
    rows.append(["device", torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA device)"])
    failed = 0
    for name in IMPORTS:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - every import is reported, then the step fails
            rows.append([name, f"import FAILED: {type(err).__name__}: {err}"])
            failed += 1
            continue
        rows.append([name, getattr(module, "__version__", "imported")])
    from experiments.compare.tables import markdown_table

    return int(failed > 0), "### The machine and the imports\n\n" + markdown_table(["what", "version"], rows)


def tests_step() -> tuple[int, str]:
    """pytest on the tests marked ``cuda`` (each outcome a row; they skip without CUDA)."""
    import pytest

    from experiments.compare.tables import markdown_table

    files = sorted(str(f) for f in (ROOT / "tests").glob("test_*.py") if "pytest.mark.cuda" in f.read_text())
    junit = Path(tempfile.mkdtemp()) / "junit.xml"
    code = pytest.main(["-m", "cuda", "-p", "no:cacheprovider", "-o", "addopts=", "-q", f"--junitxml={junit}", *files])
    rows = []
    for case in ET.parse(junit).iter("testcase"):
        outcome = next(iter(case), None)
        verdict = "passed" if outcome is None else outcome.tag
        message = "" if outcome is None else (outcome.get("message") or "").splitlines()[0][:160]
        rows.append([f"{case.get('classname')}::{case.get('name')}", verdict, message])
    junit.unlink()
    table = markdown_table(["test", "outcome", "message"], rows)
    return int(code != 0 or not rows), f"### The CUDA-marked tests (pytest -m cuda)\n\n{table}"


def part_step(name: str, rehearse: bool) -> tuple[int, str]:
    """One part of `python -m benchmarks --only gpu`, as that command runs it."""
    from benchmarks.run import parse_args, settings_of
    from benchmarks.sections import GPU_PARTS
    from experiments.cli import hub_offline_unless_asked

    # 6 samples a side on the GPU (the default 10 on --only gpu), so that every step fits gpu_check's budget
    device = ["--quick", "--device", "cpu", "--no-memory"] if rehearse else ["--device", "cuda", "--repeats", "6"]
    args = parse_args(["--only", "gpu", "--gpu-parts", name, "--output", "-", *device])
    torch.set_num_threads(args.threads)
    hub_offline_unless_asked()
    return 0, GPU_PARTS[name](settings_of(args), args)


def long_context_step(rehearse: bool) -> tuple[int, str]:
    """One causal layer at long context on the full and the chunked path (`benchmarks.long_context`): L = 8k, 16k
    and 32k on the GPU, the full path up to 16 GiB of weights; toy lengths on the CPU."""
    from benchmarks.long_context import table

    lengths, device, cap = ([256, 512], "cpu", 1.0) if rehearse else ([8192, 16384, 32768], "cuda", 16.0)
    title = f"### One causal layer at long context (D = 256, 8 heads, batch 1, forward + backward, {device})"
    return 0, f"{title}\n\n{table(lengths, device, cap, in_process=True)}"


def run(step: str, result: Path, rehearse: bool) -> int:
    if step == "env":
        code, markdown = env_step()
    elif step == "tests":
        code, markdown = tests_step()
    elif step == "long":
        code, markdown = long_context_step(rehearse)
    else:
        code, markdown = part_step(step, rehearse)
    result.write_text(markdown)
    return code
