"""benchmarks/overhead.py: the Trainer-overhead table runs end to end (one tiny repeat) and reports both loops."""

import re

from benchmarks.overhead import main


def test_overhead_table_reports_both_loops(capsys):
    main(["--tasks", "vit", "--repeats", "1", "--epochs", "1", "--batches", "3"])
    out = capsys.readouterr().out
    assert (
        "| task | time | `attnlab fit` step (ms) | plain loop step (ms) | Trainer overhead |" in out
        and "torch " in out
        and "load average" in out
    )
    row = re.search(
        r"^\| vit \(configs/vision/digits.yaml\) \| CPU \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) % \|", out, re.M
    )
    assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, out
