"""`make demo`: the cross-modality comparison at its smallest, on embedded data, a few minutes on a CPU.

    python -m experiments.demo [--out runs/demo] [-- extra attnlab fit arguments]

Trains each of configs/compare/{vision,text,detection}.yaml that exists into ``OUT/<modality>``, then runs
`attnlab compare` over them and says how to make it a sweep (several seeds, every similarity, intervals).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.runfolder import split_extra

CONFIGS = ("configs/compare/vision.yaml", "configs/compare/text.yaml", "configs/compare/detection.yaml")


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_extra(sys.argv[1:] if argv is None else list(argv))
    parser = argparse.ArgumentParser(prog="python -m experiments.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args(argv)
    from experiments.cli import main as attnlab

    out = Path(args.out)
    runs = []
    for config in (c for c in CONFIGS if Path(c).exists()):
        root = out / Path(config).stem
        print(f"attnlab: demo: fit {config} -> {root}", flush=True)
        attnlab(["fit", "--config", config, f"--trainer.default_root_dir={root}", *extra])
        runs.append(str(root))
    title = "attnlab demo: three modalities, one attention core"
    attnlab(["compare", *runs, "--out", str(out / "report"), "--title", title])
    print(
        "attnlab: demo: one seed per modality; for means with 95% intervals over seeds, run them as a sweep: "
        "`attnlab sweep configs/sweeps/ablation.yaml` (every similarity, 3 seeds; or `make ablation`), "
        "then `attnlab compare runs/sweeps/ablation`"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
