"""The file list of an ImageFolder split, scanned once and cached.

A split folder (``<root>/train``) holds ``<class>/<image>``, with subfolders allowed. `list_images` finds its
images in torchvision's ``ImageFolder`` order: class folders sorted, and within a class ``sorted(os.walk(...))``
folders, then sorted file names, links followed. It keeps them as two arrays, paths relative to the folder
(file-system bytes) and class indices, so a DataLoader worker holds no per-image Python object.

The list is cached in ``<cache_dir>/image_lists/``, one ``.npz`` per folder, keyed by the folder's resolved
path. The cache holds the modification time (``st_mtime_ns``) of every directory the scan read. A file added,
removed or renamed changes its directory's mtime, and a new subfolder its parent's. So the next run re-stats
those directories, one ``stat`` each rather than one per file, and rescans when one changed or is gone.

A directory modified within `RACY_NS` before the scan began may change again within the same timestamp tick,
unseen; such a list is rescanned on its next use (git's "racily clean" rule). The cache is written under a
temporary name and renamed; a damaged one is rebuilt with a warning, a folder that cannot be written is a warning.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from pytorch_lightning.utilities import rank_zero_warn
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS

from datamodules.checks import open_image

FORMAT = 1  # the cache's layout; another value is rescanned
RACY_NS = 2_000_000_000  # FAT's 2-s timestamps are the coarsest in common use


@dataclass(frozen=True)
class ImageList:
    """The images of one split folder: ``paths`` (N,) relative to ``folder`` as file-system bytes,
    ``labels`` (N,) int64 indices into ``classes``; ``skipped`` files were not images by name
    (dot-files aside), e.g. ``skipped_example``."""

    folder: Path
    classes: tuple[str, ...]
    paths: np.ndarray
    labels: np.ndarray
    skipped: int
    skipped_example: str


class ListedImages(Dataset):
    """(PIL image in ``mode`` ("RGB", "L"), class index) for each image of an `ImageList`."""

    def __init__(self, images: ImageList, mode: str):
        self.images, self.mode = images, mode

    def __len__(self) -> int:
        return len(self.images.labels)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        path = os.path.join(self.images.folder, os.fsdecode(self.images.paths[i]))
        return open_image(path, self.mode), int(self.images.labels[i])


def list_images(folder: Path, classes: Sequence[str], cache_dir: Path | None) -> ImageList:
    """The images of ``folder``'s ``classes``: from the cache in ``cache_dir`` while the tree is unchanged,
    else scanned (and cached). ``cache_dir`` None scans every time."""
    if cache_dir is None:
        return _scan(folder, classes)[0]
    resolved = folder.resolve()
    key = hashlib.sha1(os.fsencode(resolved)).hexdigest()[:16]
    path = cache_dir / "image_lists" / f"{resolved.parent.name}-{resolved.name}-{key}.npz"
    images = _load(path, folder, str(resolved), classes) if path.is_file() else None
    if images is None:
        images, mtimes, scanned_ns = _scan(folder, classes)
        _save(path, images, str(resolved), mtimes, scanned_ns)
    return images


def _walk(top: str) -> Iterator[tuple[str, int, list[str]]]:
    """(directory, its st_mtime_ns, the names of its entries that are not directories) for ``top`` and every
    folder below it, links followed as ``os.walk(followlinks=True)`` does. The mtime is read before the entries,
    so a change made while they are read shows as a newer mtime."""
    stack = [top]
    while stack:
        directory = stack.pop()
        mtime, subdirs, files = os.stat(directory).st_mtime_ns, [], []
        with os.scandir(directory) as entries:
            for entry in entries:
                (subdirs if entry.is_dir() else files).append(entry.name)
        yield directory, mtime, files
        stack.extend(os.path.join(directory, name) for name in subdirs)


def _scan(folder: Path, classes: Sequence[str]) -> tuple[ImageList, dict[str, int], int]:
    """(the list, each scanned directory's mtime by path relative to ``folder``, the scan's start in ns)."""
    scanned_ns, top = time.time_ns(), str(folder)
    mtimes, paths, labels, skipped = {".": os.stat(top).st_mtime_ns}, [], [], []
    for index, name in enumerate(classes):
        for directory, mtime, files in sorted(_walk(os.path.join(top, name))):
            relative = os.path.relpath(directory, top)
            mtimes[relative] = mtime
            for file in sorted(files):
                if file.lower().endswith(IMG_EXTENSIONS):
                    paths.append(f"{relative}{os.sep}{file}")
                    labels.append(index)
                elif not file.startswith("."):  # .DS_Store and the like are not worth a warning
                    skipped.append(os.path.join(directory, file))
    empty = sorted(set(classes) - {classes[i] for i in set(labels)})
    if empty:
        raise FileNotFoundError(
            f"data.root: {folder}/: Found no valid file for the classes {', '.join(empty)}. "
            f"(image files end in {' '.join(IMG_EXTENSIONS)})"
        )
    images = ImageList(
        folder,
        tuple(classes),
        np.array(_fsencode("\0".join(paths)).split(b"\0"), dtype=bytes),  # os.fsencode of each, in one call
        np.array(labels, dtype=np.int64),
        len(skipped),
        skipped[0] if skipped else "",
    )
    return images, mtimes, scanned_ns


def _fsencode(text: str) -> bytes:
    return text.encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())


def _unchanged(top: str, dirs: np.ndarray, mtimes: np.ndarray, scanned_ns: int) -> bool:
    """Whether every directory (relative to ``top``) still has its mtime, and none was racy at the scan."""
    if mtimes.max() >= scanned_ns - RACY_NS:
        return False
    for directory, mtime in zip(dirs.tolist(), mtimes.tolist()):
        try:
            if os.stat(os.path.join(top, os.fsdecode(directory))).st_mtime_ns != mtime:
                return False
        except OSError:  # gone, or no longer readable
            return False
    return True


def _load(path: Path, folder: Path, resolved: str, classes: Sequence[str]) -> ImageList | None:
    """The cached list if it still describes the tree; None if stale, or damaged (with a warning)."""
    try:
        with np.load(path, allow_pickle=False) as cache:
            if (
                int(cache["format"]) != FORMAT
                or str(cache["folder"]) != resolved
                or cache["classes"].tolist() != list(classes)
                or not _unchanged(resolved, cache["dirs"], cache["mtimes"], int(cache["scanned_ns"]))
            ):
                return None
            paths, labels = cache["paths"], cache["labels"]
            if paths.shape != labels.shape or labels.min() < 0 or labels.max() >= len(classes):
                raise ValueError(f"{len(paths)} paths and {len(labels)} labels, in 0..{labels.max()}")
            return ImageList(
                folder, tuple(classes), paths, labels, int(cache["skipped"]), str(cache["skipped_example"])
            )
    except Exception as err:  # a truncated or foreign file raises anything from BadZipFile to KeyError
        rank_zero_warn(f"{path}: a damaged file list ({type(err).__name__}: {err}); rescanning {folder}/")
        return None


def _save(path: Path, images: ImageList, resolved: str, mtimes: dict[str, int], scanned_ns: int) -> None:
    """Write the cache under a temporary name, then rename it into place; a failure is a warning."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as f:
            np.savez(
                f,
                format=FORMAT,
                folder=resolved,
                classes=np.array(images.classes, dtype=str),
                dirs=np.array([os.fsencode(d) for d in mtimes], dtype=bytes),
                mtimes=np.array(list(mtimes.values()), dtype=np.int64),
                scanned_ns=scanned_ns,
                paths=images.paths,
                labels=images.labels,
                skipped=images.skipped,
                skipped_example=images.skipped_example,
            )
        os.replace(temporary, path)
    except OSError as err:
        if temporary.is_file():  # a write cut short, e.g. by a full disk
            temporary.unlink()
        rank_zero_warn(
            f"data.cache_dir: cannot write {path} ({err.strerror or err}); {images.folder}/ is scanned again next run"
        )
