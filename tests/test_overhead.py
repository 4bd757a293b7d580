"""benchmarks/overhead.py: the Trainer-overhead table runs end to end (one tiny repeat) and reports every loop."""

import ctypes
import re

import pytest
import torch

from benchmarks import cuda_check
from benchmarks.overhead import main


def test_overhead_table_reports_both_loops_and_lightnings_floor(capsys):
    main(["--tasks", "vit", "--repeats", "1", "--epochs", "1", "--batches", "3"])
    out = capsys.readouterr().out
    assert (
        "| task | loop | time | loop step (ms) | plain loop step (ms) | overhead | overhead (ms) |" in out
        and "torch " in out
        and "load average" in out
    )
    for loop in ("`attnlab fit`", "Lightning alone"):
        row = re.search(
            rf"^\| vit \(configs/vision/digits.yaml\) \| {loop} \| CPU \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) % \| ([+-][\d.]+) \|",
            out,
            re.M,
        )
        assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, out
        step, plain, ms = float(row.group(1)), float(row.group(2)), float(row.group(4))
        assert abs(ms - (step - plain)) <= 0.016, row.group(0)  # the difference of the two steps (each rounded)


@pytest.mark.skipif(torch.version.cuda is None or bool(torch.version.hip), reason="a CUDA build of torch")
def test_cuda_check_table_times_both_set_ups_and_names_the_variable_left(capsys):
    cuda_check.main(["--repeats", "1", "--steps", "13"])
    out = capsys.readouterr().out
    for name in ("Lightning's (NVML first)", "attnlab's"):
        row = re.search(rf"^\| {re.escape(name)} \| 3 \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
        assert row and float(row.group(1)) > 0, out
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        left = "1"  # a driver: attnlab keeps Lightning's check
    except OSError:
        left = "unset"
    assert f"after attnlab's set-up PYTORCH_NVML_BASED_CUDA_CHECK={left}" in out, out
