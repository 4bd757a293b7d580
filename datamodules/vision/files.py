"""Readers of torchvision's dataset folders, in place and checked: MNIST-style idx files and CIFAR
python pickles, with the layouts (`LAYOUTS`: file names, sizes, channel statistics) that
torchvision's MNIST, FashionMNIST, CIFAR10 and CIFAR100 read with ``download=False``.

torchvision's own dataset classes are not used: they refuse a folder without the test files (the
training split alone is not "found"), check CIFAR files against the official MD5 sums, and answer a
damaged file with an assertion or a reshape error that does not name it. Here every bad file is a
one-line error naming the file and what was expected (header, size, truncation, one label per image,
labels in range), and the test split is optional.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset


class ArraySource(Dataset):
    """uint8 images (N, H, W) or (N, H, W, C) and labels (N,) -> (PIL image, label)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        return Image.fromarray(self.images[i]), int(self.labels[i])


# torchvision's folder layouts (download=False); statistics are the usual per-channel ones.
@dataclass(frozen=True)
class Layout:
    folder: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    num_classes: int
    in_chans: int
    img_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] = ()


def _idx_layout(name: str, mean: float, std: float, class_names: tuple[str, ...]) -> Layout:
    """MNIST and its drop-in replacements: 28x28 grayscale idx files, 10 classes, in ``<name>/raw``."""
    images, labels = "images-idx3-ubyte", "labels-idx1-ubyte"
    train, test = (f"train-{images}", f"train-{labels}"), (f"t10k-{images}", f"t10k-{labels}")
    return Layout(f"{name}/raw", train, test, 10, 1, 28, (mean,), (std,), class_names)


def _cifar_layout(
    folder: str,
    train: tuple[str, ...],
    test: tuple[str, ...],
    num_classes: int,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    class_names: tuple[str, ...] = (),
) -> Layout:
    """CIFAR's python pickles: 32x32 RGB images."""
    return Layout(folder, train, test, num_classes, 3, 32, mean, std, class_names)


_CIFAR10_NAMES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_FASHION_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
LAYOUTS = {
    "MNIST": _idx_layout("MNIST", 0.1307, 0.3081, tuple(str(i) for i in range(10))),
    "FashionMNIST": _idx_layout("FashionMNIST", 0.2860, 0.3530, _FASHION_NAMES),
    "CIFAR10": _cifar_layout(
        "cifar-10-batches-py",
        tuple(f"data_batch_{i}" for i in range(1, 6)),
        ("test_batch",),
        10,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        _CIFAR10_NAMES,
    ),
    "CIFAR100": _cifar_layout(
        "cifar-100-python", ("train",), ("test",), 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    ),
}


def read_idx_file(path: Path, shape: tuple[int | None, ...]) -> np.ndarray:
    """An uncompressed idx file of unsigned bytes (MNIST's format) whose shape matches ``shape``
    (None: any size). A truncated, compressed or foreign file is an error naming it."""
    raw = path.read_bytes()
    ndim, header = len(shape), 4 + 4 * len(shape)
    if raw[:2] == b"\x1f\x8b":
        raise ValueError(f"{path} is gzip-compressed; decompress it (gunzip -k) to the name without .gz")
    if raw[:4] != bytes((0, 0, 8, ndim)):
        raise ValueError(
            f"{path}: not an idx file of {ndim}-d unsigned bytes (starts with {raw[:4].hex(' ') or 'nothing'}, expected 00 00 08 {ndim:02x})"
        )
    if len(raw) < header:
        raise ValueError(f"{path}: {len(raw)} bytes, fewer than its header's {header}; the file is truncated")
    sizes = struct.unpack(f">{ndim}I", raw[4:header])
    if any(want is not None and got != want for got, want in zip(sizes, shape)):
        raise ValueError(
            f"{path}: holds {'x'.join(map(str, sizes))} values; expected {'x'.join('N' if w is None else str(w) for w in shape)}"
        )
    if len(raw) != header + int(np.prod(sizes)):
        raise ValueError(
            f"{path}: {len(raw)} bytes, but its header ({'x'.join(map(str, sizes))}) needs {header + int(np.prod(sizes))}; the file is truncated or corrupted"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(sizes)


def _checked_labels(path: Path, labels: np.ndarray, num_images: int, num_classes: int) -> np.ndarray:
    """``labels`` (N,) as int64 after checking there is one per image and each is a class index."""
    if labels.ndim != 1 or len(labels) != num_images or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{path}: {labels.shape} labels of type {labels.dtype} for {num_images} images; expected one integer label per image"
        )
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(bad):
        raise ValueError(
            f"{path}: record {bad[0]} has label {labels[bad[0]]}, outside 0..{num_classes - 1} ({len(bad)} such records)"
        )
    return labels.astype(np.int64)


def read_idx(folder: Path, images_file: str, labels_file: str, img_size: int, num_classes: int) -> ArraySource:
    """MNIST-style idx files (uncompressed) -> images (N, img_size, img_size) uint8, labels (N,)."""
    images = read_idx_file(folder / images_file, (None, img_size, img_size))
    if len(images) == 0:
        raise ValueError(f"{folder / images_file}: holds no images")
    labels = read_idx_file(folder / labels_file, (None,))
    return ArraySource(images, _checked_labels(folder / labels_file, labels, len(images), num_classes))


def read_cifar(folder: Path, files: Sequence[str], num_classes: int) -> ArraySource:
    """CIFAR python pickles (``data`` (N, 3072) uint8, ``labels`` or ``fine_labels``) -> (N, 32, 32, 3)."""
    images, labels = [], []
    for name in files:
        path = folder / name
        try:
            with open(path, "rb") as f:
                batch = pickle.load(f, encoding="latin1")
        except Exception as err:  # unpickling bad bytes raises anything from EOFError to ImportError
            raise ValueError(f"{path}: not a CIFAR python batch ({type(err).__name__}: {err})") from err
        if not isinstance(batch, dict) or "data" not in batch or not {"labels", "fine_labels"} & set(batch):
            found = sorted(map(str, batch)) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(
                f"{path}: not a CIFAR python batch; expected a dict with 'data' and 'labels' (or 'fine_labels'), found {found}"
            )
        data = np.asarray(batch["data"])
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) == 0:
            raise ValueError(
                f"{path}: 'data' is {data.dtype} of shape {data.shape}; expected uint8 (N, 3072) with N >= 1 (32x32 RGB images)"
            )
        images.append(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
        labels.append(
            _checked_labels(
                path, np.asarray(batch["labels"] if "labels" in batch else batch["fine_labels"]), len(data), num_classes
            )
        )
    return ArraySource(np.ascontiguousarray(np.concatenate(images)), np.concatenate(labels))
