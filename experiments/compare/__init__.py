"""`attnlab compare`: run folders -> runs and cells (`runs`) -> statistics over seeds (`stats`) and metrics against
swept numbers or steps (`curves`) -> tables and plots (`tables`, `plots`; a ViT's [CLS] maps from
checkpoints: `cls_maps`) -> report.md, W&B and the command line (`report`)."""

from experiments.compare.report import build_report, main, print_result
from experiments.compare.runs import find_runs

__all__ = [
    "build_report",
    "find_runs",
    "main",
    "print_result",
]
