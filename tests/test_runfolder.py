"""experiments.runfolder: the run folder's files read and written through one schema."""

import json
import os
import socket
from datetime import datetime, timedelta, timezone

from builders import gone_pid

from experiments.runfolder import (
    STALE_S,
    Summary,
    SweepRun,
    SweepStatus,
    cli_flags,
    drop_rows_from,
    newest,
    newest_checkpoint,
    read_json,
    split_extra,
)


def test_a_summary_round_trips_and_keeps_keys_it_does_not_know(tmp_path):
    data = {"status": "finished", "best": {"monitor": "val/acc", "value": 0.9}, "future_key": [1, 2]}
    (tmp_path / "summary.json").write_text(json.dumps(data))
    summary = Summary.read(tmp_path)  # the folder or the file
    assert summary == Summary.read(tmp_path / "summary.json")
    assert (summary.status, summary.best["value"], summary.best["monitor"], summary.modality) == (
        "finished",
        0.9,
        "val/acc",
        None,
    )
    summary.write(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == data
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_missing_or_broken_files_read_as_empty(tmp_path):
    (tmp_path / "broken.json").write_text('{"status": "fini')
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_json(None) == read_json(tmp_path / "none.json") == read_json(tmp_path / "broken.json") == {}
    assert read_json(tmp_path / "list.json") == {}
    assert Summary.read(tmp_path / "none.json") == Summary() and SweepStatus.read(tmp_path) == SweepStatus()


def test_the_sweep_status_holds_its_runs_as_dataclasses(tmp_path):
    status = SweepStatus(name="s", configs={"digits": {"config": "configs/digits.yaml", "grid": {"k": [1, 2]}}})
    status.runs["digits/k=2/seed=0"] = SweepRun(config="configs/digits.yaml", cell={"k": 2}, seed=0, status="pending")
    status.runs["digits/k=2/seed=0"].update(status="failed", error="attnlab: error: boom", node="n1")
    status.write(tmp_path)
    again = SweepStatus.read(tmp_path)
    run = again.runs["digits/k=2/seed=0"]
    assert (run.status, run.error, run.extra) == ("failed", "attnlab: error: boom", {"node": "n1"})
    assert again.grid(run) == {"k": [1, 2]} and again == status


def test_the_newest_checkpoint_below_a_folder(tmp_path):
    assert newest_checkpoint(tmp_path) is None
    paths = [
        tmp_path / "lightning_logs" / v / "checkpoints" / name
        for v, name in (("version_0", "last.ckpt"), ("version_1", "last-v1.ckpt"), ("version_1", "best.ckpt"))
    ]
    for stamp, path in enumerate(paths):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
        os.utime(path, ns=(stamp * 10**9, stamp * 10**9))
    assert newest_checkpoint(tmp_path) == paths[1] and newest_checkpoint(tmp_path, "best") == paths[2]
    os.utime(paths[0], ns=(9 * 10**9, 9 * 10**9))  # by time, not by name
    assert newest_checkpoint(tmp_path, "last") == paths[0]
    assert newest(["", tmp_path / "gone.ckpt", *paths]) == paths[0]


def test_settings_become_fit_arguments_and_extra_arguments_follow_the_double_dash():
    flags = {"trainer.max_epochs": 3, "model.init_args.attention.similarity": "dot", "a": None, "b": True, "c": [1, 2]}
    assert cli_flags(flags) == [
        "--trainer.max_epochs=3",
        "--model.init_args.attention.similarity=dot",
        "--a=null",
        "--b=true",
        "--c=[1, 2]",
    ]
    assert split_extra(["f.yaml", "--root", "r", "--", "--trainer.max_epochs=1", "--"]) == (
        ["f.yaml", "--root", "r"],
        ["--trainer.max_epochs=1", "--"],
    )
    assert split_extra(["f.yaml"]) == (["f.yaml"], [])


def test_a_running_summary_whose_process_is_gone_reads_as_killed():
    here = socket.gethostname()
    assert Summary(status="running", pid=gone_pid(), host=here).state() == "killed"
    assert Summary(status="running", pid=os.getpid(), host=here).state() == "running"
    assert Summary(status="interrupted", pid=gone_pid(), host=here).state() == "interrupted"  # not running: as it says
    assert Summary(status="running").state() == "running"  # a summary without a pid cannot tell


def test_a_running_summary_from_another_host_is_stale_when_its_heartbeat_is_old():
    now = datetime.now(timezone.utc)
    beat = {s: (now - timedelta(seconds=s)).isoformat(timespec="seconds") for s in (30, STALE_S + 60)}
    elsewhere = dict(status="running", pid=os.getpid(), host=f"not-{socket.gethostname()}")
    assert Summary(**elsewhere, heartbeat=beat[30]).state() == "running"  # its pid means nothing here
    assert Summary(**elsewhere, heartbeat=beat[STALE_S + 60]).state() == "stale"


def test_drop_rows_from_keeps_the_rows_before_the_step_and_the_header(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss,val/loss\n0,0,2.0,\n0,1,1.5,\n0,1,,1.4\n1,2,1.2,\n1,3,1.1,\n")
    drop_rows_from(path, 2)
    assert path.read_text() == "epoch,step,train/loss,val/loss\n0,0,2.0,\n0,1,1.5,\n0,1,,1.4\n"
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed
