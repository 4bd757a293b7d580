"""`attnlab sweep FILE.yaml [--dry-run | --status] [--root DIR] [-- fit arguments]`: grids x seeds of `attnlab fit`."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import Counter

from experiments.runfolder import SWEEP, SweepStatus, split_extra
from experiments.sweep.file import SweepError
from experiments.sweep.launch import LAUNCH, LOG, run_agent
from experiments.sweep.runs import Sweep, check, load
from experiments.sweep.status import lock, plan, record, states, update


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(prog="attnlab sweep", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("file", metavar="FILE.yaml", help="the sweep file (see configs/sweeps/)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their commands; start nothing")
    parser.add_argument(
        "--status", action="store_true", help="each run's state (running, killed, done ...); start nothing"
    )
    parser.add_argument("--root", help="the sweep's folder (default: the file's root, or runs/sweeps/<name>)")
    parser.add_argument("--no-report", action="store_true", help="skip the cells table and report at the end")
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)  # a W&B agent's call: one run
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        sweep = load(args.file, args.root, extra)
        if args.status:
            return _status(sweep)
        if not args.agent:
            check(sweep)
        code = run_agent(sweep, args.run or "") if args.agent else _sweep(sweep, args.dry_run)
        if not (args.agent or args.dry_run or args.no_report):
            code = _report(sweep, code)
    except SweepError as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        sys.exit(2)
    if code:
        sys.exit(code)  # `python -m experiments.cli sweep` drops main's return value
    return 0


def _report(sweep: Sweep, code: int) -> int:
    """The report of the finished runs into ``<root>/report``, as `attnlab compare` gives it (and the √d table with
    ``report: {scaling: true}``); the exit status: ``code`` (143 after SIGTERM), or 1 when no run finished."""
    from experiments.compare import build_report, find_runs, print_result

    try:
        runs = find_runs([str(sweep.root)])
    except ValueError:  # no finished run below the root
        print(
            f"attnlab: error: sweep {sweep.name}: no run finished, nothing to report; "
            f"each run's log is {sweep.root}/<run>/{LOG}, their states are in {sweep.root / SWEEP}",
            file=sys.stderr,
        )
        return code or 1
    result = build_report(runs, sweep.root / "report", sweep.report.title or f"attnlab: sweep {sweep.name}")
    print_result(result, sweep.report.scaling)
    print(f"attnlab: report written to {result['report']}")
    return code


def _status(sweep: Sweep) -> int:
    runs = states(sweep)
    for run, state in runs:
        print(f"{run.name}: {state}")
    counts = Counter(state for _, state in runs)
    print(
        f"attnlab: sweep {sweep.name}: {', '.join(f'{n} {state}' for state, n in counts.items())} of {len(runs)}; "
        f"`attnlab sweep {sweep.file}` starts or resumes every run not done"
    )
    return 0


def _sweep(sweep: Sweep, dry_run: bool) -> int:
    steps = plan(sweep)
    todo = [(run, how) for run, how in steps if how != "done"]
    if dry_run:
        for run, how in steps:
            print(f"{run.name}: {'done, skipped' if how == 'done' else how}")
            if how != "done":
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sweep.env(run).items())
                print(f"  {env + ' ' if env else ''}{shlex.join(sweep.command(run))}")
        print(
            f"attnlab: sweep {sweep.name}: {len(steps)} runs, {len(todo)} to run ({sweep.launcher}); "
            "nothing started (--dry-run)"
        )
        return 0
    with lock(sweep.root / "sweep.lock", wait=False):
        record(sweep)
        for run, how in steps:
            if how == "done":
                update(sweep.root, run.name, status="done")
                print(f"attnlab: sweep: {run.name} is done, skipped")
        code = LAUNCH[sweep.launcher](sweep, todo) if todo else 0
    runs = SweepStatus.read(sweep.root).runs
    counts = Counter(runs[run.name].status for run, _ in steps if run.name in runs)
    print(
        f"attnlab: sweep {sweep.name}: {counts['done']} done, {counts['failed']} failed, "
        f"{counts['interrupted']} interrupted of "
        f"{len(steps)}; status in {sweep.root / SWEEP}; compare with `attnlab compare {sweep.root}`"
    )
    return code or (1 if counts["failed"] else 0)
