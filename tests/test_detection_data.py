"""Detection data: the COCO and VOC readers with their bad-input handling, DETR's transforms, padding,
the generated shapes dataset, and COCO evaluation through pycocotools."""

import json
from pathlib import Path

import pytest
import torch
from builders import SMALL_DETECTION
from PIL import Image

from datamodules.detection.coco import CocoDataModule, CocoDetection, ImageFolderDetection, collate_detection
from datamodules.detection.coco_format import coco_from_dict, load_coco
from datamodules.detection.shapes import ShapesDataModule, generate_shapes
from datamodules.detection.transforms import Normalize, crop, eval_transforms, hflip, resize, train_transforms
from datamodules.detection.voc import VocDataModule, read_voc_split
from models.detection.coco_eval import coco_evaluate, to_coco_results

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "detection"


def write_coco(
    root: Path, images: list[dict], annotations: list[dict], categories: list[dict], modes: dict | None = None
) -> Path:
    """A COCO dataset under root: images/ (solid colour files for every listed image) + instances.json."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for img in images:
        mode = (modes or {}).get(img["id"], "RGB")
        Image.new(mode, (img["width"], img["height"])).save(root / "images" / img["file_name"])
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return path


def image(i: int, w: int = 40, h: int = 30) -> dict:
    return {"id": i, "file_name": f"{i}.png", "width": w, "height": h}


def ann(i: int, image_id: int, cat: int, bbox: list, **extra) -> dict:
    return {"id": i, "image_id": image_id, "category_id": cat, "bbox": bbox, **extra}


CATS = [{"id": 1, "name": "cat"}, {"id": 5, "name": "dog"}, {"id": 90, "name": "toothbrush"}]


# --- COCO reader ---------------------------------------------------------------------------------


def test_coco_reader_maps_categories_and_cleans_boxes_as_detr_does(tmp_path):
    annotations = [
        ann(1, 1, 90, [10, 5, 10, 10]),
        ann(2, 1, 5, [30, 20, 20, 20]),  # crosses the right and bottom edges: clipped to 40x30
        ann(3, 1, 1, [5, 5, 0, 4]),  # zero width: left out of training and evaluation
        ann(4, 1, 1, [0, 0, 40, 30], iscrowd=1),  # crowd: not a training target
    ]
    path = write_coco(tmp_path, [image(1), image(2)], annotations, CATS, modes={2: "L"})
    with pytest.warns(UserWarning, match="left out 1 annotations without area inside their image .*annotation id 3"):
        coco = load_coco(path)
    with pytest.warns(UserWarning, match="1 crowd boxes.*1 boxes clipped.*1 images without boxes"):
        dataset = CocoDetection(tmp_path / "images", coco)
    assert dataset.category_ids == [1, 5, 90] and dataset.class_names == ["cat", "dog", "toothbrush"]
    img, target = dataset[0]
    assert isinstance(img, Image.Image) and target["labels"].tolist() == [
        2,
        1,
    ]  # contiguous labels, back via category_ids
    torch.testing.assert_close(target["boxes"], torch.tensor([[10.0, 5.0, 20.0, 15.0], [30.0, 20.0, 40.0, 30.0]]))
    gray, empty = dataset[1]
    assert gray.mode == "RGB" and empty["boxes"].shape == (0, 4)  # grayscale converted; image without boxes kept
    assert (
        dataset.coco.anns[4]["iscrowd"] == 1 and 3 not in dataset.coco.anns
    )  # COCOeval keeps the crowd region, not the empty box


@pytest.mark.parametrize(
    "data, message",
    [
        ({"images": []}, "not a COCO instances file"),
        ([1, 2], "not a COCO instances file"),
        (
            {"images": [image(1)], "annotations": [ann(7, 3, 1, [0, 0, 5, 5])], "categories": CATS},
            r"annotations\[0\] \(id 7\) refers to image id 3",
        ),
        (
            {"images": [image(1)], "annotations": [ann(7, 1, 2, [0, 0, 5, 5])], "categories": CATS},
            r"\(id 7\) refers to category id 2",
        ),
        (
            {"images": [image(1)], "annotations": [ann(7, 1, 1, [0, 0, 5])], "categories": CATS},
            r"\(id 7\) has bbox \[0, 0, 5\]",
        ),
        ({"images": [{"id": 1}], "annotations": [], "categories": CATS}, r"images\[0\].*lacks"),
    ],
)
def test_bad_coco_files_are_refused_naming_file_and_record(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        load_coco(path)
    assert str(path) in str(err.value)


def test_invalid_json_and_missing_files_are_refused(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        load_coco(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError, match="data.annotations"):
        load_coco(tmp_path / "absent.json")
    path = write_coco(tmp_path, [image(1)], [], CATS)
    coco = load_coco(path)
    coco.imgs[2] = image(2)  # listed, never written
    with pytest.raises(FileNotFoundError, match=r"1 of 2 images are missing.*image id 2 file_name '2.png'"):
        CocoDetection(tmp_path / "images", coco)


def test_coco_datamodule_splits_and_pads(tmp_path):
    images = [image(i, w=40 + i, h=30) for i in range(1, 11)]
    path = write_coco(tmp_path, images, [ann(i, i, 1, [2, 2, 10, 10]) for i in range(1, 11)], CATS)
    dm = CocoDataModule(str(tmp_path / "images"), str(path), val_fraction=0.3, batch_size=4, **SMALL_DETECTION)
    assert dm.num_classes == 3
    dm.setup("fit")
    train, val = dm.dataset("train"), dm.dataset("val")
    assert len(train) == 7 and len(val) == 3 and not set(train.image_ids) & set(val.image_ids)
    images_b, mask, targets = next(iter(dm.train_dataloader()))
    widths = [int((~m[0]).sum()) for m in mask]
    assert images_b.shape[-1] == max(widths) and min(widths) < max(widths)  # padded to the widest, mask marks the rest
    assert all(t["boxes"].max() <= 1 for t in targets)
    with pytest.raises(FileNotFoundError, match="data.images"):
        CocoDataModule(str(tmp_path / "nowhere"), str(path))


@pytest.mark.skipif(not (SHARED / "coco2017_mini").is_dir(), reason="shared COCO subset not present")
def test_real_coco_subset_reads_with_its_crowds_and_grayscale_image():
    root = SHARED / "coco2017_mini"
    dm = CocoDataModule(
        str(root / "train" / "images"), str(root / "annotations" / "instances_train.json"), num_workers=0
    )
    assert dm.num_classes == 80 and dm.category_ids[-1] == 90
    with pytest.warns(UserWarning, match="crowd boxes left out of training"):
        assert len(dm.dataset("train")) == 279
    dataset = dm.dataset("val")
    assert len(dataset) == 31
    img, target = dataset[0]
    assert img.shape[0] == 3 and target["labels"].max() < 80


def test_image_folder_for_predict(tmp_path):
    for name, size in (("b.jpg", (30, 20)), ("a.png", (10, 40))):
        Image.new("L", size).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("not an image")
    dataset = ImageFolderDetection(tmp_path, [1, 5], ["cat", "dog"], eval_transforms(val_size=16, max_size=64))
    assert len(dataset) == 2 and dataset.image_path(0).name == "a.png"
    tensor, target = dataset[0]
    assert tensor.shape == (3, 64, 16) and target["orig_size"].tolist() == [40, 10] and target["image_id"] == 0
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        ImageFolderDetection(tmp_path / "empty", [1], ["cat"], eval_transforms(val_size=800, max_size=1333))


# --- VOC reader ----------------------------------------------------------------------------------


def write_voc(root: Path, objects: dict[str, list[tuple]], split: str = "train") -> None:
    for folder in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name, objs in objects.items():
        Image.new("RGB", (64, 48)).save(root / "JPEGImages" / f"{name}.jpg")
        body = "".join(
            f"<object><name>{c}</name><difficult>{d}</difficult><bndbox><xmin>{x0}</xmin><ymin>{y0}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            for c, (x0, y0, x1, y1), d in objs
        )
        (root / "Annotations" / f"{name}.xml").write_text(
            f"<annotation><filename>{name}.jpg</filename><size><width>64</width><height>48</height><depth>3</depth></size>{body}</annotation>"
        )
    (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(objects) + "\n")


def test_voc_reader_converts_corners_and_drops_degenerate_boxes(tmp_path):
    objects = {
        "a": [("WBC", (1, 1, 10, 20), 0), ("RBC", (5, 5, 5, 5), 0), ("RBC", (6, 5, 4, 9), 0)],
        "b": [("RBC", (11, 11, 30, 40), 1)],
    }
    write_voc(tmp_path, objects)
    data, names = read_voc_split(tmp_path, "train")
    assert names == ["RBC", "WBC"]
    first, point, inverted, difficult = data["annotations"]
    assert first["bbox"] == [0, 0, 10, 20] and first["category_id"] == 2  # 1-based inclusive -> 0-based xywh
    assert difficult["iscrowd"] == 1  # difficult objects are ignore regions
    with pytest.warns(UserWarning, match="left out 2 annotations without area .*annotation id 2"):
        coco = coco_from_dict(data, "train.txt")
    assert sorted(coco.anns) == [first["id"], difficult["id"]]  # a point (xmax == xmin) and xmax < xmin are no objects
    with pytest.raises(ValueError, match="class 'WBC' is not one of"):
        read_voc_split(tmp_path, "train", ["RBC"])
    with pytest.raises(FileNotFoundError, match="val.txt"):
        read_voc_split(tmp_path, "val")
    (tmp_path / "Annotations" / "b.xml").write_text("<annotation>")
    with pytest.raises(ValueError, match="b.xml: not valid XML"):
        read_voc_split(tmp_path, "train")


@pytest.mark.skipif(not (SHARED / "bccd").is_dir(), reason="shared BCCD not present")
def test_real_bccd_reads_as_three_classes():
    dm = VocDataModule(str(SHARED / "bccd"), class_names=["RBC", "WBC", "Platelets"], num_workers=0)
    assert dm.num_classes == 3 and len(dm.dataset("train")) == 205 and len(dm.dataset("val")) == 87
    image_t, target = dm.dataset("val")[0]
    assert image_t.shape[0] == 3 and len(target["labels"]) > 0


# --- transforms ----------------------------------------------------------------------------------


def sample(w: int = 100, h: int = 50):
    boxes = torch.tensor([[10.0, 10.0, 30.0, 20.0], [60.0, 5.0, 100.0, 45.0]])
    return Image.new("RGB", (w, h)), {
        "boxes": boxes,
        "labels": torch.tensor([0, 1]),
        "area": torch.tensor([200.0, 1600.0]),
        "size": torch.tensor([h, w]),
    }


def test_hflip_resize_crop_and_normalize_move_boxes_with_the_image():
    img, target = sample()
    _, flipped = hflip(img, target)
    torch.testing.assert_close(flipped["boxes"][0], torch.tensor([70.0, 10.0, 90.0, 20.0]))
    resized_img, resized = resize(img, target, 25, max_size=None)  # shorter side 50 -> 25
    assert resized_img.size == (50, 25) and resized["size"].tolist() == [25, 50]
    torch.testing.assert_close(resized["boxes"][1], torch.tensor([30.0, 2.5, 50.0, 22.5]))
    assert resize(img, target, 40, max_size=60)[0].size == (60, 30)  # the longer side is capped
    cropped_img, cropped = crop(img, target, (0, 50, 50, 50))  # (top, left, h, w): the first box is cut away
    assert cropped_img.size == (50, 50) and cropped["labels"].tolist() == [1]
    torch.testing.assert_close(cropped["boxes"], torch.tensor([[10.0, 5.0, 50.0, 45.0]]))
    tensor, normed = Normalize()(img, target)
    assert tensor.shape == (3, 50, 100)
    torch.testing.assert_close(normed["boxes"][0], torch.tensor([0.2, 0.3, 0.2, 0.2]))


def test_training_transforms_keep_boxes_valid():
    pipeline = train_transforms(
        scales=[40, 48], max_size=80, crop=True, crop_resize_scales=[50], crop_size=(20, 40), hflip=True
    )
    for seed in range(20):
        torch.manual_seed(seed)
        __import__("random").seed(seed)
        tensor, target = pipeline(*sample())
        assert max(tensor.shape[1:]) <= 80
        assert (
            (target["boxes"][:, 2:] > 0).all()
            and (target["boxes"] >= 0).all()
            and len(target["boxes"]) == len(target["labels"])
        )


def test_collate_pads_and_masks():
    a, b = torch.ones(3, 4, 6), torch.ones(3, 5, 3)
    images, mask, targets = collate_detection([(a, {"id": 0}), (b, {"id": 1})])
    assert images.shape == (2, 3, 5, 6) and targets == [{"id": 0}, {"id": 1}]
    assert (
        mask[0, :4, :6].logical_not().all() and mask[0, 4].all() and mask[1, :, 3:].all() and not mask[1, :, :3].any()
    )
    assert images[1, :, :, 3:].abs().sum() == 0


# --- generated shapes and evaluation -------------------------------------------------------------


def test_shapes_are_deterministic_coco_and_score_ap_1_against_themselves(tmp_path):
    params = dict(image_size=64, max_objects=4, min_side=10, max_side=24, seed=3, palette="by_class")
    a = generate_shapes(tmp_path / "a", "val", 12, **params)
    b = generate_shapes(tmp_path / "b", "val", 12, **params)
    assert json.loads(a.read_text()) == json.loads(b.read_text())
    assert (tmp_path / "a" / "val" / "images" / "000001.png").read_bytes() == (
        tmp_path / "b" / "val" / "images" / "000001.png"
    ).read_bytes()
    coco = load_coco(a)
    assert {c["name"] for c in coco.dataset["categories"]} == {"circle", "square", "triangle"}
    assert all(1 <= len(coco.imgToAnns[i]) <= 4 for i in coco.imgs)
    # the ground truth fed back as detections is perfect; one label swapped per image is not
    detections = {}
    for i in coco.imgs:
        anns_i = coco.imgToAnns[i]
        boxes = torch.tensor([a["bbox"] for a in anns_i], dtype=torch.float32)
        boxes[:, 2:] += boxes[:, :2]
        detections[i] = {
            "boxes": boxes,
            "scores": torch.ones(len(anns_i)),
            "labels": torch.tensor([a["category_id"] - 1 for a in anns_i]),
        }
    stats = coco_evaluate(coco, to_coco_results(detections, [1, 2, 3]), list(coco.imgs))
    assert stats["AP"] == pytest.approx(1.0) and stats["AP50"] == pytest.approx(1.0)
    for det in detections.values():
        det["labels"][0] = (det["labels"][0] + 1) % 3
    assert coco_evaluate(coco, to_coco_results(detections, [1, 2, 3]), list(coco.imgs))["AP50"] < 0.9
    assert coco_evaluate(coco, [], list(coco.imgs))["AP"] == 0.0


def test_shapes_datamodule_regenerates_only_when_parameters_change(tmp_path):
    dm = ShapesDataModule(str(tmp_path), num_train=4, num_val=2, num_test=2, image_size=64, max_side=24)
    assert dm.num_classes == 3
    dm.prepare_data()
    json_path = tmp_path / "annotations" / "instances_train.json"
    stamp = json_path.stat().st_mtime_ns
    dm.prepare_data()
    assert json_path.stat().st_mtime_ns == stamp
    ShapesDataModule(str(tmp_path), num_train=5, num_val=2, num_test=2, image_size=64, max_side=24).prepare_data()
    assert len(json.loads(json_path.read_text())["images"]) == 5
    with pytest.raises(ValueError, match="max_side=80"):
        ShapesDataModule(str(tmp_path), image_size=64, max_side=80)
