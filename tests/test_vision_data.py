"""Vision DataModules on tiny generated datasets in each standard layout; splits, augmentation,
Mixup, and the errors for a missing dataset or a bad option."""

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from datamodules.vision.classification import DigitsDataModule, ImageFolderDataModule, TorchvisionDataModule
from datamodules.vision.files import LAYOUTS


def _pixels(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, *shape), dtype=np.uint8)


def _write_idx(path, array: np.ndarray) -> None:
    """The idx format of MNIST: 0, 0, type 0x08 (ubyte), ndim, big-endian sizes, then the bytes."""
    path.write_bytes(
        struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    )


def make_mnist(root, name: str, n_train: int = 40, n_test: int = 0) -> tuple[np.ndarray, np.ndarray]:
    raw = root / name / "raw"
    raw.mkdir(parents=True)
    images, labels = _pixels(n_train, (28, 28)), np.arange(n_train, dtype=np.uint8) % 10
    _write_idx(raw / "train-images-idx3-ubyte", images)
    _write_idx(raw / "train-labels-idx1-ubyte", labels)
    if n_test:
        _write_idx(raw / "t10k-images-idx3-ubyte", _pixels(n_test, (28, 28), seed=1))
        _write_idx(raw / "t10k-labels-idx1-ubyte", np.zeros(n_test, dtype=np.uint8))
    return images, labels


def make_cifar(root, name: str, per_batch: int = 8) -> None:
    layout = LAYOUTS[name]
    folder = root / layout.folder
    folder.mkdir(parents=True)
    key = "labels" if name == "CIFAR10" else "fine_labels"
    for i, file in enumerate(layout.train + layout.test):
        data = np.zeros((per_batch, 3, 32, 32), dtype=np.uint8)
        data[:, 0] = 255  # red images: a wrong channel order shows
        batch = {"data": data.reshape(per_batch, 3072), key: [(i + j) % layout.num_classes for j in range(per_batch)]}
        (folder / file).write_bytes(pickle.dumps(batch))


def make_image_folder(root, splits=("train",), classes=("cat", "dog", "fox"), per_class: int = 4) -> None:
    for split in splits:
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (20 + i, 16), (80 * c, 10 * i, 200)).save(root / split / name / f"{i}.png")


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST"])
def test_mnist_layouts_are_read_in_place_and_normalised(tmp_path, name):
    images, labels = make_mnist(tmp_path, name, n_train=40)
    dm = TorchvisionDataModule(name=name, root=str(tmp_path), val_fraction=0.25, batch_size=8)
    assert (dm.num_classes, dm.in_chans, dm.img_size) == (10, 1, 28)
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), dm.test_set) == (30, 10, None)
    index = dm.train_set.indices[0]
    image, label = dm.train_set[0]
    (mean,), (std,) = LAYOUTS[name].mean, LAYOUTS[name].std
    torch.testing.assert_close(
        image[0] * std + mean, torch.tensor(images[index] / 255, dtype=torch.float32), atol=1e-5, rtol=0
    )
    assert label == labels[index]
    x, y = next(iter(dm.val_dataloader()))
    assert x.shape == (8, 1, 28, 28) and y.dtype == torch.long
    with pytest.raises(FileNotFoundError, match="no test split here .*t10k-images-idx3-ubyte"):
        dm.test_dataloader()


def test_the_test_split_is_used_when_present_and_predicted_on(tmp_path):
    make_mnist(tmp_path, "MNIST", n_train=20, n_test=6)
    dm = TorchvisionDataModule(name="MNIST", root=str(tmp_path), batch_size=4)
    dm.setup()
    assert len(dm.test_set) == 6 and len(dm.predict_dataloader().dataset) == 6


@pytest.mark.parametrize("name", ["CIFAR10", "CIFAR100"])
def test_cifar_layouts_keep_channels_in_order(tmp_path, name):
    make_cifar(tmp_path, name)
    dm = TorchvisionDataModule(name=name, root=str(tmp_path), val_fraction=0.1, batch_size=4, img_size=16)
    assert (dm.num_classes, dm.in_chans, dm.img_size) == (LAYOUTS[name].num_classes, 3, 16)
    dm.setup()
    n_train = 8 * len(LAYOUTS[name].train)
    assert len(dm.train_set) + len(dm.val_set) == n_train and len(dm.test_set) == 8
    image, _ = dm.test_set[0]
    assert image.shape == (3, 16, 16)
    mean, std = torch.tensor(LAYOUTS[name].mean), torch.tensor(LAYOUTS[name].std)
    torch.testing.assert_close(image.mean((1, 2)) * std + mean, torch.tensor([1.0, 0.0, 0.0]), atol=1e-3, rtol=0)


def test_image_folder_with_and_without_a_val_folder(tmp_path):
    make_image_folder(tmp_path / "a", splits=("train", "val"))
    dm = ImageFolderDataModule(root=str(tmp_path / "a"), img_size=16, batch_size=4)
    assert (dm.num_classes, dm.in_chans, dm.img_size, dm.class_names) == (3, 3, 16, ["cat", "dog", "fox"])
    dm.setup()
    assert len(dm.train_set) == len(dm.val_set) == 12
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 16, 16)

    make_image_folder(tmp_path / "b")
    gray = ImageFolderDataModule(root=str(tmp_path / "b"), img_size=8, in_chans=1, val_fraction=0.25, batch_size=4)
    gray.setup()
    assert (len(gray.train_set), len(gray.val_set), gray.test_set) == (9, 3, None)
    assert gray.val_set[0][0].shape == (1, 8, 8)


def test_image_folder_val_classes_must_match_train(tmp_path):
    make_image_folder(tmp_path, splits=("train",))
    make_image_folder(tmp_path, splits=("val",), classes=("cat", "dog"))
    with pytest.raises(ValueError, match="class folders of val/ differ from those of train/"):
        ImageFolderDataModule(root=str(tmp_path))


@pytest.mark.parametrize(
    "make,expected",
    [
        (
            lambda root: TorchvisionDataModule(name="FashionMNIST", root=str(root)),
            r"FashionMNIST not found; expected train-images-idx3-ubyte, train-labels-idx1-ubyte in .*/FashionMNIST/raw/ \(torchvision's",
        ),
        (
            lambda root: TorchvisionDataModule(name="CIFAR10", root=str(root)),
            r"expected data_batch_1, .* in .*/cifar-10-batches-py/",
        ),
        (
            lambda root: ImageFolderDataModule(root=str(root)),
            r"no class folders in .*/train/; expected the ImageFolder layout <root>/train/<class>/<image>",
        ),
    ],
)
def test_a_missing_dataset_names_the_folder_and_the_layout(tmp_path, make, expected):
    with pytest.raises(FileNotFoundError, match=expected):
        make(tmp_path)


def test_missing_dataset_is_one_line_from_the_cli(attnlab, tmp_path):
    code, _, err = attnlab(
        "fit",
        "--config",
        "configs/vision/fashion_mnist.yaml",
        f"--data.init_args.root={tmp_path}",
        f"--trainer.default_root_dir={tmp_path}",
    )
    lines = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert code == 2 and len(lines) == 1 and f"data.root={tmp_path}: FashionMNIST not found" in lines[0], err


def test_validation_split_and_train_subset_are_fixed_by_the_seed(tmp_path):
    make_mnist(tmp_path, "FashionMNIST", n_train=50)

    def split(seed):
        dm = TorchvisionDataModule(root=str(tmp_path), val_fraction=0.2, seed=seed, train_subset=10)
        dm.setup()
        return dm.train_set.indices, dm.val_set.indices

    (train, val), (train2, val2), (_, val3) = split(0), split(0), split(1)
    assert (train, val) == (train2, val2) and val != val3
    assert len(train) == 10 and len(val) == 10 and not set(train) & set(val)


def test_mixup_targets_are_soft_and_sum_to_one(tmp_path):
    make_mnist(tmp_path, "FashionMNIST", n_train=40)
    dm = TorchvisionDataModule(
        root=str(tmp_path), batch_size=6, mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5}
    )
    dm.setup()
    for x, y in dm.train_dataloader():
        assert x.shape == (6, 1, 28, 28) and y.shape == (6, 10)
        torch.testing.assert_close(y.sum(-1), torch.ones(6))
        assert (y > 0).sum(-1).max() == 2  # each image mixes two labels
    x, y = next(iter(dm.val_dataloader()))
    assert y.ndim == 1  # evaluation stays on hard labels


def test_augmentation_is_random_for_training_only(tmp_path):
    make_mnist(tmp_path, "FashionMNIST", n_train=20)
    dm = TorchvisionDataModule(
        root=str(tmp_path), augment={"scale": [0.5, 1.0], "auto_augment": "rand-m9-mstd0.5-inc1-mmax9", "re_prob": 0.5}
    )
    dm.setup()
    torch.manual_seed(0)
    assert not all(torch.equal(dm.train_set[0][0], dm.train_set[0][0]) for _ in range(3))
    assert torch.equal(dm.val_set[0][0], dm.val_set[0][0])


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (
            dict(mixup={"mixup_alpha": 0.8, "label_smoothing": 0.1}),
            "data.mixup.label_smoothing is not set here; it comes from model.label_smoothing",
        ),
        (
            dict(augment={"rand_augment": "m9"}),
            "data.augment.rand_augment is not an option of timm.data.transforms_factory.create_transform",
        ),
        (dict(mean=[0.5, 0.5, 0.5]), r"data.mean=\[0.5, 0.5, 0.5\] has 3 values; the images have 1 channels"),
        (dict(val_fraction=1.0), r"data.val_fraction=1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_options_are_refused_in_init(tmp_path, kwargs, expected):
    make_mnist(tmp_path, "FashionMNIST", n_train=10)
    with pytest.raises(ValueError, match=expected):
        TorchvisionDataModule(root=str(tmp_path), **kwargs)


def test_digits_upsample_and_subset_for_fine_tuning():
    dm = DigitsDataModule(img_size=28, train_subset=100)
    dm.setup()
    assert dm.img_size == 28 and dm.train_set.tensors[0].shape == (100, 1, 28, 28)
    assert len(dm.val_set) == 270  # the evaluation splits do not shrink


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST"])
def test_idx_files_read_as_torchvision_reads_them(tmp_path, name):
    """torchvision's dataset is the peer; it needs the test files too, which this DataModule does not."""
    from torchvision import datasets

    images, labels = make_mnist(tmp_path, name, n_train=30)
    with pytest.raises(RuntimeError, match="Dataset not found"):  # why we keep our reader: train files alone
        getattr(datasets, name)(str(tmp_path), train=True, download=False)
    make_mnist(tmp_path / "full", name, n_train=30, n_test=5)
    peer = getattr(datasets, name)(str(tmp_path / "full"), train=True, download=False)
    dm = TorchvisionDataModule(name=name, root=str(tmp_path / "full"), val_fraction=0.2)
    ours = dm._sources()[0]
    assert len(ours) == len(peer) == 30
    for i in (0, 7, 29):
        assert np.array_equal(np.asarray(ours[i][0]), np.asarray(peer[i][0])) and ours[i][1] == peer[i][1]


def test_the_real_fashion_mnist_is_read_in_place():
    """The shared copy holds only the training files: 60,000 images, 6,000 a class (skipped where absent)."""
    from torchvision.datasets.mnist import read_image_file, read_label_file

    root = Path("../shared/data")
    raw = root / "FashionMNIST" / "raw"
    if not (raw / "train-images-idx3-ubyte").is_file():
        pytest.skip(f"no FashionMNIST in {raw}")
    train, _, test = TorchvisionDataModule(root=str(root))._sources()
    assert test is None and len(train) == 60_000
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.array_equal(train.images, read_image_file(str(raw / "train-images-idx3-ubyte")).numpy())
    assert np.array_equal(train.labels, read_label_file(str(raw / "train-labels-idx1-ubyte")).numpy())
