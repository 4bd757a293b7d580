"""The √d ablation: every modality with every similarity function and positional encoding, then one report.

    python -m experiments.ablation                                  # configs/compare/{vision,text,detection}.yaml
    python -m experiments.ablation configs/compare/vision.yaml --out runs/compare/ablation -- --trainer.max_epochs=3

For each config the grid is read from its model class: ``similarity`` over the shared core's choices
(scaled_dot, dot, general) and, where the model has one, the positional-encoding argument (a ``Literal``
named like ``positions``) over its choices. Each point trains with `attnlab fit` into
``OUT/<modality>/<similarity>[-<positions>]``; a point whose run folder already holds a finished
summary is skipped, so an interrupted ablation resumes. Finally `attnlab compare OUT` writes
``OUT/report/report.md`` whose "What the √d scaling does" section holds the measurements.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import itertools
import json
import sys
import typing
from pathlib import Path

import yaml

from experiments.compare import POSITION_KEYS, build_report, find_runs, markdown_table
from models.attention import SIMILARITIES

CONFIGS = ("configs/compare/vision.yaml", "configs/compare/text.yaml", "configs/compare/detection.yaml")


def grid(config: str) -> tuple[str, list[dict[str, str]]]:
    """(modality folder name, [{init arg: value}, ...]) for one experiment config."""
    spec = yaml.safe_load(Path(config).read_text())["model"]
    module, _, name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    params = inspect.signature(cls).parameters
    try:
        hints = typing.get_type_hints(cls.__init__)
    except (NameError, TypeError):
        hints = {}
    axes: dict[str, tuple[str, ...]] = {}
    if "similarity" in params:
        axes["similarity"] = SIMILARITIES
    position = next((k for k in POSITION_KEYS if k in params and typing.get_origin(hints.get(k)) is typing.Literal), None)
    if position:
        axes[position] = typing.get_args(hints[position])
    points = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    return Path(config).stem, points


def _finished(root: Path) -> bool:
    for path in root.glob("lightning_logs/*/summary.json"):
        try:
            if json.loads(path.read_text()).get("status") == "finished":
                return True
        except ValueError:
            continue
    return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(prog="python -m experiments.ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=[c for c in CONFIGS if Path(c).exists()])
    parser.add_argument("--out", default="runs/compare/ablation")
    args = parser.parse_args(argv)
    from experiments.cli import main as attnlab

    out = Path(args.out)
    for config in args.configs:
        modality, points = grid(config)
        for point in points:
            root = out / modality / "-".join(point.values())
            if _finished(root):
                print(f"attnlab: {root} is done, skipped")
                continue
            overrides = [f"--model.init_args.{k}={v}" for k, v in point.items()]
            print(f"attnlab: fit {config} {' '.join(overrides)} -> {root}", flush=True)
            try:
                attnlab(["fit", "--config", config, f"--trainer.default_root_dir={root}", *overrides, *extra])
            except SystemExit as exit_:
                if exit_.code:
                    print(f"attnlab: {root} failed (exit {exit_.code}); going on", file=sys.stderr)
    result = build_report(find_runs([str(out)]), out / "report", "attnlab: the √d ablation")
    print(result["table"])
    if result["scaling"]:
        from experiments.compare import load_runs, scaling_rows

        print()
        print(markdown_table(*scaling_rows(load_runs(find_runs([str(out)])))))
    print(f"attnlab: report written to {result['report']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
