"""One command for a lent GPU machine: install the carried wheels, run the CUDA-marked tests, each part of
`python -m benchmarks --only gpu` (padding, decoding, detr, overhead, mfu with its float8 row, tokens: the fits'
tokens/s of Multi30k's recipe by batch_size, max_tokens and max_tokens + compile, and of the LM plain and with packed
documents) and the long-context rows, every step in a process of its own under its own time limit, and write one
Markdown report and one JSON of the figures, both rewritten after each step: a run cut short keeps what it measured.

    make gpu-wheels                              # here, once: the wheels the GPU machine lacks, into .whl/
    python3 -m benchmarks.gpu_check              # there (carry .whl): $OUT/report.md and figures.json, else runs/gpu/
    python -m benchmarks.gpu_check --rehearse    # here, on the CPU (`make gpu-rehearsal`): runs/gpu-rehearsal/

The rehearsal runs every step at toy sizes: the same processes and imports, the same wheel install (for the
GPU machine's Python 3.12 on manylinux x86-64, into a temporary folder) and the same report writer. Every process
it starts sees our dependencies that the GPU machine's image lacks (`ABSENT_THERE`) as missing, so an import
that would fail there fails here first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# step -> its time limit on an H200 (s). An H200 took 21, 27, 88, 42, 39, 98 and 90 s for the first seven with
# 10 samples a side, 2 overhead runs and timm's compiled MFU row (../shared/measurements/2026-11-27-h200/log.txt); now
# 6 samples, 1 run and no timm row make room for the float8 MFU row, `tokens` (5 fits, one compiled) and `long`,
# not measured on a GPU yet (their limits are estimates). The whole run, wheels included, stays within BUDGET_S, the
# 8.5 minutes that leave a session's 15 minutes of device time room for the machine's start and one rerun of a step.
STEPS = {
    "env": 45,
    "tests": 60,
    "padding": 80,
    "decoding": 50,
    "detr": 50,
    "overhead": 75,
    "mfu": 130,
    "tokens": 170,
    "long": 60,
}
BUDGET_S = 510
# what the GPU image ('cuda', read 2026-11-17: device README's KINDS.md) lacks: carried as wheels, or never
# imported on the way to a figure
CARRIED = ("jsonargparse", "docstring_parser", "typeshed_client", "pycocotools", "torchao")
ABSENT_THERE = ("wandb", "submitit")
WHEEL_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
]
ROOT = Path(__file__).resolve().parent.parent


def install_wheels(wheels: Path, rehearse: bool) -> Path:
    """pip-install every wheel in ``wheels`` into a new temporary folder (for the GPU machine's interpreter when
    rehearsing) and check that it holds each of `CARRIED`; exits with one line where it cannot."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        sys.exit(f"gpu_check: no wheels in {wheels}/: run `make gpu-wheels` here first, then carry {wheels}")
    site = Path(tempfile.mkdtemp(prefix="attnlab-site-"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    done = subprocess.run(
        [*pip, "--target", str(site), *(WHEEL_TARGET if rehearse else []), *map(str, found)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"gpu_check: pip could not install the wheels in {wheels}/: {done.stderr.strip().splitlines()[-1]}")
    missing = [m for m in CARRIED if not (site / m).is_dir()]
    if missing:
        sys.exit(f"gpu_check: the wheels in {wheels}/ lack {', '.join(missing)}: run `make gpu-wheels` again")
    return site


def hide_absent(folder: Path) -> None:
    """A sitecustomize in ``folder`` under which importing any of `ABSENT_THERE` fails, as on the GPU machine."""
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {ABSENT_THERE!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (absent on the GPU machine)', name=name)\n"
        "sys.meta_path.insert(0, _Absent())\n"
    )


def tables(markdown: str) -> list[dict]:
    """The Markdown tables of a step's report as {"title", "columns", "rows"}: its figures for the JSON."""
    found, title = [], ""
    for block in re.split(r"\n\s*\n", markdown):
        lines = block.strip().splitlines()
        if lines and lines[0].startswith("###"):
            title = lines[0].lstrip("# ").strip()
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines if line.startswith("|")]
        if len(rows) >= 2:
            found.append({"title": title, "columns": rows[0], "rows": [dict(zip(rows[0], r)) for r in rows[2:]]})
    return found


def write_report(out: Path, header: list[str], results: dict[str, dict]) -> None:
    status = ["| step | status | seconds |", "|---|---|---|"]
    status += [f"| {name} | {r['status']} | {r['seconds']:.0f} |" for name, r in results.items()]
    parts = [r["markdown"] for r in results.values() if r["markdown"]]
    (out / "report.md").write_text("\n\n".join(["\n".join(header), "\n".join(status), *parts]) + "\n")
    figures = {name: {k: v for k, v in r.items() if k != "markdown"} for name, r in results.items()}
    (out / "figures.json").write_text(json.dumps({"header": header, "steps": figures}, indent=1) + "\n")


def run_step(name: str, limit: float, env: dict, rehearse: bool, log) -> dict:
    """One step in its own process: its output goes to ours and to the log as it comes; killed at ``limit``."""
    with tempfile.NamedTemporaryFile(suffix=".md", delete=False) as result:
        path = Path(result.name)
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--step", name, "--result", str(path)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        command + (["--rehearse"] if rehearse else []),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    echo = threading.Thread(target=lambda: [log(line) for line in proc.stdout], daemon=True)
    echo.start()
    try:
        code = proc.wait(timeout=limit)
        status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        status = f"cut at its limit of {limit:.0f} s"
    echo.join(5)
    markdown = path.read_text() if path.exists() else ""
    path.unlink(missing_ok=True)
    return {"status": status, "seconds": time.perf_counter() - start, "markdown": markdown, "tables": tables(markdown)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--rehearse", action="store_true", help="every step at toy sizes on the CPU")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels (default: .whl)")
    p.add_argument("--out", type=Path, help="report folder (default: $OUT, else runs/gpu or runs/gpu-rehearsal)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"some of: {', '.join(STEPS)}")
    p.add_argument("--step", choices=list(STEPS), help=argparse.SUPPRESS)  # one step, in its own process
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        from benchmarks.gpu_steps import run

        code = run(args.step, args.result, args.rehearse)
        gc.freeze()  # the step's process ends: no garbage-collector passes over what it made (experiments.cli.main)
        sys.exit(code)
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        p.error(f"--steps: unknown step(s) {', '.join(sorted(unknown))}; choose from {', '.join(STEPS)}")
    out = args.out or Path(os.environ.get("OUT") or ROOT / "runs" / ("gpu-rehearsal" if args.rehearse else "gpu"))
    out.mkdir(parents=True, exist_ok=True)
    started, deadline = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter() + BUDGET_S
    site = install_wheels(args.wheels, args.rehearse)
    paths = [site, ROOT]
    if args.rehearse:  # the cp312 wheels load only on the GPU machine: here, what it lacks is hidden instead
        paths[0] = Path(tempfile.mkdtemp(prefix="attnlab-hide-"))
        hide_absent(paths[0])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)), PYTHONUNBUFFERED="1")
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    command = "python -m benchmarks.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [f"# GPU check{' (rehearsal on the CPU, toy sizes)' if args.rehearse else ''}, {started}", ""]
    header += [f"Command: `{command.strip()}`; wheels installed: {', '.join(CARRIED)}."]
    results: dict[str, dict] = {}
    with open(out / "log.txt", "w") as log_file:

        def log(line: str) -> None:
            print(line, end="", flush=True)
            log_file.write(line)
            log_file.flush()

        for name in args.steps.split(","):
            left = deadline - time.perf_counter()
            if left < 15:
                results[name] = {"status": "not run: the budget is spent", "seconds": 0, "markdown": "", "tables": []}
                continue
            log(f"== gpu_check: {name} (limit {min(STEPS[name], left):.0f} s) ==\n")
            results[name] = run_step(name, min(STEPS[name], left), env, args.rehearse, log)
            log(f"== gpu_check: {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s ==\n")
            write_report(out, header, results)
    for folder in {site, paths[0]}:
        shutil.rmtree(folder, ignore_errors=True)
    failed = [n for n, r in results.items() if r["status"] != "ok"]
    print(f"gpu_check: report in {out}/report.md; {'not ok: ' + ', '.join(failed) if failed else 'every step ok'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
