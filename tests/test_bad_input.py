"""Bad input, tried systematically (issue #8). Every reader either refuses a bad file with an error
that names the file and the record, or skips and counts what the reference implementations skip
(DETR drops boxes without area); never a crash deep inside PIL or torch, never a silently wrong
result. Property tests (hypothesis) feed arbitrary bytes and numbers; example tests cover the rest."""

import gzip
import io
import json
import pickle
import random
import re
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import SMALL_DETECTION
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from datamodules.checks import check_train_batches, open_image, read_lines
from datamodules.detection.coco import CocoDataModule, CocoDetection, ImageFolderDetection
from datamodules.detection.coco_format import load_coco
from datamodules.detection.shapes import ShapesDataModule, generate_shapes
from datamodules.detection.transforms import eval_transforms
from datamodules.detection.voc import VocDataModule, read_voc_split
from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.vision.classification import (
    DigitsDataModule,
    ImageFolderDataModule,
    TorchvisionDataModule,
    split_lengths,
)
from datamodules.vision.files import LAYOUTS

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def with_byte(data: bytes, position: int, value: int) -> bytes:
    return data[:position] + bytes([value]) + data[position + 1 :]


NOISE = Image.fromarray(
    np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)
)  # long compressed data to cut
PNG, JPEG = encoded(NOISE, "PNG"), encoded(NOISE, "JPEG")
BAD_IMAGES = {  # PIL raises OSError for most, ValueError for the IHDR, SyntaxError for the chunk
    "truncated PNG": PNG[: len(PNG) // 2],
    "truncated JPEG": JPEG[: len(JPEG) // 2],
    "random bytes": random.Random(0).randbytes(64),
    "zero bytes": b"",
    "PNG with a broken IHDR": with_byte(PNG, 11, 0),
    "PNG with a broken chunk": with_byte(PNG, 35, 0),
}


def quietly(fn, *args, **kwargs):
    """Call ``fn`` ignoring the counted-skip warnings (they are tested where they matter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def read_all(dataset) -> None:
    for i in range(len(dataset)):
        dataset[i]


# --- data in every layout, tiny -----------------------------------------------------------------


def image_folder(root: Path, per_class: int = 2) -> Path:
    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (12, 10), (100 * i, 50, 200)).save(root / split / c / f"{i}.png")
    return root


IMAGES = [
    {"id": 1, "file_name": "1.png", "width": 40, "height": 30},
    {"id": 2, "file_name": "2.png", "width": 25, "height": 50},
]
CATS = [{"id": 1, "name": "cat"}, {"id": 5, "name": "dog"}]


def ann(i: int, image_id: int = 1, category_id: int = 1, bbox=(2, 2, 10, 8), **extra) -> dict:
    return {"id": i, "image_id": image_id, "category_id": category_id, "bbox": list(bbox), **extra}


def coco_dir(root: Path, annotations: list[dict] | None = None) -> Path:
    """images/ and instances.json under root; returns the JSON path."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for img in IMAGES:
        Image.new("RGB", (img["width"], img["height"])).save(root / "images" / img["file_name"])
    path = root / "instances.json"
    path.write_text(
        json.dumps(
            {
                "images": IMAGES,
                "annotations": [ann(1), ann(2, 2)] if annotations is None else annotations,
                "categories": CATS,
            }
        )
    )
    return path


def voc_dir(root: Path, xmin="2", size=("64", "48")) -> Path:
    for folder in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name in ("a", "b"):
        Image.new("RGB", (64, 48)).save(root / "JPEGImages" / f"{name}.jpg")
        (root / "Annotations" / f"{name}.xml").write_text(
            f"<annotation><filename>{name}.jpg</filename><size><width>{size[0]}</width><height>{size[1]}</height></size>"
            f"<object><name>RBC</name><bndbox><xmin>{xmin}</xmin><ymin>3</ymin><xmax>20</xmax><ymax>30</ymax></bndbox></object></annotation>"
        )
    (root / "ImageSets" / "Main" / "train.txt").write_text("a\nb\n")
    (root / "ImageSets" / "Main" / "val.txt").write_text("b\n")
    return root


def write_idx(path: Path, array: np.ndarray) -> None:
    path.write_bytes(
        struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    )


def mnist_dir(root: Path, n: int = 8, side: int = 28, labels: np.ndarray | None = None) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    write_idx(raw / "train-images-idx3-ubyte", np.zeros((n, side, side), dtype=np.uint8))
    write_idx(raw / "train-labels-idx1-ubyte", np.arange(n, dtype=np.uint8) % 10 if labels is None else labels)
    return raw


def cifar_dir(root: Path, batch: object) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    good = {"data": np.zeros((4, 3072), dtype=np.uint8), "labels": [0, 1, 2, 3]}
    for name in LAYOUTS["CIFAR10"].train:
        (folder / name).write_bytes(pickle.dumps(good))
    (folder / "data_batch_3").write_bytes(batch if isinstance(batch, bytes) else pickle.dumps(batch))
    return folder / "data_batch_3"


def text_dir(root: Path, lines: str = "A dog.\nA cat.\n", de: str = "Ein Hund.\nEine Katze.\n") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        (root / f"{split}.en").write_text(lines)
        (root / f"{split}.de").write_text(de)
    return root


# --- corrupted images: found when read, named in the error ------------------------------------------


def imagefolder_reader(root: Path) -> tuple[object, Path]:
    dm = ImageFolderDataModule(str(image_folder(root)), img_size=8, batch_size=2)
    dm.setup()
    return dm.train_set, root / "train" / "dog" / "1.png"


def coco_reader(root: Path) -> tuple[object, Path]:
    return CocoDetection(root / "images", load_coco(coco_dir(root))), root / "images" / "2.png"


def voc_reader(root: Path) -> tuple[object, Path]:
    return VocDataModule(str(voc_dir(root)), num_workers=0).dataset("train"), root / "JPEGImages" / "b.jpg"


def predict_reader(root: Path) -> tuple[object, Path]:
    root.mkdir()
    for name in ("a.png", "b.jpg"):
        NOISE.save(root / name)
    return ImageFolderDetection(root, [1], ["cat"], eval_transforms(val_size=16, max_size=32)), root / "b.jpg"


@pytest.mark.parametrize("fault", BAD_IMAGES)
@pytest.mark.parametrize(
    "reader", [imagefolder_reader, coco_reader, voc_reader, predict_reader], ids=lambda f: f.__name__
)
def test_a_corrupted_image_is_an_error_naming_the_file(tmp_path, reader, fault):
    dataset, bad = reader(tmp_path / "data")
    read_all(dataset)  # the intact data reads
    bad.write_bytes(BAD_IMAGES[fault])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: cannot read the image"):
        read_all(dataset)


@PROPERTY
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.integers(0, len(PNG)).map(lambda n: PNG[:n]),
        st.integers(0, len(JPEG)).map(lambda n: JPEG[:n]),
        st.tuples(st.integers(0, 60), st.integers(0, 255)).map(lambda change: with_byte(PNG, *change)),
    )
)
def test_any_bytes_as_an_image_decode_or_fail_naming_the_file(tmp_path, data):
    path = tmp_path / "x.png"
    path.write_bytes(data)
    try:
        image = open_image(path, "L")
    except ValueError as err:  # nothing else: not OSError, SyntaxError, struct.error from inside PIL
        assert str(err).startswith(f"{path}: cannot read the image")
    else:
        assert image.mode == "L" and image.width * image.height > 0


def test_an_image_whose_size_differs_from_its_record_is_refused(tmp_path):
    path = coco_dir(tmp_path)
    dataset = CocoDetection(tmp_path / "images", load_coco(path), source=str(path))
    Image.new("RGB", (50, 25)).save(
        tmp_path / "images" / "2.png"
    )  # the record says 25x50: the boxes would be misplaced
    dataset[0]
    with pytest.raises(
        ValueError, match=rf"2.png: the image is 50x25 pixels but {re.escape(str(path))} records 25x50 for image id 2"
    ):
        dataset[1]


# --- MNIST idx and CIFAR files -------------------------------------------------------------------------

IDX = "train-images-idx3-ubyte"


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda b: b[:-5], "6283 bytes, but its header \\(8x28x28\\) needs 6288; the file is truncated"),
        (lambda b: b[:10], "10 bytes, fewer than its header's 16; the file is truncated"),
        (lambda b: b"", "starts with nothing"),
        (lambda b: random.Random(1).randbytes(40), "not an idx file"),
        (lambda b: gzip.compress(b), "is gzip-compressed; decompress it"),
    ],
    ids=["truncated", "cut in the header", "empty", "random bytes", "gzip"],
)
def test_a_damaged_idx_file_is_an_error_naming_it(tmp_path, damage, expected):
    raw = mnist_dir(tmp_path)
    (raw / IDX).write_bytes(damage((raw / IDX).read_bytes()))
    dm = TorchvisionDataModule(name="MNIST", root=str(tmp_path), batch_size=2)
    with pytest.raises(ValueError, match=rf"{re.escape(str(raw / IDX))}:? .*{expected}"):
        dm.setup()


@PROPERTY
@given(cut=st.integers(0, 16 + 4 * 28 * 28 - 1))
def test_an_idx_file_cut_anywhere_is_refused_by_name(tmp_path_factory, cut):
    root = tmp_path_factory.mktemp("mnist")
    raw = mnist_dir(root, n=4)
    (raw / IDX).write_bytes((raw / IDX).read_bytes()[:cut])
    with pytest.raises(ValueError, match=re.escape(str(raw / IDX))):
        TorchvisionDataModule(name="MNIST", root=str(root)).setup()


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda root: mnist_dir(root, side=32), r"train-images-idx3-ubyte: holds 8x32x32 values; expected Nx28x28"),
        (
            lambda root: mnist_dir(root, labels=np.zeros(7, dtype=np.uint8)),
            r"train-labels-idx1-ubyte: \(7,\) labels .* for 8 images",
        ),
        (
            lambda root: mnist_dir(root, labels=np.array([0, 1, 2, 12, 4, 5, 6, 7], dtype=np.uint8)),
            r"train-labels-idx1-ubyte: record 3 has label 12, outside 0..9",
        ),
        (lambda root: mnist_dir(root, n=0), r"train-images-idx3-ubyte: holds no images"),
        (
            lambda root: cifar_dir(root, pickle.dumps({"data": 1})[:-3]),
            r"data_batch_3: not a CIFAR python batch \((UnpicklingError|EOFError)",
        ),
        (lambda root: cifar_dir(root, b""), r"data_batch_3: not a CIFAR python batch \(EOFError"),
        (
            lambda root: cifar_dir(root, [1, 2]),
            r"data_batch_3: not a CIFAR python batch; expected a dict .* found list",
        ),
        (
            lambda root: cifar_dir(root, {"data": np.zeros((2, 3000), np.uint8), "labels": [0, 1]}),
            r"data_batch_3: 'data' is uint8 of shape \(2, 3000\)",
        ),
        (
            lambda root: cifar_dir(root, {"data": np.zeros((2, 3072), np.uint8), "labels": [0, 10]}),
            r"data_batch_3: record 1 has label 10",
        ),
    ],
    ids=[
        "wrong image size",
        "label count",
        "label out of range",
        "no images",
        "truncated pickle",
        "empty pickle",
        "not a dict",
        "wrong data shape",
        "cifar label out of range",
    ],
)
def test_malformed_dataset_files_name_the_file_and_record(tmp_path, make, expected):
    make(tmp_path)
    name = "CIFAR10" if (tmp_path / "cifar-10-batches-py").is_dir() else "MNIST"
    with pytest.raises(ValueError, match=expected):
        TorchvisionDataModule(name=name, root=str(tmp_path), img_size=32 if name == "CIFAR10" else None).setup()


# --- COCO JSON -------------------------------------------------------------------------------------------


@PROPERTY
@given(cut=st.integers(0, 300))
def test_truncated_json_names_the_file(tmp_path, cut):
    whole = coco_dir(tmp_path).read_text()
    path = tmp_path / "cut.json"
    path.write_text(whole[: min(cut, len(whole) - 1)])
    with pytest.raises(ValueError, match=rf"data.annotations: {re.escape(str(path))} is not valid JSON"):
        load_coco(path)


def _is_finite_number(v) -> bool:
    """The oracle: JSON numbers a box may hold (no NaN/Infinity, no bool, nothing beyond a float's range)."""
    return type(v) in (int, float) and -sys.float_info.max <= v <= sys.float_info.max


def _has_area_inside(bbox, width, height) -> bool:
    """Corners clipped to the image, compared in float32 (the boxes' dtype in training)."""
    x, y, w, h = bbox
    f32 = lambda v: torch.tensor(float(v), dtype=torch.float32).item()  # noqa: E731
    return f32(max(x, 0)) < f32(min(x + w, width)) and f32(max(y, 0)) < f32(min(y + h, height))


COORDINATE = st.one_of(
    st.integers(-50, 80), st.floats(-50, 80), st.floats(), st.sampled_from([10**300, 10**400, True, None, "3"])
)


@PROPERTY
@given(
    boxes=st.lists(
        st.tuples(st.sampled_from([1, 2]), st.lists(COORDINATE, min_size=4, max_size=4), st.booleans()), max_size=6
    )
)
@example(boxes=[(1, [0, 0, 1.0, 3.3423855844368586e-248], False)])  # a height > 0 that is 0 in float32
def test_any_boxes_are_refused_by_name_or_become_finite_boxes_inside_the_image(tmp_path, boxes):
    anns = [ann(i + 1, image_id, bbox=bbox, iscrowd=int(crowd)) for i, (image_id, bbox, crowd) in enumerate(boxes)]
    path = coco_dir(tmp_path, anns)  # through JSON: NaN and Infinity are JSON's spellings
    first_bad = next((i for i, a in enumerate(anns) if not all(map(_is_finite_number, a["bbox"]))), None)
    if first_bad is not None:
        with pytest.raises(
            ValueError, match=rf"{re.escape(str(path))}: annotations\[{first_bad}\] \(id {first_bad + 1}\) has bbox"
        ):
            load_coco(path)
        return
    size = {img["id"]: (img["width"], img["height"]) for img in IMAGES}
    inside = {a["id"] for a in anns if _has_area_inside(a["bbox"], *size[a["image_id"]])}
    coco = quietly(load_coco, path)
    assert set(coco.anns) == inside  # evaluation keeps exactly the boxes a detection could match
    dataset = quietly(CocoDetection, tmp_path / "images", coco)
    n_targets = 0
    for i in range(len(dataset)):
        image, target = dataset[i]
        x0, y0, x1, y1 = target["boxes"].unbind(-1)
        assert torch.isfinite(target["boxes"]).all() and (x0 >= 0).all() and (y0 >= 0).all()
        assert (x1 <= image.width).all() and (y1 <= image.height).all() and (x1 > x0).all() and (y1 > y0).all()
        n_targets += len(x0)
    assert n_targets == len(inside - {a["id"] for a in anns if a["iscrowd"]})  # crowds are not trained on


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: d.update(images={"1": IMAGES[0]}), r"'images' must be a list, found dict"),
        (lambda d: d["images"].clear(), r"the file lists no images"),
        (lambda d: d["images"][1].update(id="2"), r"images\[1\] has id '2'; ids must be integers"),
        (
            lambda d: d["images"][1].update(width=float("nan")),
            r"images\[1\] \(id 2\) has width nan and height 50; expected positive",
        ),
        (lambda d: d["images"][0].update(height=-30), r"images\[0\] \(id 1\) has width 40 and height -30"),
        (lambda d: d["images"][0].update(file_name=None), r"images\[0\] \(id 1\) has file_name None"),
        (lambda d: d["categories"].append({"id": 1, "name": "again"}), r"categories\[2\] repeats category id 1"),
        (lambda d: d["annotations"].append(ann(1, 2)), r"annotations\[2\] \(id 1\) repeats the id of annotations\[0\]"),
        (
            lambda d: d["annotations"].append(ann(3, image_id=9)),
            r"annotations\[2\] \(id 3\) refers to image id 9, which is not in 'images'",
        ),
        (
            lambda d: d["annotations"].append(ann(3, category_id=2)),
            r"annotations\[2\] \(id 3\) refers to category id 2, which is not in 'categories' \[1, 5\]",
        ),
        (
            lambda d: d["annotations"].append(ann(3, bbox=[1, 1, float("inf"), 2])),
            r"annotations\[2\] \(id 3\) has bbox \[1, 1, inf, 2\]",
        ),
        (lambda d: d["annotations"].append(ann(3, area=float("nan"))), r"annotations\[2\] \(id 3\) has area nan"),
        (
            lambda d: d["annotations"].append(ann(3, iscrowd=2)),
            r"annotations\[2\] \(id 3\) has iscrowd 2; expected 0 or 1",
        ),
        (lambda d: d["annotations"].append("box"), r"annotations\[2\] = box lacks one of 'id'"),
    ],
    ids=[
        "images not a list",
        "no images",
        "string image id",
        "NaN width",
        "negative height",
        "no file name",
        "repeated category",
        "repeated annotation id",
        "unknown image",
        "unknown category",
        "infinite width",
        "NaN area",
        "bad iscrowd",
        "not a record",
    ],
)
def test_json_that_is_not_valid_coco_names_file_and_record(tmp_path, change, expected):
    path = coco_dir(tmp_path)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: {expected}"):
        CocoDataModule(str(tmp_path / "images"), str(path), num_workers=0)


def test_boxes_outside_the_image_are_clipped_or_left_out_and_counted(tmp_path):
    anns = [
        ann(1, bbox=[30, 20, 20, 20]),
        ann(2, bbox=[45, 5, 5, 5]),
        ann(3, bbox=[5, 5, -4, 8]),
        ann(4, 2, bbox=[0, 0, 0, 50]),
        ann(5, 2),
    ]
    path = coco_dir(tmp_path, anns)
    with pytest.warns(UserWarning, match=r"left out 3 annotations without area inside their image .*annotation id 2"):
        coco = load_coco(path)
    with pytest.warns(UserWarning, match="1 boxes clipped to their image"):
        _, target = CocoDetection(tmp_path / "images", coco)[0]
    torch.testing.assert_close(target["boxes"], torch.tensor([[30.0, 20.0, 40.0, 30.0]]))  # DETR clips to the image


# --- VOC XML -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(xmin="abc"), r"a.xml: object 0: <bndbox/xmin> is 'abc'; expected a finite number"),
        (dict(xmin="nan"), r"a.xml: object 0: <bndbox/xmin> is 'nan'"),
        (dict(xmin="-inf"), r"a.xml: object 0: <bndbox/xmin> is '-inf'"),
        (dict(xmin=""), r"a.xml: object 0: <bndbox/xmin> is missing"),
        (dict(size=("0", "48")), r"a.xml: <size> is 0x48; expected a positive width and height"),
        (dict(size=("64", "tall")), r"a.xml: <size/height> is 'tall'"),
    ],
    ids=["word", "nan", "inf", "empty", "zero width", "word height"],
)
def test_voc_xml_with_bad_numbers_names_file_object_and_tag(tmp_path, kwargs, expected):
    voc_dir(tmp_path, **kwargs)
    with pytest.raises(ValueError, match=expected):
        VocDataModule(str(tmp_path), num_workers=0)


def test_voc_split_files_that_are_empty_truncated_or_not_utf8(tmp_path):
    voc_dir(tmp_path)
    split = tmp_path / "ImageSets" / "Main" / "train.txt"
    split.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(split))}: lists no images"):
        read_voc_split(tmp_path, "train")
    split.write_bytes(b"a\nb\xff\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(split))} line 2: byte 0xff"):
        read_voc_split(tmp_path, "train")
    split.write_text("a\n")
    xml = tmp_path / "Annotations" / "a.xml"
    xml.write_bytes(xml.read_bytes()[:50])
    with pytest.raises(ValueError, match=rf"{re.escape(str(xml))}: not valid XML"):
        read_voc_split(tmp_path, "train")


# --- text ----------------------------------------------------------------------------------------------

TEXT_PIECES = st.sampled_from(
    [b"a", b" ", b"\n", b"\r", b"\r\n", b"\xc3\xa4", b"\xe4", b"\xf0\x9f", b"\xef\xbb\xbf", b"\x00"]
)


@PROPERTY
@given(raw=st.one_of(st.binary(max_size=60), st.lists(TEXT_PIECES, max_size=20).map(b"".join)))
def test_any_bytes_as_text_decode_or_fail_naming_file_and_line(tmp_path, raw):
    path = tmp_path / "corpus.txt"
    path.write_bytes(raw)
    body = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark at the start is not text
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        line = 1 + len(re.findall(rb"\r\n|\r|\n", body[: err.start]))
        with pytest.raises(
            ValueError,
            match=rf"^{re.escape(str(path))} line {line}: byte 0x{body[err.start]:02x} at column \d+ is not UTF-8",
        ):
            read_lines(path, "data.path")
    else:
        assert "\n".join(read_lines(path, "data.path")) == re.sub(r"\r\n?", "\n", text).removesuffix("\n")


@pytest.mark.parametrize(
    "en, expected",
    [
        ("", r"train.en and .*train.de hold no sentences"),
        ("\n\n", r"train.en line 1 is empty"),
        ("A dog.\n", r"train.en has 1 lines but .*train.de has 2"),
    ],
    ids=["empty", "blank lines only", "mismatched line counts"],
)
def test_parallel_files_that_are_empty_blank_or_misaligned(tmp_path, en, expected):
    text_dir(tmp_path)
    (tmp_path / "train.en").write_text(en)
    (tmp_path / "train.de").write_text("Ein Hund.\nEine Katze.\n" if en else "")
    with pytest.raises(ValueError, match=expected):
        ParallelTextDataModule(str(tmp_path), test_split=None).src_vocab_size


def test_corpus_that_is_empty_blank_or_shorter_than_a_block(tmp_path):
    for name, content in (("empty.txt", ""), ("blank.txt", " \n\n\t\n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match=rf"data.path: {re.escape(str(tmp_path / name))} holds no text"):
            TextCorpusDataModule(str(tmp_path / name)).vocab_size
    (tmp_path / "short.txt").write_text("to be or not to be\n")
    with pytest.raises(
        ValueError, match=r"the training part of .*short.txt has 17 tokens, fewer than data.block_size \+ 1 = 65"
    ):
        TextCorpusDataModule(str(tmp_path / "short.txt"), block_size=64).setup("fit")


def test_inputs_to_predict_are_lines_and_prompts_are_not_empty(tmp_path):
    corpus, inputs = tmp_path / "c.txt", tmp_path / "inputs.txt"
    corpus.write_text("to be or not to be\n" * 20)
    inputs.write_text("")
    lm = TextCorpusDataModule(str(corpus), block_size=8, predict_file=str(inputs))
    translation = ParallelTextDataModule(
        str(text_dir(tmp_path / "p")), test_split=None, tokenizer="word", min_frequency=1, predict_file=str(inputs)
    )
    for dm in (lm, translation):
        with pytest.raises(ValueError, match=rf"data.predict_file: {re.escape(str(inputs))} holds no lines"):
            dm.setup("predict")
    inputs.write_text("A dog.\n\nA cat.\n")
    with pytest.raises(ValueError, match=rf"data.predict_file: {re.escape(str(inputs))} line 2 is empty"):
        lm.setup("predict")  # an empty prompt has nothing to continue
    translation.setup("predict")  # an empty line translates to an empty line: output line i answers input line i
    assert translation.predict_set.src_text == ["A dog.", "", "A cat."]
    with pytest.raises(ValueError, match="data.prompt is empty"):
        TextCorpusDataModule(str(corpus), prompt="")


@pytest.mark.parametrize(
    "content", [b'{"version": "1.0", "trunc', b"\xff\xfe", b""], ids=["truncated", "not UTF-8", "empty"]
)
def test_a_damaged_saved_tokenizer_names_the_file(tmp_path, content):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(
        ValueError, match=rf"data.tokenizer_dir: tokenizer {re.escape(str(tmp_path / 'tokenizer.json'))} cannot be read"
    ):
        TextCorpusDataModule(str(text_dir(tmp_path / "t") / "train.en"), tokenizer_dir=str(tmp_path)).vocab_size


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfA dog.\r\nA cat.\r\n")
    assert read_lines(path, "data.path") == ["A dog.", "A cat."]


# --- empty datasets and splits ---------------------------------------------------------------------------


def test_a_fraction_that_rounds_to_an_empty_split_is_refused():
    with pytest.raises(
        ValueError, match=r"data.val_fraction=0.0001 of 1797 samples is an empty split; raise it to at least 0.00056"
    ):
        DigitsDataModule(val_fraction=0.0001)
    with pytest.raises(ValueError, match=r"data.test_fraction=0.01 of 40 samples is an empty split"):
        split_lengths(40, 0.5, 0.01)
    assert split_lengths(40, 0.5, 0.0) == [20, 20]  # a fraction of 0 asks for no split


def test_empty_image_folders_are_named(tmp_path):
    image_folder(tmp_path)
    for png in (tmp_path / "val" / "dog").iterdir():
        png.unlink()
    (tmp_path / "val" / "dog" / "notes.txt").write_text("not an image")
    dm = ImageFolderDataModule(str(tmp_path), img_size=8)
    with pytest.raises(
        FileNotFoundError,
        match=rf"data.root: {re.escape(str(tmp_path / 'val'))}/: Found no valid file for the classes dog",
    ):
        dm.setup()


def test_files_that_are_not_images_are_skipped_and_counted(tmp_path):
    image_folder(tmp_path)
    for name in ("scan.gif", "labels.csv", ".DS_Store"):
        (tmp_path / "train" / "cat" / name).write_text("x")
    dm = ImageFolderDataModule(str(tmp_path), img_size=8)
    with pytest.warns(
        UserWarning, match=rf"{re.escape(str(tmp_path / 'train'))}/: skipped 2 files that are not images"
    ):
        dm.setup()
    assert len(dm.train_set) == 4


def test_empty_detection_splits_are_refused(tmp_path):
    (tmp_path / "empty.json").write_text(json.dumps({"images": [], "annotations": [], "categories": CATS}))
    with pytest.raises(ValueError, match=r"empty.json: the file lists no images"):
        load_coco(tmp_path / "empty.json")
    voc_dir(tmp_path / "voc")
    (tmp_path / "voc" / "ImageSets" / "Main" / "val.txt").write_text("")
    dm = VocDataModule(str(tmp_path / "voc"), num_workers=0)
    with pytest.raises(ValueError, match=r"val.txt: lists no images"):
        dm.setup("fit")


def test_a_damaged_shapes_cache_is_regenerated(tmp_path):
    params = dict(image_size=32, max_objects=2, min_side=8, max_side=12, seed=0, palette="by_class")
    path = generate_shapes(tmp_path, "val", 2, **params)
    for damage in (b"[1, 2]", b'{"info": 3}', b"\xff\xfe", b'{"images": ['):
        path.write_bytes(damage)
        assert load_coco(generate_shapes(tmp_path, "val", 2, **params)).imgs.keys() == {1, 2}


# --- a batch larger than the dataset -------------------------------------------------------------------


def _digits(tmp_path):
    return DigitsDataModule(train_subset=10, batch_size=16)


def _torchvision(tmp_path):
    mnist_dir(tmp_path, n=20)
    return TorchvisionDataModule(name="MNIST", root=str(tmp_path), val_fraction=0.5, batch_size=16)


def _image_folder(tmp_path):
    return ImageFolderDataModule(str(image_folder(tmp_path)), img_size=8, batch_size=16)


def _parallel(tmp_path):
    return ParallelTextDataModule(
        str(text_dir(tmp_path)), test_split=None, tokenizer="word", min_frequency=1, batch_size=16
    )


def _corpus(tmp_path):
    (tmp_path / "c.txt").write_text("to be or not to be\n" * 10)
    return TextCorpusDataModule(str(tmp_path / "c.txt"), block_size=8, batch_size=64)


def _coco(tmp_path):
    return CocoDataModule(str(tmp_path / "images"), str(coco_dir(tmp_path)), batch_size=16, **SMALL_DETECTION)


def _voc(tmp_path):
    return VocDataModule(str(voc_dir(tmp_path)), batch_size=16, **SMALL_DETECTION)


def _shapes(tmp_path):
    return ShapesDataModule(str(tmp_path), num_train=3, num_val=1, num_test=1, batch_size=16)


@pytest.mark.parametrize(
    "make",
    [_digits, _torchvision, _image_folder, _parallel, _corpus, _coco, _voc, _shapes],
    ids=lambda f: f.__name__[1:],
)
def test_a_batch_larger_than_the_training_set_warns_and_still_trains(tmp_path, make):
    dm = make(tmp_path)
    quietly(dm.setup, "fit")
    with pytest.warns(UserWarning, match=r"data.batch_size=\d+ is larger than the \d+ training samples of ") as record:
        loader = dm.train_dataloader()
    n = len(loader.dataset)
    assert any(
        f"than the {n} training samples" in str(w.message) and str(w.message).endswith(f"one batch of {n}")
        for w in record
    )
    assert len(loader) == 1  # one step per epoch, never zero


def test_mixup_refuses_a_batch_it_would_drop_or_could_not_pair(tmp_path):
    mnist_dir(tmp_path, n=20)
    dm = TorchvisionDataModule(
        name="MNIST", root=str(tmp_path), val_fraction=0.5, batch_size=16, mixup={"mixup_alpha": 0.8}
    )
    dm.setup()
    with pytest.raises(
        ValueError,
        match=r"data.batch_size=16 is larger than the 10 training samples of MNIST in .*; the incomplete last batch is dropped",
    ):
        dm.train_dataloader()
    with pytest.raises(ValueError, match="data.batch_size=5 must be even with data.mixup"):
        TorchvisionDataModule(name="MNIST", root=str(tmp_path), batch_size=5, mixup={"mixup_alpha": 0.8})
    with pytest.raises(ValueError, match="somewhere: no training samples"):
        check_train_batches(0, 4, False, "somewhere")


# --- through the real CLI ----------------------------------------------------------------------------


def test_cli_names_a_non_utf8_corpus_in_one_line(attnlab, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"to be or not to be\nthat is the qu\xe9stion\n")
    code, _, err = attnlab(
        "fit",
        "--config",
        "configs/text/shakespeare_char_cpu.yaml",
        f"--data.init_args.path={corpus}",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
    )
    lines = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert code == 2 and len(lines) == 1 and f"{corpus} line 2: byte 0xe9 at column 15 is not UTF-8" in lines[0], err


def test_cli_names_a_corrupted_image_met_during_training_in_one_line(attnlab, tmp_path):
    ShapesDataModule(str(tmp_path / "shapes"), num_train=2, num_val=1, num_test=1).prepare_data()
    bad = tmp_path / "shapes" / "train" / "images" / "000002.png"
    bad.write_bytes(BAD_IMAGES["truncated PNG"])
    code, _, err = attnlab(
        "fit",
        "--config",
        "configs/detection/shapes.yaml",
        f"--data.init_args.data_dir={tmp_path / 'shapes'}",
        "--data.init_args.num_train=2",
        "--data.init_args.num_val=1",
        "--data.init_args.num_test=1",
        "--data.init_args.batch_size=2",
        "--trainer.fast_dev_run=true",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
    )
    lines = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert code == 2 and len(lines) == 1 and f"{bad}: cannot read the image" in lines[0], err
