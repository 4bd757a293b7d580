"""DETR cases: our training step vs Hugging Face's DetrForObjectDetection, and the Hungarian matching of one
step vs Hugging Face's matcher."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.harness import Step, synchronize
from benchmarks.peers.bench import Bench, Settings, train_step
from models.detection.backbone import Backbone
from models.detection.criterion import SetCriterion
from models.detection.detr import DETR
from models.detection.matcher import HungarianMatcher

DETR_SHAPES = {  # backbone, d_model, heads, layers each side, FFN, queries, classes, batch, image (H, W)
    "r50": dict(
        backbone="resnet50",
        d_model=256,
        nhead=8,
        layers=6,
        ffn=2048,
        queries=100,
        classes=91,
        batch=2,
        image=(384, 384),
    ),
    "small": dict(
        backbone="resnet18", d_model=128, nhead=4, layers=2, ffn=512, queries=20, classes=20, batch=4, image=(192, 192)
    ),
}
QUICK_DETR = dict(
    backbone="resnet18", d_model=32, nhead=2, layers=1, ffn=64, queries=8, classes=3, batch=2, image=(64, 64)
)


def detection_batch(
    c: dict, boxes_per_image: int, g: torch.Generator, device: torch.device
) -> tuple[Tensor, Tensor, list[dict[str, Tensor]]]:
    """Random images (B, 3, H, W), the padding mask (B, H, W) (the last image padded on the right and
    bottom by a quarter, as in a batch of unequal images) and targets with normalised cxcywh boxes."""
    b, (h, w) = c["batch"], c["image"]
    images = torch.randn(b, 3, h, w, generator=g)
    mask = torch.zeros(b, h, w, dtype=torch.bool)
    mask[-1, 3 * h // 4 :, :] = True
    mask[-1, :, 3 * w // 4 :] = True
    targets = []
    for _ in range(b):
        centre = torch.rand(boxes_per_image, 2, generator=g) * 0.5 + 0.25
        size = torch.rand(boxes_per_image, 2, generator=g) * 0.3 + 0.05
        targets.append(
            {
                "labels": torch.randint(0, c["classes"], (boxes_per_image,), generator=g).to(device),
                "boxes": torch.cat([centre, size], 1).to(device),
            }
        )
    return images.to(device), mask.to(device), targets


def hf_detr(c: dict, device: torch.device) -> nn.Module:
    """Hugging Face's DetrForObjectDetection of the same size, random weights, built offline (timm
    backbone, no pre-trained weights). As in DETR (and ours): dropout 0.1 on attention weights and in
    the FFN too (transformers defaults those two to 0), stem and layer1 frozen (transformers freezes
    them only for its own ResNet, not for a timm trunk)."""
    from transformers import DetrConfig, DetrForObjectDetection

    config = DetrConfig(
        backbone=c["backbone"],
        use_timm_backbone=True,
        use_pretrained_backbone=False,
        num_labels=c["classes"],
        num_queries=c["queries"],
        d_model=c["d_model"],
        encoder_layers=c["layers"],
        decoder_layers=c["layers"],
        encoder_attention_heads=c["nhead"],
        decoder_attention_heads=c["nhead"],
        encoder_ffn_dim=c["ffn"],
        decoder_ffn_dim=c["ffn"],
        auxiliary_loss=True,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,  # DETR's 0.1 everywhere, as ours
    )
    torch.manual_seed(0)
    model = DetrForObjectDetection(config)
    for name, p in model.model.backbone.named_parameters():
        p.requires_grad_(any(f"layer{i}" in name for i in (2, 3, 4)))
    return model.to(device)


def ours_detr(c: dict, device: torch.device) -> tuple[DETR, SetCriterion]:
    torch.manual_seed(0)
    backbone = Backbone(c["backbone"], out_index=4, norm="frozen_bn", trainable_layers=3)
    model = DETR(
        backbone,
        c["classes"],
        c["queries"],
        c["d_model"],
        c["nhead"],
        c["layers"],
        c["layers"],
        c["ffn"],
        dropout=0.1,
        aux_loss=True,
    )
    weights = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}  # the paper's
    criterion = SetCriterion(c["classes"], HungarianMatcher(1, 5, 2), 0.1, weights, num_aux=c["layers"] - 1)
    return model.to(device), criterion.to(device)


def matcher_share(
    step: Step, owner: object, clock: Callable[[], float], steps: int, device: torch.device, method: str = "forward"
) -> dict[str, str]:
    """The share of ``steps`` training steps spent inside ``owner.<method>`` (a Hungarian matcher
    instance or class: ours is entered once per step through ``match_layers``, Hugging Face's once per
    decoder layer through ``forward``), timed by ``clock``; the timer is in place only while measuring. On a GPU the
    timer starts once the kernels queued before the matcher have run, so that the wait for the forward
    pass, which the matcher's copy of its cost matrix to the CPU would otherwise absorb, is not counted."""
    original, spent = getattr(owner, method), [0.0]

    def timed(*args, **kwargs):
        synchronize(device)
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += clock() - start

    setattr(owner, method, timed)
    try:
        synchronize(device)
        start = clock()
        for _ in range(steps):
            step()
        synchronize(device)
        total = clock() - start
    finally:
        if isinstance(owner, type):
            setattr(owner, method, original)
        else:
            delattr(owner, method)  # back to the class's method
    return {"matching": f"{100 * spent[0] / total:.1f}% of the step"}


MATCHING_SHAPES = {  # decoder layers (final + auxiliary), images, queries, classes, targets per image
    "r50": dict(layers=6, batch=2, queries=100, classes=91, boxes=6),
    "batch 64": dict(layers=6, batch=64, queries=100, classes=91, boxes=20),
}
QUICK_MATCHING = dict(layers=2, batch=2, queries=8, classes=3, boxes=2)


def matching_bench(shape: str, s: Settings) -> Bench:
    """Hungarian matching of one DETR training step, every decoder layer: ours (`match_layers`, all
    layers in one pass, each image's queries against its own targets) vs Hugging Face's matcher called
    once per layer, as its loss does (each call costs the whole batch's queries against the whole
    batch's targets), on the same random predictions."""
    from transformers.loss.loss_for_object_detection import HungarianMatcher as HFMatcher

    c = QUICK_MATCHING if s.quick else MATCHING_SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    b, q = c["batch"], c["queries"]
    layers = [
        {
            "pred_logits": torch.randn(b, q, c["classes"] + 1, generator=g).to(s.device),
            "pred_boxes": (torch.rand(b, q, 4, generator=g) * 0.5 + 0.1).to(s.device),
        }
        for _ in range(c["layers"])
    ]
    targets = [
        {
            "labels": torch.randint(0, c["classes"], (c["boxes"],), generator=g).to(s.device),
            "boxes": (torch.rand(c["boxes"], 4, generator=g) * 0.5 + 0.1).to(s.device),
        }
        for _ in range(b)
    ]
    hf_layers = [{"logits": o["pred_logits"], "pred_boxes": o["pred_boxes"]} for o in layers]
    hf_targets = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in targets]
    ours, theirs = HungarianMatcher(1, 5, 2), HFMatcher(class_cost=1, bbox_cost=5, giou_cost=2)
    steps = {
        "ours": lambda: ours.match_layers(layers, targets),
        "HF matcher": lambda: [theirs(o, hf_targets) for o in hf_layers],
    }
    same = sum(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
        for mine, hers in zip(steps["ours"](), steps["HF matcher"]())
        for x, y in zip(mine, hers)
    )
    check = (
        f"{c['layers']} decoder layers x {b} images x {q} queries, {c['boxes']} targets each; "
        f"same assignment for {same}/{c['layers'] * b} (layer, image) pairs"
    )
    return Bench(steps, items=b, unit="images", check=check, inference=True)


def parameter_counts(model: nn.Module) -> str:
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.3f}M parameters ({trained / 1e6:.3f}M trained)"


def detr_bench(
    size: str, s: Settings, queries: int | None = None, boxes: int | None = None, with_peer: bool = True
) -> Bench:
    """DETR training step (set loss with aux losses, AdamW) on random images: ours vs Hugging Face's
    DetrForObjectDetection (skipped with a message when transformers is missing)."""
    from benchmarks.harness import clock

    c = dict(QUICK_DETR if s.quick else DETR_SHAPES[size])
    if queries:
        c["queries"] = queries
    boxes = boxes or (2 if s.quick else 6)
    images, mask, targets = detection_batch(c, boxes, torch.Generator().manual_seed(0), s.device)
    if s.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    model, criterion = ours_detr(c, s.device)
    if s.channels_last:
        model.backbone.to(memory_format=torch.channels_last)
    tick = clock(s.device)
    compiled = s.maybe_compile(model)

    def ours_loss(m: nn.Module) -> Tensor:
        return criterion.total(criterion(m(images, mask), targets))

    steps = {"ours": train_step(compiled, ours_loss, s)}
    extra = {
        "ours": lambda: matcher_share(
            steps["ours"], criterion.matcher, tick, 2 if s.quick else 4, s.device, "match_layers"
        )
    }
    check = f"ours {parameter_counts(model)}"
    if with_peer:
        try:
            theirs = hf_detr(c, s.device)
        except ImportError:
            print(
                "detr: transformers is not installed (pip install transformers): the Hugging Face DETR peer is skipped"
            )
        else:
            from transformers.loss import loss_for_object_detection as hf_loss

            if s.channels_last:
                theirs.model.backbone.to(memory_format=torch.channels_last)
            pixel_mask = (~mask).long()
            labels = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in targets]
            steps["HF DETR"] = train_step(
                s.maybe_compile(theirs), lambda m: m(pixel_values=images, pixel_mask=pixel_mask, labels=labels).loss, s
            )
            extra["HF DETR"] = lambda: matcher_share(
                steps["HF DETR"], hf_loss.HungarianMatcher, tick, 2 if s.quick else 4, s.device
            )
            check += f", HF {parameter_counts(theirs)}"
    return Bench(steps, items=c["batch"], unit="images", check=check, extra=extra)
