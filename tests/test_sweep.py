"""`attnlab sweep`: expansion and names, the status file, checks before any run, skip and resume, failures,
the SLURM launcher through submitit's debug executor, W&B grouping, and the real CLI end to end on the digits.

The fast tests plan and check without training. The `slow` ones train a 1-layer ViT for one short epoch per run:
in this process (`in_process`: each run's `attnlab fit` called here, no process to start and no Lightning to import
per run), except one sweep of real processes, signals and all (`test_an_interrupted_sweep_resumes_...`).
"""

import contextlib
import io
import json
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import yaml
from builders import gone_pid
from processes import CLIProcess
from scipy import stats

from experiments import sweep as sweeps
from experiments.runfolder import SweepStatus

ROOT = Path(__file__).resolve().parents[1]
DIGITS = "configs/vision/digits.yaml"
TINY = {
    "trainer.max_epochs": 1,
    "trainer.limit_train_batches": 2,
    "trainer.limit_val_batches": 1,
    "trainer.log_every_n_steps": 1,
    "model.init_args.depth": 1,
    "model.init_args.embed_dim": 16,
    "model.init_args.num_heads": 2,
}


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths are relative to the repository root
    monkeypatch.setenv(
        "PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    )  # the runs import this tree


def write(tmp_path: Path, name: str = "s", **spec) -> Path:
    spec = {
        "name": name,
        "configs": [DIGITS],
        "grid": {"model.init_args.attention.similarity": ["scaled_dot", "dot"]},
        "seeds": [0, 1],
        "root": str(tmp_path / "root"),
        **spec,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec.items() if v is not None}, sort_keys=False))
    return path


class _Ended:
    """What `in_process`'s spawn returns: a run already ended, with `subprocess.Popen`'s poll, wait and returncode."""

    def __init__(self, returncode: int):
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    wait = poll


@pytest.fixture
def in_process(monkeypatch):
    """The sweep's runs in this process: `spawn` (the launchers' one way to start a run) calls `attnlab fit` here,
    with the run's environment and its output in the run's log, and returns once the run has ended."""
    from experiments.cli import main
    from experiments.sweep import launch

    def spawn(command: list[str], env: dict[str, str], log: Path, own_session: bool = False) -> _Ended:
        assert command[:3] == [sys.executable, "-m", "experiments.cli"], command
        log.parent.mkdir(parents=True, exist_ok=True)
        with monkeypatch.context() as patch, log.open("a") as out:
            for key, value in env.items():
                patch.setenv(key, value)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    main(command[3:])
                    code = 0
                except SystemExit as exit_:
                    code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
                except Exception:  # what a process would die of: its traceback in the log, status 1
                    traceback.print_exc()
                    code = 1
                finally:  # as a process's exit does: the W&B run (offline: its file) is finished
                    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
                        sys.modules["wandb"].finish()
        return _Ended(code)

    monkeypatch.setattr(launch, "spawn", spawn)


def test_one_run_per_config_cell_and_seed_with_stable_names_and_commands(tmp_path):
    sweep = sweeps.load(
        write(
            tmp_path,
            grid={"model.init_args.attention.similarity": ["scaled_dot", "dot"], "trainer.max_epochs": [1, 2]},
            seeds=[0, 7],
            overrides={"data.init_args.batch_size": 32},
        )
    )
    runs = sweep.runs()
    assert [r.name for r in runs] == [
        f"digits/similarity={s},max_epochs={e}/seed={seed}"
        for seed in (0, 7)
        for s in ("scaled_dot", "dot")
        for e in (1, 2)
    ]
    run = runs[-1]
    assert run.folder == tmp_path / "root" / "digits" / "similarity=dot,max_epochs=2" / "seed=7"
    assert (
        run.cell == {"model.init_args.attention.similarity": "dot", "trainer.max_epochs": 2}
        and run.cell_name == "digits/similarity=dot,max_epochs=2"
    )
    assert sweep.command(run) == [
        sys.executable,
        "-m",
        "experiments.cli",
        "fit",
        "--config",
        DIGITS,
        "--seed_everything",
        "7",
        "--trainer.default_root_dir",
        str(run.folder),
        "--ckpt_path",
        "last",
        "--data.init_args.batch_size=32",
        "--model.init_args.attention.similarity=dot",
        "--trainer.max_epochs=2",
    ]
    assert sweeps.load(write(tmp_path)).runs()[0].name == runs[0].name.replace(
        ",max_epochs=1", ""
    )  # names depend on settings only


def test_a_block_given_whole_names_its_runs_by_its_fields(tmp_path):
    """A grid over a whole block (some of its fields, merged onto the config's) names each cell by those fields,
    not by their JSON; the fit gets the JSON."""
    grid = {"model.init_args.attention": [{"normalization": "softmax1"}, {"normalization": "softmax", "gate": None}]}
    runs = sweeps.load(write(tmp_path, grid=grid, seeds=[3])).runs()
    assert [r.name for r in runs] == [
        "digits/normalization=softmax1/seed=3",
        "digits/normalization=softmax,gate=null/seed=3",
    ]
    command = sweeps.load(write(tmp_path, grid=grid, seeds=[3])).command(runs[1])
    assert command[-1] == '--model.init_args.attention={"normalization": "softmax", "gate": null}'


def test_every_sweep_file_in_configs_expands_and_passes_the_parser(attnlab):
    ablation = sweeps.load("configs/sweeps/ablation.yaml")
    names = [r.name for r in ablation.runs()]
    # 3 similarities x (vision, text x 2 positional encodings, detection x 2 query types) x 3 seeds
    assert len(names) == 45 and len(set(names)) == 45 and "text/similarity=dot,positions=learned/seed=2" in names
    assert "detection/similarity=general,query_type=vanilla/seed=1" in names
    assert ablation.root == Path("runs/sweeps/ablation")
    for path in sorted(Path("configs/sweeps").glob("*.yaml")):
        code, out, err = attnlab("sweep", str(path), "--dry-run")
        assert code == 0, err
        assert "nothing started (--dry-run)" in out


def test_the_ablation_sweeps_report_has_the_sqrt_d_section(attnlab, tmp_path):
    """`make ablation` is `attnlab sweep configs/sweeps/ablation.yaml`: its report (``report:`` in the file) has its
    title and prints the √d table beside the cells. Its runs here are finished summaries with chosen values."""
    root = tmp_path / "ablation"
    sweep = sweeps.load("configs/sweeps/ablation.yaml", str(root))
    for run in sweep.runs():
        similarity = run.cell["model.init_args.attention.similarity"]
        layer = {"name": "blocks.0.attn", "kind": "self", "logit_var": [{"dot": 16.0}.get(similarity, 1.0)]}
        summary = _finished_run(run.folder) / "summary.json"
        summary.write_text(
            json.dumps(
                {
                    "status": "finished",
                    "modality": Path(run.config).stem,
                    "hparams": {"attention": {"similarity": similarity}},
                    "best": {"monitor": "val/loss", "value": 1.0 + run.seed / 10},
                    "attention": {"init": {"layers": [layer]}, "final": {"layers": [layer]}},
                }
            )
        )
    code, out, err = attnlab("sweep", "configs/sweeps/ablation.yaml", "--root", str(root))
    assert code == 0, err
    assert out.count("is done, skipped") == 45 and "| logit var init | logit var end |" in out
    assert "| vision | dot | - | " in out and "| 16 | 16 |" in out
    report = (root / "report" / "report.md").read_text()
    assert report.startswith("# attnlab: the √d ablation over seeds") and "## What the √d scaling does" in report


def test_dry_run_lists_runs_and_commands_and_starts_nothing(attnlab, tmp_path):
    code, out, err = attnlab("sweep", str(write(tmp_path, overrides=TINY)), "--dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "digits/similarity=scaled_dot/seed=0: new"
    assert lines[1].strip().startswith(f"{sys.executable} -m experiments.cli fit --config {DIGITS} --seed_everything 0")
    assert "attnlab: sweep s: 4 runs, 4 to run (local); nothing started (--dry-run)" in out
    assert not (tmp_path / "root").exists()


def _finished_run(folder: Path, status: str = "finished", last: bool = False) -> Path:
    run = folder / "lightning_logs" / "version_0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"status": status}))
    if last:
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    return run


def test_finished_runs_are_skipped_and_interrupted_ones_resume_from_last_ckpt(tmp_path):
    sweep = sweeps.load(write(tmp_path))
    done, interrupted, failed_early, fresh = sweep.runs()
    _finished_run(done.folder)
    run = _finished_run(interrupted.folder, "interrupted", last=True)
    sweeps.update(sweep.root, failed_early.name, status="done")  # the status file says done: never started again
    assert [how for _, how in sweeps.plan(sweep)] == [
        "done",
        f"resume from {run / 'checkpoints' / 'last.ckpt'}",
        "done",
        "new",
    ]
    assert (
        "--ckpt_path" in sweep.command(fresh)
        and sweep.command(fresh)[sweep.command(fresh).index("--ckpt_path") + 1] == "last"
    )


def test_status_tells_a_running_run_from_one_whose_process_is_gone(attnlab, tmp_path):
    file = write(tmp_path)
    sweep = sweeps.load(file)
    sweeps.record(sweep)
    done, alive, killed, pending = sweep.runs()
    _finished_run(done.folder)  # the status file still says pending: the run folder knows better
    for run, pid in ((alive, os.getpid()), (killed, gone_pid())):
        sweeps.update(sweep.root, run.name, status="running")
        summary = _finished_run(run.folder, "running") / "summary.json"
        summary.write_text(json.dumps({"status": "running", "pid": pid, "host": socket.gethostname()}))
    code, out, err = attnlab("sweep", str(file), "--status")
    assert code == 0, err
    assert out.splitlines() == [
        f"{done.name}: done",
        f"{alive.name}: running",
        f"{killed.name}: killed",
        f"{pending.name}: pending",
        f"attnlab: sweep s: 1 done, 1 running, 1 killed, 1 pending of 4; `attnlab sweep {file}` starts or resumes "
        "every run not done",
    ]


def test_the_status_file_records_every_run_and_keeps_their_state(tmp_path):
    sweep = sweeps.load(write(tmp_path, overrides=TINY))
    sweeps.record(sweep)
    status = json.loads((sweep.root / "sweep.json").read_text())
    assert status["name"] == "s" and status["configs"]["digits"]["grid"] == {
        "model.init_args.attention.similarity": ["scaled_dot", "dot"]
    }
    assert list(status["runs"]) == [r.name for r in sweep.runs()] and {
        e["status"] for e in status["runs"].values()
    } == {"pending"}
    entry = status["runs"]["digits/similarity=dot/seed=1"]
    assert (
        entry["seed"] == 1
        and entry["cell"] == {"model.init_args.attention.similarity": "dot"}
        and "--seed_everything 1" in entry["command"]
    )
    sweeps.update(sweep.root, "digits/similarity=dot/seed=1", status="failed", error="attnlab: error: boom")
    sweeps.update(sweep.root, "digits/similarity=dot/seed=0", status="done", returncode=0)
    sweeps.record(sweep)  # a second start of the sweep keeps what the first recorded
    runs = SweepStatus.read(sweep.root).runs
    assert runs["digits/similarity=dot/seed=1"].error == "attnlab: error: boom"
    assert [runs[r.name].status for r in sweep.runs()] == ["pending", "done", "pending", "failed"]
    assert [how for _, how in sweeps.plan(sweep)] == ["new", "done", "new", "new"]  # done stays done


def test_the_error_line_is_attnlabs_own_or_the_exception_that_ended_the_traceback(tmp_path):
    log = tmp_path / "sweep.log"
    log.write_text("Seed set to 0\nattnlab: error: model.init_args.patch_size: 3 does not divide 8\n")
    assert sweeps.error_line(log, 2) == "attnlab: error: model.init_args.patch_size: 3 does not divide 8"
    log.write_text(
        'Traceback (most recent call last):\n  File "x.py", line 1\ntorch.OutOfMemoryError: CUDA out of memory\n'
    )
    assert sweeps.error_line(log, 1) == "torch.OutOfMemoryError: CUDA out of memory"
    log.write_text("Killed\n")
    assert sweeps.error_line(log, -9) == "exit status -9: Killed"


BAD = {
    "grid key": (
        {"grid": {"model.init_args.similarty": ["dot"]}},
        (
            "grid.model.init_args.similarty=dot (configs/vision/digits.yaml): model: 'similarty' is not an option of "
            "models.vision.ImageClassifier; did you mean 'attention.similarity'?"
        ),
    ),
    "grid value type": (
        {"grid": {"trainer.max_epochs": [1, "many"]}},
        "grid.trainer.max_epochs=many (configs/vision/digits.yaml): trainer.max_epochs: expected int, got 'many'",
    ),
    "grid value choice": (
        {"grid": {"model.init_args.attention.similarity": ["cosine"]}},
        "grid.model.init_args.attention.similarity=cosine",
    ),
    "grid not a list": (
        {"grid": {"model.init_args.attention.similarity": "dot"}},
        "grid.model.init_args.attention.similarity: expected a non-empty list",
    ),
    "override type": (
        {"overrides": {"trainer.max_epochs": "lots"}},
        "overrides (configs/vision/digits.yaml): trainer.max_epochs: expected int",
    ),
    "empty seeds": ({"seeds": []}, "seeds: expected a non-empty list of integers, got []"),
    "seed type": ({"seeds": [0, "one"]}, "seeds: expected distinct integers, got 'one'"),
    "launcher": (
        {"launcher": "kubernetes"},
        "launcher: 'kubernetes' is not a launcher; expected one of local, slurm, wandb",
    ),
    "sweep key": ({"seed": [0]}, "seed: not a sweep key"),
    "config": ({"configs": ["configs/vision/digit.yaml"]}, "configs: 'configs/vision/digit.yaml' is not a file"),
    "slurm parameter": (
        {"launcher": "slurm", "slurm": {"cluster": "local", "timeout_minutes": 5}},
        "slurm: Unknown executor 'timeout' in parameter 'timeout_minutes'",
    ),
    "max_parallel": ({"max_parallel": 0}, "max_parallel: expected a positive integer, got 0"),
    "root": ({"root": 3}, "root: expected a folder, got 3"),
    "report": (
        {"report": {"scaling": "yes!"}},
        "report: expected a mapping with title and scaling, got {'scaling': 'yes!'}",
    ),
    "config entry": (
        {"configs": [{"config": DIGITS, "grid": {"trainer.max_epochs": 2}}]},
        "configs[configs/vision/digits.yaml].grid.trainer.max_epochs: expected a non-empty list of values, got 2",
    ),
}


def test_grid_and_override_values_stay_as_the_yaml_gave_them(tmp_path):
    """The sweep file is parsed by jsonargparse, which would read the string "1e-3" as a number: run names and
    command lines keep what the user wrote."""
    sweep = sweeps.load(
        write(tmp_path, grid={"model.init_args.lr": ["1e-3", 0.01]}, overrides={"trainer.max_epochs": "2"})
    )
    assert [run.name for run in sweep.runs()][:2] == ["digits/lr=1e-3/seed=0", "digits/lr=0.01/seed=0"]
    assert sweep.overrides == {"trainer.max_epochs": "2"} and "--model.init_args.lr=1e-3" in sweep.command(
        sweep.runs()[0]
    )


def test_the_check_reuses_one_parser_and_answers_as_a_fresh_one():
    """Every check parses with the parser the first one built; what an error leaves in it (one after
    --print_config was read: an unknown argument) changes no later answer of a fresh `attnlab fit` parser."""
    from experiments.sweep.runs import _parse_error
    from experiments.trainer_cli import AttnlabCLI, CheckingCLI, main

    def fresh(args: list[str]) -> str | None:
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
            main([*args, "--print_config"], cli=AttnlabCLI)
        return err.getvalue().strip().removeprefix("attnlab: error: ") if e.value.code else None

    digits = ["fit", "--config", DIGITS]
    cases = [
        digits,
        [*digits, "--bogus=1"],
        [*digits, "--trainer.max_epochs=many"],
        [*digits, "--trainer.max_epochs=2"],
    ]
    _parse_error(digits)
    parser = CheckingCLI.built
    assert parser is not None
    assert (
        [_parse_error(args) for args in cases]
        == [fresh(args) for args in cases]
        == [
            None,
            "unrecognized arguments: --bogus=1",
            "trainer.max_epochs: expected int, got 'many'",
            None,
        ]
    )
    assert CheckingCLI.built is parser


@pytest.mark.parametrize("case", BAD, ids=str)
def test_bad_sweep_files_fail_before_any_run_with_one_line(attnlab, tmp_path, case):
    spec, message = BAD[case]
    path = write(tmp_path, **spec)
    code, _, err = attnlab("sweep", str(path))
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"attnlab: error: {path}: {message}"), err
    assert not (tmp_path / "root").exists()


def test_a_file_that_is_not_yaml_or_not_a_mapping_is_one_line(attnlab, tmp_path, monkeypatch):
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    code, _, err = attnlab("sweep", str(path))
    assert (
        code == 2
        and err.startswith(f"attnlab: error: {path}:2:1: not valid YAML: expected ',' or ']'")  # the file ends open
        and "(while parsing a flow sequence at 1:7)" in err  # the '[' after "name: "
        and len(err.strip().splitlines()) == 1
    )
    path.write_text("- configs/vision/digits.yaml\n")
    code, _, err = attnlab("sweep", str(path))
    assert (
        code == 2
        and err.strip()
        == f"attnlab: error: {path}: a sweep file is a mapping (name, configs, grid, seeds, ...), got list"
    )
    monkeypatch.setenv("WANDB_MODE", "offline")
    code, _, err = attnlab("sweep", str(write(tmp_path, launcher="wandb")))
    assert code == 2 and "launcher: wandb needs W&B online" in err and "W&B mode is offline" in err


def test_wandb_runs_get_the_sweep_as_group_the_cell_as_job_type_and_settings_as_tags(tmp_path, capsys):
    sweep = sweeps.load(write(tmp_path, wandb={"project": "p", "entity": "team"}, overrides={"trainer.max_epochs": 3}))
    run = sweep.runs()[3]
    logger = next(a for a in sweep.command(run) if a.startswith("--trainer.logger="))
    csv, wandb = json.loads(logger.removeprefix("--trainer.logger="))
    assert csv == {"class_path": "experiments.tracking.CSVLogger"}
    assert wandb == {
        "class_path": "experiments.tracking.WandbLogger",
        "init_args": {
            "project": "p",
            "entity": "team",
            "name": "digits/similarity=dot/seed=1",
            "group": "s",
            "tags": ["similarity=dot", "max_epochs=3", "seed=1"],
        },
    }
    assert sweep.env(run) == {"WANDB_JOB_TYPE": "digits/similarity=dot"}
    # the W&B sweep's agents run each pending run by name: W&B fills in ${env} and ${args} (--run=NAME)
    config = sweeps.wandb_sweep_config(sweep, sweeps.plan(sweep))
    assert config["method"] == "grid" and config["parameters"]["run"]["values"] == [r.name for r in sweep.runs()]
    command = config["command"]
    assert command[:5] == ["${env}", sys.executable, "-m", "experiments.cli", "sweep"] and command[-1] == "${args}"
    _finished_run(run.folder)
    assert sweeps.main([*command[5:-1], f"--run={run.name}"]) == 0
    assert f"attnlab: sweep: {run.name} is done, skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("cores", "max_parallel", "preset", "expected"),
    [(8, 2, None, "4"), (8, 3, None, "2"), (2, 4, None, "1"), (8, 1, None, None), (8, 2, "3", "3")],
)
def test_local_runs_on_the_cpu_share_its_cores_as_torchrun_does(
    tmp_path, monkeypatch, cores, max_parallel, preset, expected
):
    """torchrun's rule: OMP_NUM_THREADS = cores // processes, at least 1; one run at a time or a value the user set
    is left alone (the run's torch then reads the environment it inherits)."""
    from experiments.sweep import launch

    sweep = sweeps.load(write(tmp_path, grid={"model.init_args.similarity": ["dot", "scaled_dot"]}, seeds=[0]))
    sweep.max_parallel = max_parallel
    monkeypatch.setattr(launch, "_gpus", list)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if preset is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    seen = []
    monkeypatch.setattr(launch, "spawn", lambda command, env, log, own_session=False: seen.append(env) or _Ended(0))
    sweeps.record(sweep)
    assert launch.launch_local(sweep, sweeps.plan(sweep)) == 0
    assert [env.get("OMP_NUM_THREADS") for env in seen] == [None if preset else expected] * 2


@pytest.mark.slow
def test_a_signal_while_a_run_starts_stops_that_run_too(tmp_path, monkeypatch):
    """SIGTERM to the sweep while it starts a run (its log opened, its process not yet known to the sweep's handler):
    the run is stopped all the same, recorded as interrupted, and the sweep exits with 143."""
    from experiments.sweep import launch
    from experiments.sweep.runs import Sweep

    sweep = sweeps.load(write(tmp_path, grid={"model.init_args.similarity": ["dot"]}, seeds=[0]))
    monkeypatch.setattr(Sweep, "command", lambda self, run: [sys.executable, "-c", "import time; time.sleep(20)"])
    start = launch.spawn

    def signalled_while_starting(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, before the process below exists
        return start(*args, **kwargs)

    monkeypatch.setattr(launch, "spawn", signalled_while_starting)
    sweeps.record(sweep)
    began = time.monotonic()
    assert launch.launch_local(sweep, sweeps.plan(sweep)) == 128 + signal.SIGTERM
    assert SweepStatus.read(sweep.root).runs["digits/similarity=dot/seed=0"].status == "interrupted"
    assert time.monotonic() - began < 15  # stopped, not slept to its end


# ---- the real CLI


def _wandb_run_record(folder: Path):
    """The run record of an offline W&B run (its .wandb file: a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, chunks = path.read_bytes(), 32768, 7, b""  # 7: the file's own header (":W&B", magic, version)
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "run":
                return record.run
    return None


@pytest.mark.slow
def test_submitit_runs_each_cell_a_failing_cell_is_recorded_and_wandb_groups_the_runs(
    attnlab, tmp_path, monkeypatch, in_process
):
    """launcher: slurm through submitit's debug executor (the SLURM stand-in: each job runs in this process when the
    sweep waits for it); patch_size 3 fails on 8x8 digits. A SLURM job's function and arguments travel pickled."""
    from experiments.sweep import launch

    monkeypatch.setenv("WANDB_MODE", "offline")
    path = write(
        tmp_path,
        name="patch",
        grid={"model.init_args.patch_size": [2, 3]},
        seeds=[0],
        overrides=TINY,
        launcher="slurm",
        slurm={"cluster": "debug", "timeout_min": 5},
        wandb={"project": "attnlab"},
    )
    code, out, err = attnlab("sweep", str(path))
    assert code == 1, err  # a failed run: the sweep says so in its status
    status = json.loads((tmp_path / "root" / "sweep.json").read_text())["runs"]
    good, bad = status["digits/patch_size=2/seed=0"], status["digits/patch_size=3/seed=0"]
    assert good["status"] == "done" and good["job_id"] and good["returncode"] == 0
    assert bad["status"] == "failed" and bad["error"].startswith("attnlab: error: ") and "patch_size" in bad["error"]
    assert f"digits/patch_size=3/seed=0 failed: {bad['error']}" in out
    assert "1 done, 1 failed, 0 interrupted of 2" in out
    folder = tmp_path / "root" / "digits" / "patch_size=2" / "seed=0"
    assert json.loads((folder / "lightning_logs" / "version_0" / "summary.json").read_text())["status"] == "finished"
    run = _wandb_run_record(folder)
    assert (
        run.run_group == "patch"
        and run.job_type == "digits/patch_size=2"
        and run.display_name == "digits/patch_size=2/seed=0"
    )
    assert list(run.tags) == ["patch_size=2", *(f"{k.rpartition('.')[2]}={v}" for k, v in TINY.items()), "seed=0"]
    sweep = sweeps.load(path)
    first = sweep.runs()[0]
    job = (launch.execute, sweep.command(first), str(first.folder), sweep.env(first))
    assert pickle.loads(pickle.dumps(job)) == job


def _tiny_sweep(tmp_path: Path, name: str, **spec) -> Path:
    return write(tmp_path, name=name, **{"overrides": TINY, **spec})


@pytest.mark.slow
def test_digits_sweep_end_to_end_then_compare_gives_a_row_per_cell(attnlab, tmp_path, in_process):
    path = _tiny_sweep(tmp_path, "digits_similarity", max_parallel=2)
    code, out, err = attnlab("sweep", str(path))
    assert code == 0, err
    root = tmp_path / "root"
    status = json.loads((root / "sweep.json").read_text())["runs"]
    assert {e["status"] for e in status.values()} == {"done"} and len(status) == 4
    sweep_out = out  # the sweep itself ends with the cells table
    best = {}
    for name, entry in status.items():
        run = root / name / "lightning_logs" / "version_0"
        assert yaml.safe_load((run / "config.yaml").read_text())["seed_everything"] == entry["seed"]
        best[name] = json.loads((run / "summary.json").read_text())["best"]["value"]
    code, out, err = attnlab("compare", str(root), "--out", str(tmp_path / "report"))
    assert code == 0, err
    table = json.loads((tmp_path / "report" / "table.json").read_text())
    rows = {row[0]: dict(zip(table["cell_columns"], row)) for row in table["cell_rows"]}
    assert list(rows) == ["digits/similarity=scaled_dot", "digits/similarity=dot"]
    for cell, row in rows.items():
        values = [best[f"{cell}/seed={s}"] for s in (0, 1)]
        low, high = stats.t.interval(0.95, 1, loc=sum(values) / 2, scale=stats.sem(values))
        assert row["n"] == "2*" and row["seeds"] == "0,1"  # * fewer than 5 seeds: a wide interval
        assert row["best"] == f"val/acc = {sum(values) / 2:.3g} ± {(high - low) / 2:.3g}"
        similarity = cell.rpartition("=")[2]  # the attention field that differs has a column
        assert f"| {cell} | vision | {similarity} | 2* | 0,1 | {row['best']} |" in out
        assert f"| {cell} | vision | {similarity} | 2* | 0,1 | {row['best']} |" in sweep_out
    assert "digits, dot vs scaled_dot: " in out and (tmp_path / "report" / "seeds.png").stat().st_size > 10_000
    # a second start skips every finished run and leaves their folders as they were
    stamps = {p: p.stat().st_mtime for p in root.glob("**/summary.json")}
    code, out, err = attnlab("sweep", str(path))
    assert code == 0, err
    assert out.count("is done, skipped") == 4 and "started" not in out
    assert {p: p.stat().st_mtime for p in root.glob("**/summary.json")} == stamps


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_its_run_and_skips_the_finished_one(attnlab, tmp_path, in_process):
    """SIGTERM to the sweep (a process, `CLIProcess`; its runs new interpreters, as the launcher starts them) stops
    its running fit, which saves last.ckpt; the next start resumes that run. The signal goes when the long run's first epoch (one batch) has saved last.ckpt: 9 epochs
    are left to stop in."""
    path = _tiny_sweep(
        tmp_path,
        "stop",
        grid={"trainer.max_epochs": [1, 10]},
        seeds=[0],  # the grid's max_epochs wins over TINY's
        overrides={**TINY, "trainer.limit_train_batches": 1},
    )
    root = tmp_path / "root"
    first, long = root / "digits" / "max_epochs=1" / "seed=0", root / "digits" / "max_epochs=10" / "seed=0"
    sweep = CLIProcess(["sweep", str(path)], dict(os.environ), tmp_path / "logs")
    deadline = time.monotonic() + 300
    while (
        not list(long.glob("lightning_logs/version_0/checkpoints/last.ckpt"))
        and sweep.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=120) == 128 + signal.SIGTERM, sweep.out.read_text() + sweep.stderr()
    status = json.loads((root / "sweep.json").read_text())["runs"]
    assert status["digits/max_epochs=1/seed=0"]["status"] == "done"
    assert status["digits/max_epochs=10/seed=0"]["status"] == "interrupted"
    run = long / "lightning_logs" / "version_0"
    stopped = json.loads((run / "summary.json").read_text())
    assert stopped["status"] == "interrupted"
    stamp = (first / "lightning_logs" / "version_0" / "summary.json").stat().st_mtime

    code, out, err = attnlab("sweep", str(path))  # the second start in this process, its run too
    assert code == 0, out + err
    assert "digits/max_epochs=1/seed=0 is done, skipped" in out
    assert f"digits/max_epochs=10/seed=0 started (resume from {run / 'checkpoints' / 'last.ckpt'})" in out
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["status"] == "finished"
        and summary["resumed_from"].endswith("last.ckpt")
        and summary["global_step"] == 10
    )
    assert sorted(p.name for p in (long / "lightning_logs").iterdir()) == ["version_0"]  # the same run folder
    assert (
        first / "lightning_logs" / "version_0" / "summary.json"
    ).stat().st_mtime == stamp  # the finished run was left alone
    assert json.loads((root / "sweep.json").read_text())["runs"]["digits/max_epochs=10/seed=0"]["status"] == "done"


@pytest.mark.slow
def test_a_sweep_whose_runs_all_failed_ends_in_one_line_with_status_1(attnlab, tmp_path, in_process):
    """patch_size 3 passes the parser but not the 8x8 digits: no run finishes, so there is nothing to report."""
    path = _tiny_sweep(tmp_path, "broken", grid={"model.init_args.patch_size": [3]}, seeds=[0])
    code, out, err = attnlab("sweep", str(path))
    assert code == 1, err
    assert "Traceback" not in err and "0 done, 1 failed, 0 interrupted of 1" in out
    assert err.strip().splitlines()[-1] == (
        f"attnlab: error: sweep broken: no run finished, nothing to report; each run's log is "
        f"{tmp_path / 'root'}/<run>/sweep.log, their states are in {tmp_path / 'root' / 'sweep.json'}"
    )


@pytest.mark.slow
def test_a_sweep_stopped_before_any_run_finished_ends_in_one_line_with_status_143(attnlab, tmp_path, monkeypatch):
    """SIGTERM while the sweep's one run (a process that would sleep 20 s) runs: the run is stopped, and with no run
    finished there is nothing to report."""
    from experiments.sweep import launch
    from experiments.sweep.runs import Sweep

    path = _tiny_sweep(tmp_path, "stopped", grid={"trainer.max_epochs": [30]}, seeds=[0])
    monkeypatch.setattr(Sweep, "command", lambda self, run: [sys.executable, "-c", "import time; time.sleep(20)"])
    start = launch.spawn

    def signalled_soon_after(*args, **kwargs):
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return start(*args, **kwargs)

    monkeypatch.setattr(launch, "spawn", signalled_soon_after)
    code, out, err = attnlab("sweep", str(path))
    assert code == 128 + signal.SIGTERM, out + err
    assert "Traceback" not in err and "0 done, 0 failed, 1 interrupted of 1" in out
    assert err.strip().splitlines()[-1].startswith("attnlab: error: sweep stopped: no run finished, nothing to report")


def test_runs_go_seed_by_seed_so_a_stopped_sweep_pairs_every_cell(tmp_path):
    sweep = sweeps.load(write(tmp_path, grid={"model.init_args.lr": [0.1, 0.2, 0.3]}))
    names = [run.name for run in sweep.runs()]
    by_seed = [f"digits/lr={lr}/seed={seed}" for seed in sweep.seeds for lr in (0.1, 0.2, 0.3)]
    assert len(sweep.seeds) > 1 and names == by_seed


def test_a_bad_key_in_a_sweeps_config_names_that_file_once(attnlab, tmp_path):
    config = tmp_path / "digits_typo.yaml"
    config.write_text(Path(DIGITS).read_text().replace("max_epochs:", "max_epoch:", 1))
    path = write(tmp_path, configs=[str(config)])
    code, _, err = attnlab("sweep", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"attnlab: error: {path}: configs: {config}: trainer.max_epoch is not an option"), err
    assert err.count(str(config)) == 1, err
