"""The token store: a corpus tokenized once into flat files of token ids (nanoGPT's ``train.bin``, fairseq's
``.bin``/``.idx``), cached on disk and read by every process of a run without loading it.

A store is one folder, ``{cache_dir}/tokens/{label}-{hash}``:

- ``NAME.ids``: the token ids of part NAME (a corpus, or one side of a split of sentence pairs), one after the
  other, as ``uint16`` when the tokenizer's ids (added tokens included) fit in 65,536, else ``uint32``;
- ``NAME.offsets``: for sentences, ``int64``, N + 1 entries from 0: sentence i is ``ids[offsets[i]:offsets[i + 1]]``;
- ``tokenizer*.json``: the tokenizers trained for it, if any;
- ``meta.json``, written last: the store format's version, the id type, each array's length and what the store was
  made from. A folder is trusted only when its meta.json says it is complete and every array has its length.

The hash is taken over the key: the source's fingerprint (each file's resolved path, size and mtime; a dataset's
name, configuration, split and revision), the tokenizer and its settings, the split rule and `STORE_VERSION`; a
changed file or setting names another folder. `build_once` writes a store into a temporary folder beside it and
renames it into place when complete, under a file lock (``filelock``): the first process builds, the others wait
and then read the finished files; a temporary folder that a killed process left is removed by the next builder.

The files are plain arrays (``np.memmap(path, dtype)`` opens them); `TokenArray` reads the slices a batch needs with
one ``pread`` each, so resident memory stays flat however much of the store an epoch visits (a memory map's pages
count as resident once touched).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from filelock import FileLock, Timeout

STORE_VERSION = 1
META = "meta.json"
ID_TYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int, requested: str | None, key: str = "data.token_dtype") -> np.dtype:
    """The id type for a tokenizer of ``vocab_size`` ids (added tokens included): ``requested`` (one of `ID_TYPES`),
    refused when the ids do not fit it, or the smallest that fits (None)."""
    if requested is None:
        return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    dtype = np.dtype(requested)
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(
            f"{key}={requested}: the tokenizer has {vocab_size} ids (added tokens included), more than {requested} holds "
            f"({np.iinfo(dtype).max + 1}); use uint32, or leave data.token_dtype unset"
        )
    return dtype


def store_folder(cache_dir: str | Path, label: str, key: dict) -> Path:
    """The folder of the store made from what ``key`` describes (JSON-serialisable), named ``label-HASH``."""
    text = json.dumps({"store_version": STORE_VERSION, **key}, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Path(cache_dir) / "tokens" / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', label)[:60]}-{digest}"


def read_meta(folder: Path) -> dict | None:
    """The meta of a complete store in ``folder``, or None (absent, unfinished, of another version, or cut short)."""
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        return None
    if not (meta.get("complete") and meta.get("version") == STORE_VERSION):
        return None
    for name, length in meta["arrays"].items():
        itemsize = np.dtype(np.int64 if name.endswith(".offsets") else meta["dtype"]).itemsize
        path = folder / name
        if not path.is_file() or path.stat().st_size != length * itemsize:
            return None
    return meta


def build_once(folder: Path, build: Callable[[Path], dict], key: str = "data.cache_dir") -> dict:
    """The meta of the store in ``folder``. Without a complete one there, ``build(tmp)`` writes the store's files into
    a new temporary folder ``tmp`` and returns its meta (with ``arrays``: file name -> length, and ``dtype``); the
    folder is renamed into place after its meta.json. One process builds at a time (a lock beside the folder); one
    that waited finds the store built. ``key`` names the setting for errors."""
    meta = read_meta(folder)
    if meta is not None:
        return meta
    _check_writable(folder.parent, key)
    with _locked(folder):
        meta = read_meta(folder) or _build(folder, build)
        # the store is complete: a process that waits on the lock finds it so, one that comes later never locks
        Path(f"{folder}.lock").unlink(missing_ok=True)
    return meta


def _build(folder: Path, build: Callable[[Path], dict]) -> dict:
    for leftover in [folder, *folder.parent.glob(f".{folder.name}.tmp-*")]:  # an unfinished or killed build
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        meta = {**build(tmp), "version": STORE_VERSION, "complete": True}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_writable(parent: Path, key: str) -> None:
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as err:
        raise ValueError(
            f"{key}: cannot write the token store in {parent} ({err.strerror}); set data.cache_dir to a folder you can write"
        ) from None


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    lock = FileLock(f"{folder}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"attnlab: waiting for another process to prepare {folder}", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def check_free_space(folder: Path, need: int, what: str, key: str = "data.cache_dir") -> None:
    """Refuse to start a store of at most ``need`` bytes that the disk of ``folder`` has no room for."""
    free = shutil.disk_usage(folder).free
    if need > free:
        raise ValueError(
            f"{key}: {folder.parent} has {free / 1e6:.1f} MB free, and the token store of {what} may take up to "
            f"{need / 1e6:.1f} MB; free space or set data.cache_dir to a larger disk"
        )


class TokenWriter:
    """Appends one part of a store batch by batch: its ids to ``NAME.ids``, and with ``sentences`` each sentence's
    end to ``NAME.offsets`` (which starts with 0). ``arrays`` gives each file's length once closed."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, sentences: bool):
        self.folder, self.name, self.dtype = folder, name, np.dtype(dtype)
        self.ids = open(folder / f"{name}.ids", "wb")
        self.offsets = open(folder / f"{name}.offsets", "wb") if sentences else None
        self.tokens, self.sentences = 0, 0
        self._write(np.zeros(1, np.int64), self.offsets)

    def add(self, lengths: Sequence[int], ids: Iterable[int]) -> None:
        """Append a batch of sentences (or pieces of text): their lengths, and their ids one after the other."""
        lengths = np.asarray(lengths, dtype=np.int64)
        flat = np.fromiter(ids, self.dtype, int(lengths.sum()))
        self._write(flat, self.ids)
        self._write(self.tokens + np.cumsum(lengths), self.offsets)
        self.tokens, self.sentences = self.tokens + len(flat), self.sentences + len(lengths)

    def _write(self, array: np.ndarray, file) -> None:
        if file is not None:
            with self._full_disk_is_one_line():
                file.write(array.data)  # numpy's tofile loses the error number

    @contextmanager
    def _full_disk_is_one_line(self) -> Iterator[None]:
        try:
            yield
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
            raise ValueError(
                f"data.cache_dir: the disk of {self.folder.parent} filled up while the token store was written; "
                "free space or set data.cache_dir to a larger disk"
            ) from None

    @property
    def arrays(self) -> dict[str, int]:
        arrays = {f"{self.name}.ids": self.tokens}
        if self.offsets is not None:
            arrays[f"{self.name}.offsets"] = self.sentences + 1
        return arrays

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc) -> None:
        with self._full_disk_is_one_line():  # closing writes what the buffers hold
            for file in (self.ids, self.offsets):
                if file is not None:
                    file.close()


class TokenArray:
    """Entries ``start:stop`` of an array file of a store, read on access (one ``pread`` per slice): no memory
    map, so a process's resident memory does not grow with what it read. Each process opens the file on first use;
    a copy pickled to a loader worker carries the path, not the data."""

    def __init__(self, path: Path, dtype: np.dtype, start: int, stop: int):
        self.path, self.dtype, self.start, self.stop = Path(path), np.dtype(dtype), start, stop
        self._fd: int | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> np.ndarray:
        """A slice (step 1) as a numpy array of the file's type."""
        first, last, _ = index.indices(len(self))
        count = max(last - first, 0)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        data = os.pread(self._fd, count * self.dtype.itemsize, (self.start + first) * self.dtype.itemsize)
        return np.frombuffer(data, self.dtype)

    def part(self, start: int, stop: int) -> TokenArray:
        """Entries ``start:stop`` of this array."""
        return TokenArray(self.path, self.dtype, self.start + start, self.start + stop)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def open_array(folder: Path, meta: dict, name: str) -> TokenArray:
    """The whole array file ``name`` ("train.src.ids", "train.src.offsets", ...) of the store in ``folder``."""
    dtype = np.int64 if name.endswith(".offsets") else meta["dtype"]
    return TokenArray(folder / name, dtype, 0, meta["arrays"][name])
