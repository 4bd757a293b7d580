"""The token store (`datamodules.text.token_store`): ids and offsets written batch by batch read back as numpy reads
the files, the id type follows the vocabulary, and a store is built once, under a lock, into a temporary folder
renamed when complete: a failed or killed build leaves nothing that a later run trusts."""

import collections
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from datamodules.text import token_store
from datamodules.text.token_store import (
    TokenWriter,
    build_once,
    check_free_space,
    open_array,
    read_meta,
    store_folder,
    token_dtype,
)

ROOT = Path(__file__).resolve().parents[1]


def test_the_id_type_is_the_smallest_that_holds_the_vocabulary():
    assert token_dtype(1 << 16, None) == np.uint16 and token_dtype((1 << 16) + 1, None) == np.uint32
    assert token_dtype(70_000, "uint32") == np.uint32 and token_dtype(100, "uint32") == np.uint32
    with pytest.raises(
        ValueError, match=r"data.token_dtype=uint16: the tokenizer has 65537 ids .*more than uint16 holds \(65536\)"
    ):
        token_dtype(65_537, "uint16")


def write_store(folder: Path, batches: list[list[list[int]]], dtype=np.uint16) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    with TokenWriter(folder, "train.src", dtype, sentences=True) as writer:
        for batch in batches:
            writer.add([len(s) for s in batch], (i for s in batch for i in s))
    return {"dtype": np.dtype(dtype).name, "arrays": writer.arrays}


BATCHES = [[[5, 6, 7], [], [65535]], [[1, 2]], [[9] * 1000, [3]]]


def test_written_ids_and_offsets_read_back_as_numpy_reads_the_files(tmp_path):
    meta = write_store(tmp_path, BATCHES)
    sentences = [s for batch in BATCHES for s in batch]
    ids = np.memmap(tmp_path / "train.src.ids", np.uint16, mode="r")  # the files are plain arrays
    offsets = np.memmap(tmp_path / "train.src.offsets", np.int64, mode="r")
    assert meta["arrays"] == {"train.src.ids": len(ids), "train.src.offsets": len(sentences) + 1}
    assert [ids[offsets[i] : offsets[i + 1]].tolist() for i in range(len(sentences))] == sentences
    read = open_array(tmp_path, meta, "train.src.ids")
    assert read[:].tolist() == ids.tolist() and read[3:6].tolist() == ids[3:6].tolist()
    part = read.part(4, 1004)
    assert len(part) == 1000 and part[998:1000].tolist() == ids[1002:1004].tolist() and part[5:5].size == 0
    assert open_array(tmp_path, meta, "train.src.offsets")[:].tolist() == offsets.tolist()


def test_a_token_array_pickled_for_a_loader_worker_carries_the_path_not_the_data(tmp_path):
    meta = write_store(tmp_path, [[[7] * 100_000]])
    array = open_array(tmp_path, meta, "train.src.ids")
    array[:10]  # opens the file in this process
    copy = pickle.loads(pickle.dumps(array))
    assert len(pickle.dumps(array)) < 1000 and copy[99_990:].tolist() == [7] * 10


def test_a_full_disk_while_writing_is_one_line(tmp_path):
    (tmp_path / "corpus.ids").symlink_to("/dev/full")
    with pytest.raises(
        ValueError, match=rf"data.cache_dir: the disk of {tmp_path.parent} filled up .* set data.cache_dir"
    ):
        with TokenWriter(tmp_path, "corpus", np.uint16, sentences=False) as writer:
            writer.add([100_000], [1] * 100_000)
    with pytest.raises(ValueError, match="filled up"):
        with TokenWriter(tmp_path, "corpus", np.uint16, sentences=False) as writer:
            writer.add([10], [1] * 10)  # held in the file's buffer: the error comes at closing


def test_the_folder_is_named_by_the_key(tmp_path):
    a = store_folder(tmp_path, "input text", {"files": [["a.txt", 1, 2]], "tokenizer": "char"})
    assert a == store_folder(tmp_path, "input text", {"tokenizer": "char", "files": [["a.txt", 1, 2]]})
    assert a.parent == tmp_path / "tokens" and a.name.startswith("input_text-")
    assert a != store_folder(tmp_path, "input text", {"files": [["a.txt", 1, 3]], "tokenizer": "char"})  # mtime


def build_counting(calls: list):
    def build(tmp: Path) -> dict:
        calls.append(tmp)
        return write_store(tmp, BATCHES)

    return build


def test_a_store_is_built_once_then_read(tmp_path):
    calls, folder = [], tmp_path / "tokens" / "s-1"
    meta = build_once(folder, build_counting(calls))
    assert build_once(folder, build_counting(calls)) == meta == read_meta(folder) and len(calls) == 1
    assert meta["complete"] and sorted(p.name for p in folder.iterdir()) == [
        "meta.json",
        "train.src.ids",
        "train.src.offsets",
    ]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["s-1"]  # no temporary folder, no lock left


def test_a_failed_build_leaves_nothing_and_the_next_one_builds(tmp_path):
    folder = tmp_path / "tokens" / "s-1"

    def failing(tmp: Path) -> dict:
        write_store(tmp, BATCHES)
        raise ValueError("data.path: bad line")

    with pytest.raises(ValueError, match="bad line"):
        build_once(folder, failing)
    assert not folder.exists() and not list(folder.parent.glob(".s-1.tmp-*"))
    calls = []
    build_once(folder, build_counting(calls))
    assert len(calls) == 1


def test_an_incomplete_or_cut_store_is_not_trusted_and_is_rebuilt(tmp_path):
    folder, calls = tmp_path / "tokens" / "s-1", []
    build_once(folder, build_counting(calls))
    ids = folder / "train.src.ids"
    ids.write_bytes(ids.read_bytes()[:-2])  # one id short
    assert read_meta(folder) is None
    build_once(folder, build_counting(calls))
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    assert read_meta(folder) is None
    build_once(folder, build_counting(calls))
    assert len(calls) == 3 and read_meta(folder) is not None


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    folder = tmp_path / "file" / "tokens" / "s-1"  # a file where a folder should be
    with pytest.raises(
        ValueError,
        match=rf"data.cache_dir: cannot write the token store in {folder.parent} .*; set data.cache_dir to a folder you can write",
    ):
        build_once(folder, build_counting([]))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(token_store.tempfile, "TemporaryFile", denied)  # root passes the permission bits
    with pytest.raises(
        ValueError, match=r"cannot write the token store in .* \(Permission denied\); set data.cache_dir"
    ):
        build_once(tmp_path / "tokens" / "s-1", build_counting([]))


def test_too_little_free_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(token_store.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    with pytest.raises(
        ValueError, match=r"data.cache_dir: .* has 1.0 MB free, and the token store of corpus.txt may take up to 3.0 MB"
    ):
        check_free_space(tmp_path, 3 * 10**6, "corpus.txt")
    check_free_space(tmp_path, 10**6, "corpus.txt")


BUILDER = """
import os, signal, sys, time
from pathlib import Path
from datamodules.text.token_store import TokenWriter, build_once
folder, mode = Path(sys.argv[1]), sys.argv[2]
def build(tmp):
    with open(folder.parent / "builds.log", "a") as log:
        log.write(f"{os.getpid()}\\n")
    with TokenWriter(tmp, "corpus", "uint16", sentences=False) as writer:
        writer.add([3] * 1000, [1, 2, 3] * 1000)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(mode))
    return {"dtype": "uint16", "arrays": writer.arrays}
print(build_once(folder, build)["arrays"])
"""


def builder(folder: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(BUILDER), str(folder), mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_build_killed_midway_leaves_a_clean_state(tmp_path):
    folder = tmp_path / "tokens" / "s-1"
    killed = builder(folder, "kill")
    assert killed.wait(60) == -signal.SIGKILL
    assert read_meta(folder) is None and len(list(folder.parent.glob(".s-1.tmp-*"))) == 1  # half a store, untrusted
    out, _ = builder(folder, "0").communicate(timeout=60)
    assert "{'corpus.ids': 3000}" in out and read_meta(folder)["arrays"] == {"corpus.ids": 3000}
    assert not list(folder.parent.glob(".s-1.tmp-*"))  # the next builder removed the leftover


@pytest.mark.slow
def test_processes_that_start_together_build_once(tmp_path):
    folder = tmp_path / "tokens" / "s-1"
    processes = [builder(folder, "3.0") for _ in range(3)]
    results = [p.communicate(timeout=60) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], results
    assert len((tmp_path / "tokens" / "builds.log").read_text().splitlines()) == 1
    assert all("{'corpus.ids': 3000}" in out for out, _ in results)
    assert sum("waiting for another process to prepare" in err for _, err in results) >= 1
    assert sorted(p.name for p in folder.parent.iterdir()) == ["builds.log", "s-1"]  # no lock file left
