"""`attnlab compare`: run folders -> runs and cells (`runs`) -> statistics over seeds (`stats`) and metrics against
swept numbers (`curves`) -> tables and plots (`tables`, `plots`) -> report.md, W&B and the command line (`report`)."""

from experiments.compare.report import build_report, main, print_result
from experiments.compare.runs import find_runs

__all__ = [
    "build_report",
    "find_runs",
    "main",
    "print_result",
]
