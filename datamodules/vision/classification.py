"""Image-classification DataModules. Datasets are read in their standard local layouts; nothing
is downloaded.

`DigitsDataModule`: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes),
the embedded default that needs no download.
`TorchvisionDataModule`: MNIST, FashionMNIST, CIFAR10, CIFAR100 in the folder layouts that
torchvision's datasets read with ``download=False``, read by `datamodules.vision.files`.
`ImageFolderDataModule`: any ``<root>/train/<class>/<image>`` tree (``val/`` and ``test/`` optional),
its file lists cached between runs.

Where a dataset has no validation split, one is split off the training data with a fixed seed.
Training augmentation is timm's ``create_transform`` (RandAugment, random erasing, ...) and
Mixup/CutMix timm's ``Mixup``, both configured in YAML (``data.augment``, ``data.mixup``);
normalisation uses each dataset's channel statistics. Every DataModule knows ``num_classes``,
``in_chans`` and ``img_size`` (linked to the model) right after ``__init__``.

Bad input is an error naming the file and the record: idx and CIFAR files are checked when read
at setup (`datamodules.vision.files`: header, size, truncation, one label per image, labels in
range); an image file that cannot be decoded is found when it is loaded and named then. Files of an
ImageFolder that are not images by name are skipped and counted, as torchvision skips them (silently).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_warn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, Mixup, create_transform
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate, random_split
from torchvision import transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

from datamodules.checks import check_train_batches
from datamodules.loading import loader_settings
from datamodules.vision.files import LAYOUTS, ArraySource, read_cifar, read_idx
from datamodules.vision.image_lists import ListedImages, list_images
from datamodules.vision.packing import ImagePacking, packed_loader_kwargs


def split_lengths(n: int, val_fraction: float, test_fraction: float = 0.0) -> list[int]:
    """Sizes of (train, val[, test]) for ``n`` samples; fractions must leave a non-empty train split."""
    for key, f in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0 <= f < 1:
            raise ValueError(f"data.{key}={f} must be in [0, 1)")
    n_val, n_test = round(n * val_fraction), round(n * test_fraction)
    if n - n_val - n_test < 1:
        raise ValueError(
            f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} leave no training samples out of {n}"
        )
    for key, f, size in (("val_fraction", val_fraction, n_val), ("test_fraction", test_fraction, n_test)):
        if f > 0 and size == 0:  # an empty split would silently skip its loop (and the checkpoint's metric)
            raise ValueError(f"data.{key}={f} of {n} samples is an empty split; raise it to at least {1 / n:.2g}")
    return [n - n_val - n_test, n_val] + ([n_test] if test_fraction else [])


def _subset(indices: Tensor, size: int | None, seed: int) -> Tensor:
    """A fixed-seed random ``size`` of ``indices`` (all of them when ``size`` is None)."""
    if size is None:
        return indices
    if not 0 < size <= len(indices):
        raise ValueError(f"data.train_subset={size} must be in [1, {len(indices)}] (the training split's size)")
    return indices[torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed))[:size]]


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's digits, split train/val/test with a fixed seed, standardised with train statistics.

    ``img_size`` > 8 upsamples the images (bilinear), e.g. to 28 to fine-tune a model pretrained
    on FashionMNIST; ``train_subset`` keeps that many training images (fixed seed), for low-data runs.
    Linked to the model: ``num_classes`` = 10, ``in_chans`` = 1, ``img_size``.
    Batches: images (B, 1, img_size, img_size) float, labels (B,) long.
    """

    num_classes, in_chans = 10, 1

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        img_size: int = 8,
        train_subset: int | None = None,
    ):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        if img_size < 8:
            raise ValueError(f"data.img_size={img_size} must be >= 8 (the digits are 8x8)")
        self.save_hyperparameters()
        self.img_size = img_size
        self.loader_kwargs = loader_settings(num_workers, pin_memory, persistent_workers)
        split_lengths(1797, val_fraction, test_fraction)  # refuse bad fractions before training

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
        if self.img_size != 8:
            images = F.interpolate(images, size=(self.img_size, self.img_size), mode="bilinear", align_corners=False)
        labels = torch.tensor(digits.target, dtype=torch.long)
        hp = self.hparams
        lengths = split_lengths(len(labels), hp.val_fraction, hp.test_fraction)
        parts = random_split(range(len(labels)), lengths, generator=torch.Generator().manual_seed(hp.seed))
        idx = [torch.tensor(p.indices) for p in parts] + [torch.tensor([], dtype=torch.long)] * (3 - len(parts))
        idx[0] = _subset(idx[0], hp.train_subset, hp.seed)
        mean, std = images[idx[0]].mean(), images[idx[0]].std()
        images = (images - mean) / std
        self.train_set, self.val_set, self.test_set = (TensorDataset(images[i], labels[i]) for i in idx)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        hp = self.hparams
        return DataLoader(dataset, batch_size=hp.batch_size, shuffle=shuffle, **self.loader_kwargs)

    def train_dataloader(self) -> DataLoader:
        check_train_batches(len(self.train_set), self.hparams.batch_size, False, "scikit-learn's digits")
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


class Transformed(Dataset):
    """The samples ``indices`` of a (PIL image, label) source, through ``transform``."""

    def __init__(self, source: Dataset, indices: Tensor, transform: Callable):
        self.source, self.indices, self.transform = source, indices.tolist(), transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        image, label = self.source[self.indices[i]]
        return self.transform(image), label


class MixupCollate:
    """Collate a batch, then Mixup/CutMix it (timm's ``Mixup``): labels become soft targets (B, K)
    that sum to 1."""

    def __init__(self, mixup: Mixup):
        self.mixup = mixup

    def __call__(self, samples: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
        images, labels = default_collate(samples)
        return self.mixup(images, labels)


# Options the DataModule sets itself -> where a user sets them instead.
_TRANSFORM_FIXED = {
    "input_size": "data.img_size",
    "is_training": "data.augment: null",
    "mean": "data.mean",
    "std": "data.std",
}
_MIXUP_FIXED = {"self": "", "num_classes": "the dataset", "label_smoothing": "model.label_smoothing"}


def _check_options(key: str, options: dict[str, Any], fn: Callable, fixed: dict[str, str]) -> dict[str, Any]:
    """Refuse options that ``fn`` does not take or that are set elsewhere; YAML lists become tuples."""
    known = set(inspect.signature(fn).parameters) - set(fixed)
    for name in options:
        if name in fixed:
            raise ValueError(f"data.{key}.{name} is not set here; it comes from {fixed[name]}")
        if name not in known:
            raise ValueError(
                f"data.{key}.{name} is not an option of {fn.__module__}.{fn.__qualname__}; choose from {', '.join(sorted(known))}"
            )
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


class ImageDataModule(pl.LightningDataModule):
    """Split, transforms, Mixup and loaders shared by the folder-reading DataModules.

    Subclasses fix ``num_classes``, ``in_chans`` and ``img_size`` in ``__init__`` (before calling this one),
    pass their ``batch_size``, the dataset's channel statistics ``stats`` = (mean, std) and the images'
    ``native_size`` (None: various), hand on the other arguments (``**kwargs``), and implement `_sources`.

    Args:
        batch_size, num_workers, pin_memory, persistent_workers: loader settings (see `datamodules.loading`).
        val_fraction, seed: the validation split taken off the training data where the dataset
            has none (fixed seed); the seed also fixes ``train_subset``.
        train_subset: keep only this many training images (fixed seed), for low-data fine-tuning.
        augment: options of timm's ``create_transform`` for training images (e.g. ``scale``,
            ``hflip``, ``auto_augment: rand-m9-mstd0.5-inc1-mmax9``, ``re_prob``); None trains on
            the evaluation transform (resize and normalise only).
        mixup: options of timm's ``Mixup`` (``mixup_alpha``, ``cutmix_alpha``, ``prob``,
            ``switch_prob``, ``mode``); labels become soft targets. Label smoothing is the model's
            ``label_smoothing``.
        mean, std: channel statistics (default: the dataset's).
        packing: NaViT's packing (`datamodules.vision.packing.ImagePacking`): ``{sizes: [14, 28], max_pixels: 4096}``
            resizes each image to a side drawn from ``sizes`` and fills each batch with images up to ``max_pixels``,
            which the ViT packs into one sequence; ``img_size`` stays the model's training size (its learned positions).
    Batches: images (B, in_chans, img_size, img_size) normalised, labels (B,) or (B, num_classes); with ``packing``,
    a list of N images (in_chans, s_i, s_i) and labels (N,).
    """

    num_classes: int
    in_chans: int
    img_size: int
    class_names: list[str]

    def __init__(
        self,
        batch_size: int,
        stats: tuple[Sequence[float], Sequence[float]],
        native_size: int | None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        val_fraction: float = 0.1,
        seed: int = 0,
        train_subset: int | None = None,
        augment: dict[str, Any] | None = None,
        mixup: dict[str, Any] | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        packing: ImagePacking | None = None,
    ):
        super().__init__()
        mean, std = mean or stats[0], std or stats[1]
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
        for key, stat in (("mean", mean), ("std", std)):
            if len(stat) != self.in_chans:
                raise ValueError(
                    f"data.{key}={list(stat)} has {len(stat)} values; the images have {self.in_chans} channels"
                )
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.loader_kwargs = loader_settings(num_workers, pin_memory, persistent_workers)
        self.train_subset = train_subset
        self.mean, self.std = tuple(mean), tuple(std)
        if augment is not None:
            augment = _check_options("augment", augment, create_transform, _TRANSFORM_FIXED)
        self.train_transform, self.eval_transform = self._transforms(self.img_size, native_size, augment)
        self.packing = packing
        if packing is not None:
            if mixup is not None:
                raise ValueError("data.mixup mixes images of one size; unset it with data.packing")
            self.packed_transforms = {side: self._transforms(side, native_size, augment) for side in packing.sizes}
        self.mixup = None
        if mixup is not None:
            if batch_size % 2:
                raise ValueError(
                    f"data.batch_size={batch_size} must be even with data.mixup (timm's Mixup pairs each image with another)"
                )
            options = _check_options("mixup", mixup, Mixup.__init__, _MIXUP_FIXED)
            self.mixup = Mixup(**options, label_smoothing=0.0, num_classes=self.num_classes)

    def _transforms(self, side: int, native_size: int | None, augment: dict | None) -> tuple[Callable, Callable]:
        """The (training, evaluation) transforms to images of ``side`` x ``side``."""
        size = (self.in_chans, side, side)
        if native_size == side:  # nothing to resize: skip PIL resampling, the slow part
            evaluation = transforms.Compose([transforms.ToTensor(), transforms.Normalize(self.mean, self.std)])
        else:
            evaluation = create_transform(
                size, is_training=False, mean=self.mean, std=self.std, crop_pct=1.0, interpolation="bicubic"
            )
        if augment is None:
            return evaluation, evaluation
        return create_transform(size, is_training=True, mean=self.mean, std=self.std, **augment), evaluation

    def _sources(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        """(train, val or None, test or None), each yielding (PIL image, label)."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        train, val, test = self._sources()
        train_idx = torch.arange(len(train))
        if val is None:
            if self.val_fraction == 0:
                raise ValueError(
                    f"data.val_fraction=0: {type(self).__name__} has no validation split of its own; give a fraction such as 0.1"
                )
            parts = random_split(
                range(len(train)),
                split_lengths(len(train), self.val_fraction),
                generator=torch.Generator().manual_seed(self.seed),
            )
            train_idx, val, val_idx = torch.tensor(parts[0].indices), train, torch.tensor(parts[1].indices)
        else:
            val_idx = torch.arange(len(val))
        self.train_set = Transformed(train, _subset(train_idx, self.train_subset, self.seed), self.train_transform)
        self.val_set = Transformed(val, val_idx, self.eval_transform)
        self.test_set = None if test is None else Transformed(test, torch.arange(len(test)), self.eval_transform)

    def _loader(self, dataset: Transformed, train: bool = False) -> DataLoader:
        if self.packing is not None:
            sized = {side: pair[0 if train else 1] for side, pair in self.packed_transforms.items()}
            kwargs = packed_loader_kwargs(self.packing, dataset.source, dataset.indices, sized, train, self.seed)
            return DataLoader(**kwargs, **self.loader_kwargs)
        mixup = train and self.mixup is not None
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            **self.loader_kwargs,
            collate_fn=MixupCollate(self.mixup) if mixup else None,
            drop_last=mixup,  # timm's Mixup pairs a batch with its reverse
        )

    def train_dataloader(self) -> DataLoader:
        batch_size = 1 if self.packing else self.batch_size  # packed batches are sized by data.packing.max_pixels
        check_train_batches(len(self.train_set), batch_size, self.mixup is not None, self._describe())
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        if self.test_set is None:
            raise FileNotFoundError(
                f"{type(self).__name__}: no test split here ({self._test_hint()}); use `attnlab validate`"
            )
        return self._loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        """The test split where there is one, else the validation split."""
        return self._loader(self.val_set if self.test_set is None else self.test_set)

    def _test_hint(self) -> str:
        raise NotImplementedError

    def _describe(self) -> str:
        """The data's place on disk, for messages."""
        raise NotImplementedError


class TorchvisionDataModule(ImageDataModule):
    """MNIST, FashionMNIST, CIFAR10 or CIFAR100 in torchvision's folder layout, read in place.

    ``root`` is the folder that torchvision's datasets get (``root=...``, ``download=False``):
    ``<root>/FashionMNIST/raw/train-images-idx3-ubyte`` ... (uncompressed idx files),
    ``<root>/cifar-10-batches-py/data_batch_1`` ..., ``<root>/cifar-100-python/train``. The test
    split (``t10k-*``, ``test_batch``, ``test``) is optional; validation is split off the
    training data. ``img_size`` resizes the images (default: their own size).
    See `ImageDataModule` for the other arguments.
    """

    def __init__(
        self,
        name: Literal["MNIST", "FashionMNIST", "CIFAR10", "CIFAR100"] = "FashionMNIST",
        root: str = "../shared/data",
        img_size: int | None = None,
        batch_size: int = 128,
        **kwargs,
    ):
        if name not in LAYOUTS:
            raise ValueError(f"data.name={name!r} is not known; choose one of {', '.join(LAYOUTS)}")
        self.name, self.layout = name, LAYOUTS[name]
        self.folder = Path(root) / self.layout.folder
        missing = [f for f in self.layout.train if not (self.folder / f).is_file()]
        if missing:
            raise FileNotFoundError(
                f"data.root={root}: {name} not found; expected {', '.join(self.layout.train)} in {self.folder}/ "
                f"(torchvision's {name} layout, uncompressed; nothing is downloaded)"
            )
        self.num_classes, self.in_chans = self.layout.num_classes, self.layout.in_chans
        self.img_size = img_size or self.layout.img_size
        self.class_names = list(self.layout.class_names) or [str(i) for i in range(self.num_classes)]
        super().__init__(batch_size, (self.layout.mean, self.layout.std), self.layout.img_size, **kwargs)

    def _read(self, files: Sequence[str]) -> ArraySource:
        if self.name.startswith("CIFAR"):
            return read_cifar(self.folder, files, self.num_classes)
        return read_idx(self.folder, *files, self.layout.img_size, self.num_classes)

    def _sources(self) -> tuple[Dataset, None, Dataset | None]:
        has_test = all((self.folder / f).is_file() for f in self.layout.test)
        return self._read(self.layout.train), None, self._read(self.layout.test) if has_test else None

    def _test_hint(self) -> str:
        return f"expected {', '.join(self.layout.test)} in {self.folder}/"

    def _describe(self) -> str:
        return f"{self.name} in {self.folder}/"


class ImageFolderDataModule(ImageDataModule):
    """Any ImageFolder tree: ``<root>/train/<class>/<image>``, and optionally ``<root>/val/...`` and
    ``<root>/test/...`` with the same class folders (else validation is split off ``train``).

    Images are converted to ``in_chans`` (1: grayscale, 3: RGB) and resized to ``img_size``
    (timm's evaluation transform: resize the short side, centre crop). Statistics default to
    ImageNet's (what timm's pretrained weights expect). Each split's file list is kept in
    ``cache_dir``/image_lists/ and read again while the tree is unchanged, so a second run does not
    rescan it (`datamodules.vision.image_lists`); ``cache_dir`` None scans every run. See `ImageDataModule`
    for the rest.
    """

    def __init__(
        self,
        root: str,
        img_size: int = 224,
        in_chans: Literal[1, 3] = 3,
        batch_size: int = 64,
        cache_dir: str | None = "runs/data",
        **kwargs,
    ):
        if in_chans not in (1, 3):
            raise ValueError(f"data.in_chans={in_chans} must be 1 (grayscale) or 3 (RGB)")
        self.root, self.cache_dir = Path(root), None if cache_dir is None else Path(cache_dir)
        self.class_names = self._classes(self.root / "train")
        for split in ("val", "test"):
            if (self.root / split).is_dir() and self._classes(self.root / split) != self.class_names:
                raise ValueError(f"data.root={root}: the class folders of {split}/ differ from those of train/")
        self.num_classes, self.in_chans, self.img_size = len(self.class_names), in_chans, img_size
        rgb = in_chans == 3
        default_mean = IMAGENET_DEFAULT_MEAN if rgb else (sum(IMAGENET_DEFAULT_MEAN) / 3,)
        default_std = IMAGENET_DEFAULT_STD if rgb else (sum(IMAGENET_DEFAULT_STD) / 3,)
        super().__init__(batch_size, (default_mean, default_std), None, **kwargs)

    @staticmethod
    def _classes(folder: Path) -> list[str]:
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
        if not classes:
            raise FileNotFoundError(
                f"data.root: no class folders in {folder}/; expected the ImageFolder layout "
                f"<root>/train/<class>/<image> with images {' '.join(IMG_EXTENSIONS)} (val/ and test/ optional)"
            )
        return classes

    def prepare_data(self) -> None:
        """List each split once per node (the cache), before every rank reads the lists in `setup`."""
        for split in ("train", "val", "test"):
            if (self.root / split).is_dir():
                list_images(self.root / split, self.class_names, self.cache_dir)

    def _folder(self, split: str) -> ListedImages | None:
        """The images of ``split`` (None if absent); files that are not images by name are skipped and counted."""
        folder = self.root / split
        if not folder.is_dir():
            return None
        images = list_images(folder, self.class_names, self.cache_dir)
        if images.skipped:
            rank_zero_warn(
                f"{folder}/: skipped {images.skipped} files that are not images ({' '.join(IMG_EXTENSIONS)}), e.g. {images.skipped_example}"
            )
        return ListedImages(images, "RGB" if self.in_chans == 3 else "L")

    def _sources(self) -> tuple[Dataset, Dataset | None, Dataset | None]:
        return self._folder("train"), self._folder("val"), self._folder("test")

    def _test_hint(self) -> str:
        return f"expected {self.root}/test/<class>/<image>"

    def _describe(self) -> str:
        return f"{self.root}/"
