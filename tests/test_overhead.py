"""benchmarks/overhead.py: the Trainer-overhead table runs end to end (one tiny repeat) and reports every loop."""

import re

import pytest

from benchmarks.overhead import main


@pytest.mark.slow  # each loop runs in a process of its own
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
