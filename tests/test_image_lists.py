"""The cached file list of an ImageFolder tree (`datamodules.vision.image_lists`): torchvision's order and classes, no
rescan while the tree is unchanged, every change noticed, a damaged or unwritable cache never breaks a run."""

import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from datamodules.vision.classification import ImageFolderDataModule
from datamodules.vision.image_lists import list_images

HOUR_AGO_NS = time.time_ns() - 3600 * 10**9


def touch(path: Path | str) -> None:
    """An empty file: the listing goes by names and never opens one."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def age(*directories: Path, ns: int = HOUR_AGO_NS) -> None:
    """Date ``directories`` back to ``ns``, as a tree that has been there a while; one directory: every one below it too."""
    for directory in [d for d, _, _ in os.walk(directories[0])] if len(directories) == 1 else directories:
        os.utime(directory, ns=(ns, ns))


def as_pairs(images) -> list[tuple[str, int]]:
    return [(os.path.join(images.folder, os.fsdecode(p)), int(y)) for p, y in zip(images.paths, images.labels)]


def torchvision_pairs(folder: Path) -> list[tuple[str, int]]:
    """The peer: torchvision's own scan (the one `ImageFolder` runs)."""
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir())
    return make_dataset(str(folder), {c: i for i, c in enumerate(classes)}, extensions=IMG_EXTENSIONS)


def forbid_scanning(monkeypatch) -> None:
    def scan(*args, **kwargs):
        raise AssertionError(f"the tree was scanned: {args}")

    for name in ("scandir", "walk", "listdir"):
        monkeypatch.setattr(os, name, scan)


def test_the_list_is_torchvisions_in_its_order(tmp_path, monkeypatch):
    """Nested folders whose names sort differently as paths than as a depth-first walk ("a b" < "a/b" < "a0"),
    upper-case extensions, files that are not images, dot-files, a linked folder: the same samples as ImageFolder."""
    train = tmp_path / "train"
    files = ["cat/a/x.png", "cat/a b/y.jpg", "cat/a/b/z.PNG", "cat/a0/w.jpeg", "cat/m.png", "cat/notes.txt"]
    files += ["dog/.DS_Store", "dog/1.webp", "dog/10.bmp", "dog/2.tif", "../elsewhere/in.png"]
    for rel in files:
        (train / rel).parent.mkdir(parents=True, exist_ok=True)
        touch(train / rel)
    (train / "dog" / "linked").symlink_to(tmp_path / "elsewhere")
    age(tmp_path)
    peer = ImageFolder(str(train), is_valid_file=lambda p: p.lower().endswith(IMG_EXTENSIONS))
    scanned, cached = list_images(train, peer.classes, None), list_images(train, peer.classes, tmp_path / "cache")
    with monkeypatch.context() as patch:
        forbid_scanning(patch)
        read_back = list_images(train, peer.classes, tmp_path / "cache")
    for images in (scanned, cached, read_back):
        assert as_pairs(images) == peer.samples and images.classes == tuple(peer.classes)
        assert (images.skipped, images.skipped_example) == (1, str(train / "cat" / "notes.txt"))


@pytest.fixture
def fast_tmp(tmp_path):
    """A folder in memory (tmpfs) where there is one: 100,000 files are created there in about 1 s, 20 s on ext4."""
    if not os.access("/dev/shm", os.W_OK):
        return tmp_path
    folder = tempfile.TemporaryDirectory(dir="/dev/shm", prefix="attnlab-test-")
    yield Path(folder.name)
    folder.cleanup()


@pytest.mark.parametrize("per_folder", [20, pytest.param(1000, marks=pytest.mark.slow)], ids=["2k", "100k"])
def test_files_are_scanned_once_and_every_change_is_noticed(fast_tmp, monkeypatch, per_folder):
    """10 classes x 10 subfolders x ``per_folder`` empty files. Each changed directory keeps an mtime of its own,
    moved a second further into the past each time, so that each change is found by comparing mtimes (not by the
    racy rule). 100,000 files take about 5 s (10 s beside other work on 2 cores)."""
    train = fast_tmp / "train"
    for c in range(10):
        for s in range(10):
            folder = f"{train}/c{c}/s{s}"
            os.makedirs(folder)
            for i in range(per_folder):
                touch(f"{folder}/{i}.jpg")
    age(train)

    def datamodule() -> ImageFolderDataModule:  # lists the class folders (one directory), not the images
        return ImageFolderDataModule(str(fast_tmp), img_size=8, cache_dir=str(fast_tmp / "cache"))

    def listing(dm: ImageFolderDataModule) -> tuple[list[str], set[tuple[bytes, int]]]:
        dm.setup()
        images = dm.train_set.source.images
        return dm.class_names, set(zip(images.paths.tolist(), images.labels.tolist()))

    dm = datamodule()
    dm.setup()
    first = dm.train_set.source.images
    assert len(first.paths) == 100 * per_folder and as_pairs(first) == torchvision_pairs(train)
    dm = datamodule()
    with monkeypatch.context() as patch:
        forbid_scanning(patch)
        dm.setup()
    again = dm.train_set.source.images
    assert np.array_equal(again.paths, first.paths) and np.array_equal(again.labels, first.labels)

    changes = {  # what each does, the directories whose mtime it changes, the samples it adds and removes
        "a file added": (lambda: touch(train / "c3/s7/new.png"), ["c3/s7"], {(b"c3/s7/new.png", 3)}, set()),
        "a file removed": (lambda: (train / "c5/s2/17.jpg").unlink(), ["c5/s2"], set(), {(b"c5/s2/17.jpg", 5)}),
        "a file renamed": (
            lambda: (train / "c6/s0/3.jpg").rename(train / "c6/s0/x.png"),
            ["c6/s0"],
            {(b"c6/s0/x.png", 6)},
            {(b"c6/s0/3.jpg", 6)},
        ),
        "a subfolder added": (
            lambda: (train / "c8/s9/deeper").mkdir() or touch(train / "c8/s9/deeper/d.png"),
            ["c8/s9", "c8/s9/deeper"],
            {(b"c8/s9/deeper/d.png", 8)},
            set(),
        ),
    }
    before = listing(datamodule())[1]
    for second, (change, (make, directories, added, removed)) in enumerate(changes.items(), start=1):
        make()
        age(*(train / d for d in directories), ns=HOUR_AGO_NS + second * 10**9)
        after = listing(datamodule())[1]
        assert (after - before, before - after) == (added, removed), change
        before = after
    (train / "zebra").mkdir()
    touch(train / "zebra/z.png")
    age(train, train / "zebra", ns=HOUR_AGO_NS + 9 * 10**9)
    classes, after = listing(datamodule())
    assert classes[-1] == "zebra" and after - before == {(b"zebra/z.png", 10)}


def test_a_change_in_the_scans_timestamp_tick_is_found_next_run(tmp_path):
    """A file added right after the scan, in the same mtime tick (same mtime): the tree was modified within
    RACY_NS of the scan, so the next run rescans."""
    train = tmp_path / "train"
    (train / "cat").mkdir(parents=True)
    touch(train / "cat" / "a.png")
    mtime = (train / "cat").stat().st_mtime_ns
    assert len(list_images(train, ["cat"], tmp_path / "cache").paths) == 1
    touch(train / "cat" / "b.png")
    os.utime(train / "cat", ns=(mtime, mtime))
    assert len(list_images(train, ["cat"], tmp_path / "cache").paths) == 2


def test_the_datamodule_prepares_the_lists_once_for_every_rank(tmp_path, monkeypatch):
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.new("RGB", (12, 10)).save(tmp_path / split / c / "0.png")
    age(tmp_path)
    dm = ImageFolderDataModule(str(tmp_path), img_size=8, cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()  # local rank 0
    with monkeypatch.context() as patch:
        forbid_scanning(patch)
        dm.setup()  # every rank
        assert [y for _, y in dm.train_set] == [0, 1] and [y for _, y in dm.val_set] == [0, 1]
        assert dm.val_set[1][0].shape == (3, 8, 8)
    assert len(list((tmp_path / "cache" / "image_lists").iterdir())) == 2


def _tree(root: Path) -> Path:
    train = root / "train"
    for c in ("cat", "dog"):
        (train / c).mkdir(parents=True)
        for i in range(3):
            touch(train / c / f"{i}.png")
    age(train)
    return train


def _replace_array(path: Path, name: str, value: np.ndarray) -> None:
    with np.load(path) as cache:
        arrays = {**dict(cache), name: value}
    np.savez(path, **arrays)


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b""),
        lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
        lambda p: p.write_bytes(b"PK\x03\x04 not a zip"),
        lambda p: np.savez(p, format=1),  # a foreign layout
        lambda p: _replace_array(p, "labels", np.array([0, 1], dtype=np.int64)),  # labels that do not fit the paths
    ],
    ids=["empty", "truncated", "not-a-zip", "missing-arrays", "inconsistent"],
)
def test_a_damaged_cache_is_rebuilt_with_a_warning(tmp_path, damage):
    train = _tree(tmp_path)
    expected = as_pairs(list_images(train, ["cat", "dog"], tmp_path / "cache"))
    (path,) = (tmp_path / "cache" / "image_lists").iterdir()
    damage(path)
    with pytest.warns(UserWarning, match=rf"{path}: a damaged file list \(.*\); rescanning {train}/"):
        assert as_pairs(list_images(train, ["cat", "dog"], tmp_path / "cache")) == expected
    with np.load(path) as cache:  # rebuilt whole
        assert len(cache["paths"]) == 6


def test_a_cache_folder_that_cannot_be_written_is_a_warning(tmp_path):
    train = _tree(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.warns(UserWarning, match=r"data.cache_dir: cannot write .*file/image_lists/.*\(Not a directory\)"):
        assert len(list_images(train, ["cat", "dog"], tmp_path / "file").paths) == 6


def test_the_cache_is_keyed_by_the_resolved_folder(tmp_path, monkeypatch):
    """Two trees with the same names keep two lists; a link to a tree reads that tree's list."""
    one, two = _tree(tmp_path / "one"), _tree(tmp_path / "two")
    touch(two / "dog" / "3.png")
    age(two)
    (tmp_path / "link").symlink_to(tmp_path / "one")
    cache = tmp_path / "cache"
    assert (len(list_images(one, ["cat", "dog"], cache).paths), len(list_images(two, ["cat", "dog"], cache).paths)) == (
        6,
        7,
    )
    with monkeypatch.context() as patch:
        forbid_scanning(patch)
        assert len(list_images(tmp_path / "link" / "train", ["cat", "dog"], cache).paths) == 6


def test_a_list_answers_for_the_classes_it_was_made_for(tmp_path):
    train = _tree(tmp_path)
    assert len(list_images(train, ["cat", "dog"], tmp_path / "cache").paths) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a list made for other classes is not damaged, only not this one
        images = list_images(train, ["dog", "cat"], tmp_path / "cache")
    assert as_pairs(images)[:2] == [(str(train / "dog" / "0.png"), 0), (str(train / "dog" / "1.png"), 0)]
