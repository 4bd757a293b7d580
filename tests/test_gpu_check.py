"""benchmarks/gpu_check.py: the one GPU command, rehearsed on the CPU with the same wheel install, processes and
report writer, every row of every step at toy sizes; a step that runs past its limit is cut and the others still
report."""

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check, scaling
from benchmarks.peers.bench import Settings
from benchmarks.scaling import FLOAT8
from benchmarks.sections import GPU_PARTS

ROOT = Path(__file__).resolve().parent.parent


def fake_wheels(folder: Path, names) -> Path:
    """A pure-Python wheel per name: what pip needs to install it (METADATA, WHEEL, RECORD) and one module."""
    folder.mkdir()
    for name in names:
        info = f"{name}-1.0.dist-info"
        with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{name}/__init__.py", "")
            whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
            whl.writestr(
                f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            )
            whl.writestr(f"{info}/RECORD", "")
    return folder


@pytest.mark.slow
def test_the_rehearsal_installs_the_wheels_runs_each_step_and_writes_the_report(tmp_path):
    """One rehearsal of the steps whose rows are checked here (a process and a wheel install for all of them)."""
    wheels, out = fake_wheels(tmp_path / "whl", gpu_check.CARRIED), tmp_path / "out"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--rehearse", "--steps", "env,tests,decoding,mfu,tokens"]
    done = subprocess.run(
        [*command, "--wheels", str(wheels), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report, figures = (out / "report.md").read_text(), json.loads((out / "figures.json").read_text())
    assert all(f"| {step} | ok |" in report for step in ("env", "tests", "decoding", "mfu", "tokens")), report
    assert "== gpu_check: decoding: ok" in (out / "log.txt").read_text()  # every line of every step, as it came
    steps = figures["steps"]
    tests = steps["tests"]["tables"][0]["rows"]
    assert len(tests) == 9 and {r["outcome"] for r in tests} == {"skipped"}  # the CUDA-marked tests, collected
    decoding = steps["decoding"]["tables"][0]["rows"]
    assert [r["case"] for r in decoding] == [
        "beam 5, 64 sentences, static cache",
        "beam 5, 1014 sentences, static cache",
        "greedy, 1014 sentences, static cache",
    ]
    assert all(float(r["ours ms"]) > 0 for r in decoding)
    mfu = steps["mfu"]["tables"][0]["rows"]
    assert [(r["precision"], r["torch.compile"]) for r in mfu] == [("bf16 autocast", "off"), (FLOAT8, "off")]
    assert all(float(r["step ms"]) > 0 for r in mfu)  # the float8 row measured (emulated), not "torchao absent"
    translation, lm = (table["rows"] for table in steps["tokens"]["tables"])
    budget = translation[1]["recipe"]
    assert budget.startswith("max_tokens=")
    assert [r["recipe"] for r in translation] == ["batch_size=8", budget, f"{budget} + compile"]
    assert [r["recipe"] for r in lm] == ["plain blocks of 32", "documents, blocks of 32"]
    assert all(float(r["tokens/s"].replace(",", "")) > 0 for r in translation + lm)


def test_every_part_of_the_gpu_section_is_a_step_of_the_gpu_check():
    assert set(gpu_check.STEPS) == {"env", "tests", "long", *GPU_PARTS}


def test_without_torchao_the_float8_row_says_so_and_the_step_goes_on(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    row = scaling.vit_b16_float8_mfu(Settings(quick=True), compile_model=False, batch=2)
    assert row["precision"] == FLOAT8 and row["MFU"].startswith("torchao absent") and row["step ms"] == "-"


def test_the_long_context_rows_rehearse_both_paths_for_every_variant():
    from benchmarks.gpu_steps import long_context_step

    code, markdown = long_context_step(rehearse=True)
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "MB /" in line]
    assert code == 0 and len(rows) == 2 * 7, markdown  # 7 variants at 2 lengths
    assert all(row.count("MB /") == 2 for row in rows)  # the full path and the chunked one measured


def test_what_the_gpu_machine_lacks_cannot_be_imported_in_a_rehearsal(tmp_path):
    gpu_check.hide_absent(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for name in gpu_check.ABSENT_THERE:
        plain = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
        hidden = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert plain.returncode == 0, f"{name} is installed here"
        assert hidden.returncode == 1 and "absent on the GPU machine" in hidden.stderr, hidden.stderr


def test_a_step_past_its_limit_is_cut_and_reported(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    lines = []
    result = gpu_check.run_step("env", 0.5, env, True, lines.append)  # importing torch alone takes longer
    assert result["status"] == "cut at its limit of 0 s", result
    assert result["seconds"] < 10 and result["markdown"] == ""
    gpu_check.write_report(tmp_path, ["# header"], {"env": result})
    assert "| env | cut at its limit of 0 s |" in (tmp_path / "report.md").read_text()


def test_missing_or_incomplete_wheels_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as none:
        gpu_check.install_wheels(tmp_path, rehearse=True)
    assert f"no wheels in {tmp_path}/: run `make gpu-wheels`" in str(none.value)
    wheels = fake_wheels(tmp_path / "whl", gpu_check.CARRIED[:-1])
    with pytest.raises(SystemExit) as lacking:
        gpu_check.install_wheels(wheels, rehearse=True)
    last = gpu_check.CARRIED[-1]
    assert str(lacking.value) == f"gpu_check: the wheels in {wheels}/ lack {last}: run `make gpu-wheels` again"


def test_the_figures_are_the_reports_tables():
    markdown = "### Speed\n\nnote\n\n| case | ms |\n|---|---|\n| a | 1.5 |\n| b | 2 |\n\n### Other\n\n| x |\n|---|\n"
    assert gpu_check.tables(markdown) == [
        {"title": "Speed", "columns": ["case", "ms"], "rows": [{"case": "a", "ms": "1.5"}, {"case": "b", "ms": "2"}]},
        {"title": "Other", "columns": ["x"], "rows": []},
    ]
