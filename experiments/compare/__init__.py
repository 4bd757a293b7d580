"""`attnlab compare`: run folders -> runs and cells (`runs`) -> statistics over seeds (`stats`) and metrics against
swept numbers (`curves`) -> tables and plots (`tables`, `plots`) -> report.md, W&B and the command line (`report`)."""

from experiments.compare.plots import panel_title
from experiments.compare.report import build_report, main, print_result
from experiments.compare.runs import find_runs
from experiments.compare.stats import interval, paired

__all__ = [
    "build_report",
    "find_runs",
    "interval",
    "main",
    "paired",
    "panel_title",
    "print_result",
]
