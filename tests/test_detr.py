"""DETR's math: box ops against hand values and torchvision, the matcher against brute force, the set
loss (empty targets, permutations, aux layers), the model, and a
tiny DETR that overfits two images."""

import itertools

import pytest
import torch
import torchvision.ops as tvops
from conftest import TINY_TRUNK

from models.detection.backbone import Backbone
from models.detection.box_ops import (
    box_cxcywh_to_xyxy,
    box_iou,
    box_xywh_to_xyxy,
    box_xyxy_to_cxcywh,
    box_xyxy_to_xywh,
    generalized_box_iou,
)
from models.detection.criterion import SetCriterion
from models.detection.detr import DETR, build_detr, convert_official_state_dict, post_process
from models.detection.matcher import HungarianMatcher

PAPER_WEIGHTS = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}


def random_boxes(n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, 4) valid normalised cxcywh boxes."""
    cxcy = torch.rand(n, 2, generator=generator) * 0.6 + 0.2
    wh = torch.rand(n, 2, generator=generator) * 0.3 + 0.05
    return torch.cat([cxcy, wh], dim=1)


def random_problem(seed: int, batch: int = 2, queries: int = 6, classes: int = 3, sizes=(3, 2)):
    g = torch.Generator().manual_seed(seed)
    outputs = {
        "pred_logits": torch.randn(batch, queries, classes + 1, generator=g),
        "pred_boxes": torch.stack([random_boxes(queries, g) for _ in range(batch)]),
    }
    targets = [{"labels": torch.randint(0, classes, (n,), generator=g), "boxes": random_boxes(n, g)} for n in sizes]
    return outputs, targets


# --- box ops -------------------------------------------------------------------------------------


def test_box_conversions_against_hand_values():
    cxcywh = torch.tensor([[0.5, 0.5, 0.2, 0.4]])
    xyxy = torch.tensor([[0.4, 0.3, 0.6, 0.7]])
    torch.testing.assert_close(box_cxcywh_to_xyxy(cxcywh), xyxy)
    torch.testing.assert_close(box_xyxy_to_cxcywh(xyxy), cxcywh)
    torch.testing.assert_close(
        box_xywh_to_xyxy(torch.tensor([[10.0, 20.0, 30.0, 5.0]])), torch.tensor([[10.0, 20.0, 40.0, 25.0]])
    )
    torch.testing.assert_close(
        box_xyxy_to_xywh(torch.tensor([[10.0, 20.0, 40.0, 25.0]])), torch.tensor([[10.0, 20.0, 30.0, 5.0]])
    )


def test_giou_against_hand_values_and_torchvision():
    a = torch.tensor([[0.0, 0.0, 2.0, 2.0]])
    b = torch.tensor([[1.0, 1.0, 3.0, 3.0], [0.0, 0.0, 2.0, 2.0], [3.0, 0.0, 4.0, 2.0]])
    # overlap: IoU 1/7, enclosing 9, union 7 -> 1/7 - 2/9; identical: 1; disjoint: 0 - (8 - 6)/8
    expected = torch.tensor([[1 / 7 - 2 / 9, 1.0, -0.25]])
    torch.testing.assert_close(generalized_box_iou(a, b), expected)
    torch.testing.assert_close(box_iou(a, b)[0], torch.tensor([[1 / 7, 1.0, 0.0]]))
    g = torch.Generator().manual_seed(0)
    x, y = box_cxcywh_to_xyxy(random_boxes(7, g)), box_cxcywh_to_xyxy(random_boxes(5, g))
    torch.testing.assert_close(generalized_box_iou(x, y), tvops.generalized_box_iou(x, y))
    x2, y2 = x.flip(0), y.flip(0)
    batched = generalized_box_iou(torch.stack([x, x2]), torch.stack([y, y2]))  # (2, 7, 5): two images, their own boxes
    torch.testing.assert_close(
        batched, torch.stack([tvops.generalized_box_iou(x, y), tvops.generalized_box_iou(x2, y2)])
    )


def test_giou_of_two_identical_points_is_finite():
    point = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    assert torch.isfinite(generalized_box_iou(point, point)).all()


# --- matcher -------------------------------------------------------------------------------------


def test_cost_matrix_equals_the_formula():
    outputs, targets = random_problem(0)
    cost = HungarianMatcher(1, 5, 2).cost_matrix(outputs, targets)  # (B, Q, max T_b)
    assert cost.shape == (2, 6, 3)
    b, q, t = 1, 4, 0  # image 1, query 4 against the first target of image 1
    tgt = targets[1]
    p = outputs["pred_logits"][b, q].softmax(-1)[tgt["labels"][0]]
    l1 = (outputs["pred_boxes"][b, q] - tgt["boxes"][0]).abs().sum()
    giou = tvops.generalized_box_iou(
        box_cxcywh_to_xyxy(outputs["pred_boxes"][b, q][None]), box_cxcywh_to_xyxy(tgt["boxes"][:1])
    )[0, 0]
    torch.testing.assert_close(cost[b, q, t], -p + 5 * l1 - 2 * giou)


@pytest.mark.parametrize("seed", range(6))
def test_matcher_is_the_brute_force_optimum(seed):
    outputs, targets = random_problem(seed, batch=2, queries=5, sizes=(3, 4))
    matcher = HungarianMatcher(1, 5, 2)
    cost = matcher.cost_matrix(outputs, targets)
    for b, (rows, cols) in enumerate(matcher(outputs, targets)):
        c = cost[b, :, : len(targets[b]["labels"])]  # (Q, T_b)
        n_t = c.shape[1]
        assert sorted(cols.tolist()) == list(range(n_t)) and len(set(rows.tolist())) == n_t  # one-to-one, all targets
        best = min(sum(c[qs[j], j] for j in range(n_t)) for qs in itertools.permutations(range(c.shape[0]), n_t))
        torch.testing.assert_close(c[rows, cols].sum(), best)


def test_batched_matcher_equals_per_image_matcher():
    outputs, targets = random_problem(3, batch=3, queries=8, sizes=(4, 0, 2))
    matcher = HungarianMatcher(1, 5, 2)
    batched = matcher(outputs, targets)
    for b in range(3):
        single = matcher({k: v[b : b + 1] for k, v in outputs.items()}, [targets[b]])[0]
        assert torch.equal(batched[b][0], single[0]) and torch.equal(batched[b][1], single[1])


def test_matching_all_layers_at_once_equals_matching_each():
    """`match_layers` (one cost computation and one copy to the CPU for the final and auxiliary
    layers) gives each layer the assignment and the costs that matching it alone gives."""
    layers = [random_problem(seed, batch=3, queries=8, sizes=(4, 0, 2))[0] for seed in range(4)]
    targets = random_problem(0, batch=3, queries=8, sizes=(4, 0, 2))[1]
    matcher = HungarianMatcher(1, 5, 2)
    together = matcher.match_layers(layers, targets)
    stacked = {k: torch.stack([o[k] for o in layers]) for k in layers[0]}
    costs = matcher.cost_matrix(stacked, targets)  # (L, B, Q, T)
    for layer, outputs, indices, cost in zip(range(4), layers, together, costs):
        torch.testing.assert_close(cost, matcher.cost_matrix(outputs, targets))
        for (rows, cols), (rows1, cols1) in zip(indices, matcher(outputs, targets)):
            assert torch.equal(rows, rows1) and torch.equal(cols, cols1), f"layer {layer}"


def test_matcher_with_empty_targets():
    outputs, targets = random_problem(1, batch=2, sizes=(0, 0))
    for rows, cols in HungarianMatcher(1, 5, 2)(outputs, targets):
        assert rows.numel() == cols.numel() == 0


def test_matching_and_loss_are_invariant_to_permuting_targets():
    outputs, targets = random_problem(4, batch=2, queries=7, sizes=(5, 3))
    criterion = SetCriterion(3, HungarianMatcher(1, 5, 2))
    matched = HungarianMatcher(1, 5, 2)(outputs, targets)
    perm = torch.tensor([3, 0, 4, 2, 1])
    permuted = [{k: v[perm] for k, v in targets[0].items()}, targets[1]]
    matched_p = HungarianMatcher(1, 5, 2)(outputs, permuted)
    pairs = {(q, c) for q, c in zip(*(x.tolist() for x in matched[0]))}
    pairs_p = {(q, perm[c].item()) for q, c in zip(*(x.tolist() for x in matched_p[0]))}
    assert pairs == pairs_p
    for key, value in criterion(outputs, targets).items():
        torch.testing.assert_close(criterion(outputs, permuted)[key], value)


def test_matcher_refuses_all_zero_costs():
    with pytest.raises(ValueError, match="at least one"):
        HungarianMatcher(0, 0, 0)


# --- criterion -----------------------------------------------------------------------------------


def test_set_criterion_against_a_direct_computation():
    outputs, targets = random_problem(5, batch=2, queries=6, sizes=(2, 1))
    criterion = SetCriterion(3, HungarianMatcher(1, 5, 2), eos_coef=0.1, weight_dict=PAPER_WEIGHTS)
    losses = criterion(outputs, targets)
    indices = HungarianMatcher(1, 5, 2)(outputs, targets)
    ce, weight, l1, giou = 0.0, 0.0, 0.0, 0.0
    for b, (rows, cols) in enumerate(indices):
        labels = torch.full((6,), 3)
        labels[rows] = targets[b]["labels"][cols]
        for q in range(6):
            w = 0.1 if labels[q] == 3 else 1.0
            ce += -w * outputs["pred_logits"][b, q].log_softmax(-1)[labels[q]]
            weight += w
        pred, tgt = outputs["pred_boxes"][b, rows], targets[b]["boxes"][cols]
        l1 += (pred - tgt).abs().sum()
        giou += (1 - torch.diag(tvops.generalized_box_iou(box_cxcywh_to_xyxy(pred), box_cxcywh_to_xyxy(tgt)))).sum()
    torch.testing.assert_close(losses["loss_ce"], ce / weight)
    torch.testing.assert_close(losses["loss_bbox"], l1 / 3)  # normalised by the 3 target boxes
    torch.testing.assert_close(losses["loss_giou"], giou / 3)
    assert criterion.total(losses) == pytest.approx(
        float(losses["loss_ce"] + 5 * losses["loss_bbox"] + 2 * losses["loss_giou"]), rel=1e-6
    )
    unweighted = SetCriterion(3, HungarianMatcher(1, 5, 2))  # no weights given: each loss counts once
    assert unweighted.total(losses) == pytest.approx(float(sum(losses[k] for k in PAPER_WEIGHTS)), rel=1e-6)


def test_criterion_with_empty_targets_learns_no_object_everywhere():
    outputs, targets = random_problem(6, batch=2, sizes=(0, 0))
    outputs["pred_logits"].requires_grad_(True)
    losses = SetCriterion(3, HungarianMatcher(1, 5, 2))(outputs, targets)
    assert losses["loss_bbox"] == 0 and losses["loss_giou"] == 0
    torch.testing.assert_close(
        losses["loss_ce"], torch.nn.functional.cross_entropy(outputs["pred_logits"].flatten(0, 1), torch.full((12,), 3))
    )
    losses["loss_ce"].backward()
    assert outputs["pred_logits"].grad[..., 3].lt(0).all()  # descending raises the no-object logit


def test_aux_outputs_get_their_own_matching_and_weights():
    outputs, targets = random_problem(7)
    aux, _ = random_problem(8)
    outputs["aux_outputs"] = [aux]
    criterion = SetCriterion(3, HungarianMatcher(1, 5, 2), num_aux=1)
    losses = criterion(outputs, targets)
    aux_losses = SetCriterion(3, HungarianMatcher(1, 5, 2))(aux, targets)
    for key in ("loss_ce", "loss_bbox", "loss_giou"):
        torch.testing.assert_close(losses[f"{key}_0"], aux_losses[key])
        assert criterion.weight_dict[f"{key}_0"] == criterion.weight_dict[key]


# --- model ---------------------------------------------------------------------------------------


def tiny_detr(num_classes: int = 3, num_queries: int = 5, **kwargs) -> DETR:
    return DETR(
        Backbone(**TINY_TRUNK),
        num_classes,
        num_queries,
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        dim_feedforward=64,
        dropout=0.0,
        **kwargs,
    )


def test_detr_outputs_and_names():
    torch.manual_seed(0)
    model = tiny_detr()
    images, mask = torch.randn(2, 3, 64, 48), torch.zeros(2, 64, 48, dtype=torch.bool)
    mask[1, :, 32:] = True
    out = model(images, mask)
    assert out["pred_logits"].shape == (2, 5, 4) and out["pred_boxes"].shape == (2, 5, 4)
    assert len(out["aux_outputs"]) == 2 and out["aux_outputs"][0]["pred_boxes"].shape == (2, 5, 4)
    assert out["pred_boxes"].min() >= 0 and out["pred_boxes"].max() <= 1
    names = set(model.state_dict())
    # the official checkpoint's keys, after renaming the backbone prefix
    for key in (
        "input_proj.weight",
        "query_embed.weight",
        "class_embed.weight",
        "bbox_embed.layers.2.bias",
        "transformer.encoder.layers.1.self_attn.in_proj_weight",
        "transformer.decoder.layers.2.multihead_attn.out_proj.weight",
        "transformer.decoder.norm.weight",
        "backbone.body.layer1.0.conv1.weight",
    ):
        assert key in names
    assert "backbone.body.conv1.weight" in convert_official_state_dict({"backbone.0.body.conv1.weight": torch.zeros(1)})
    assert tiny_detr(aux_loss=False)(images, mask)["aux_outputs"] == []


def test_reference_defaults():
    model = build_detr()
    assert (
        model.num_queries,
        model.class_embed.out_features,
        model.input_proj.in_channels,
        len(model.transformer.encoder.layers),
    ) == (100, 92, 2048, 6)
    assert (
        model.backbone.stride == 32 and not model.backbone.body.conv1.weight.requires_grad
    )  # layer2-4 train, stem frozen
    assert model.backbone.body.layer2[0].conv1.weight.requires_grad
    assert type(model.backbone.body.bn1).__name__ == "FrozenBatchNorm2d"
    assert 41.0e6 < sum(p.numel() for p in model.parameters()) < 41.7e6  # the paper's 41M


def test_backbone_weights_load_from_a_local_file_only(tmp_path):
    source = Backbone(**TINY_TRUNK)
    torch.save({"model": {**source.body.state_dict(), "fc.weight": torch.zeros(3)}}, tmp_path / "trunk.pth")
    loaded = Backbone(**{**TINY_TRUNK, "norm": "frozen_bn"}, weights=str(tmp_path / "trunk.pth"))
    torch.testing.assert_close(loaded.body.layer1[0].conv1.weight, source.body.layer1[0].conv1.weight)
    torch.testing.assert_close(loaded.body.bn1.running_var, source.body.bn1.running_var)
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        Backbone(**TINY_TRUNK, weights=str(tmp_path / "missing.pth"))
    torch.save({"conv1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="lacks"):
        Backbone(**TINY_TRUNK, weights=str(tmp_path / "other.pth"))


def test_post_process_gives_absolute_xyxy_boxes():
    outputs = {
        "pred_logits": torch.tensor([[[0.0, 5.0, 0.0, 9.0]]]),
        "pred_boxes": torch.tensor([[[0.5, 0.5, 0.2, 0.4]]]),
    }
    (result,) = post_process(outputs, torch.tensor([[100, 200]]))  # (h, w)
    torch.testing.assert_close(result["boxes"], torch.tensor([[80.0, 30.0, 120.0, 70.0]]))
    assert result["labels"].item() == 1  # the best real class, not "no object"
    torch.testing.assert_close(result["scores"], torch.tensor([0.0, 5.0, 0.0, 9.0]).softmax(0)[1:2])


@pytest.mark.slow
def test_tiny_detr_overfits_two_images():
    torch.manual_seed(0)
    model = tiny_detr(num_classes=2, num_queries=4)
    images = torch.zeros(2, 3, 64, 64)
    boxes_px = [
        torch.tensor([[8.0, 8.0, 28.0, 28.0], [36.0, 40.0, 60.0, 60.0]]),
        torch.tensor([[20.0, 30.0, 48.0, 50.0]]),
    ]
    labels = [torch.tensor([0, 1]), torch.tensor([1])]
    for b, bx in enumerate(boxes_px):
        for (x0, y0, x1, y1), lab in zip(bx.int().tolist(), labels[b].tolist()):
            images[b, lab, y0:y1, x0:x1] = 1.0  # class 0 red, class 1 green
    targets = [{"labels": labels[b], "boxes": box_xyxy_to_cxcywh(boxes_px[b] / 64)} for b in range(2)]
    criterion = SetCriterion(2, HungarianMatcher(1, 5, 2), weight_dict=PAPER_WEIGHTS, num_aux=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = None
    for _ in range(100):
        loss = criterion.total(criterion(model(images), targets))
        first = float(loss.detach()) if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.2 * first
    model.eval()
    results = post_process(model(images), torch.tensor([[64, 64], [64, 64]]))
    for b in range(2):
        keep = results[b]["scores"] > 0.5
        assert keep.sum() == len(labels[b])
        iou = box_iou(results[b]["boxes"][keep], boxes_px[b])[0]
        matched = iou.argmax(1)
        assert iou.max(1).values.min() > 0.7
        assert torch.equal(results[b]["labels"][keep], labels[b][matched])
