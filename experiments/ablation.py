"""`make ablation`: every similarity function in every modality, three seeds each, as one sweep; then the report.

    python -m experiments.ablation                        # configs/sweeps/ablation.yaml -> runs/sweeps/ablation
    python -m experiments.ablation --dry-run              # the 45 runs and their commands
    python -m experiments.ablation --root /tmp/ablation -- --trainer.max_epochs=1   # extra `attnlab fit` arguments

Through `attnlab sweep` (an interrupted ablation resumes; a finished run is never trained again), then
``ROOT/report/report.md`` with each cell against scaled_dot over the same seeds, e.g. "text, dot vs
scaled_dot: -8.1 val/bleu (95% CI -10.2 to -6.0, n=3, paired t-test p=0.004)", and the √d section.
"""

from __future__ import annotations

import argparse
import sys

from experiments import sweep as sweeps
from experiments.runfolder import split_extra

SWEEP = "configs/sweeps/ablation.yaml"


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(prog="python -m experiments.ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("file", nargs="?", default=SWEEP, help="the sweep file (default: %(default)s)")
    parser.add_argument("--root", help="the sweep's folder (default: the file's, runs/sweeps/ablation)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their commands; train nothing")
    args = parser.parse_args(argv)
    code = 0
    try:
        sweeps.main(
            [
                args.file,
                *(["--root", args.root] if args.root else []),
                *(["--dry-run"] if args.dry_run else []),
                "--no-report",  # written below, with the √d section
                *(["--", *extra] if extra else []),
            ]
        )
    except SystemExit as exit_:
        if exit_.code != 1:  # 1: some runs failed (the report says which are missing); a bad file or a stop ends here
            raise
        code = 1
    if args.dry_run:
        return 0
    sweep = sweeps.load(args.file, args.root)
    if not sweeps.report(sweep, "attnlab: the √d ablation over seeds", scaling=True):
        sys.exit(sweeps.no_run_finished(sweep, code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
