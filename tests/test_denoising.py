"""Convergence techniques of DETR: denoising queries (DN-DETR), anchor-box queries (DAB-DETR) and focal
classes, and queries selected from the encoder's proposals (two-stage). The noise stays in its bounds, the attention mask lets no information leak between groups or
into the matching queries, the denoising loss pairs each slot with its own target, the anchors refine
as sigmoid(inverse_sigmoid(anchor) + delta) with detached anchors, the focal terms equal their formulas, and
the encoder's queries are its best-scoring unpadded cells, trained by the set loss."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_TRUNK

from models.detection.backbone import Backbone
from models.detection.box_ops import box_cxcywh_to_xyxy, generalized_box_iou, inverse_sigmoid
from models.detection.criterion import SetCriterion
from models.detection.denoising import denoising_attn_mask, denoising_indices, denoising_queries
from models.detection.detr import DETR, box_sine_embedding, post_process
from models.detection.matcher import HungarianMatcher
from models.detection.query_selection import cell_boxes


def tiny_detr(num_queries: int = 5, **kwargs) -> DETR:
    torch.manual_seed(0)
    return DETR(
        Backbone(**TINY_TRUNK),
        3,
        num_queries,
        d_model=32,
        nhead=4,
        num_encoder_layers=1,
        num_decoder_layers=3,
        dim_feedforward=64,
        dropout=0.0,
        **kwargs,
    )


def targets_of(*sizes: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "labels": torch.randint(0, 3, (n,), generator=g),
            "boxes": torch.cat(
                [torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.3 + 0.05], 1
            ),
        }
        for n in sizes
    ]


# --- denoising queries ---------------------------------------------------------------------------


def test_without_noise_every_group_is_the_ground_truth_and_padding_is_marked():
    targets = targets_of(3, 1)
    dn = denoising_queries(targets, num_groups=2, label_noise=0.0, box_noise=0.0, num_classes=3, num_queries=5)
    assert dn.labels.shape == (2, 6) and dn.boxes.shape == (2, 6, 4) and dn.attn_mask.shape == (11, 11)
    for g in range(2):
        torch.testing.assert_close(dn.boxes[0, 3 * g : 3 * g + 3], targets[0]["boxes"])
        assert torch.equal(dn.labels[0, 3 * g : 3 * g + 3], targets[0]["labels"])
        assert torch.equal(dn.labels[1, 3 * g : 3 * g + 3], torch.cat([targets[1]["labels"], torch.tensor([3, 3])]))
    assert dn.padding.tolist() == [[False] * 6, [False, True, True] * 2]


def test_box_noise_shifts_centres_by_half_the_size_and_scales_sizes_within_the_scale():
    torch.manual_seed(0)
    targets = targets_of(4, 4)
    dn = denoising_queries(targets, num_groups=50, label_noise=0.0, box_noise=0.4, num_classes=3, num_queries=5)
    gt = torch.stack([t["boxes"] for t in targets])[:, None].expand(2, 50, 4, 4).flatten(1, 2)  # (B, G·P, 4)
    shift, wh = (dn.boxes[..., :2] - gt[..., :2]).abs(), gt[..., 2:]
    assert (shift <= 0.4 * wh / 2 + 1e-6).all() and (shift > 0.3 * wh / 2).any()  # the bound is reached, not exceeded
    assert (dn.boxes[..., 2:] >= 0.6 * wh - 1e-6).all() and (dn.boxes[..., 2:] <= 1.4 * wh + 1e-6).all()
    assert not torch.allclose(dn.boxes, gt)


def test_label_noise_flips_about_its_probability():
    torch.manual_seed(0)
    targets = [{"labels": torch.zeros(10, dtype=torch.long), "boxes": torch.full((10, 4), 0.5)}]
    dn = denoising_queries(targets, num_groups=200, label_noise=0.3, box_noise=0.0, num_classes=4, num_queries=5)
    changed = (dn.labels != 0).float().mean()  # a flip draws any of the 4 classes, so 3/4 of the flips change the label
    assert abs(float(changed) - 0.3 * 3 / 4) < 0.03


def test_attention_mask_by_hand():
    m = denoising_attn_mask(num_queries=2, num_groups=2, pad_size=1)
    x, o = True, False  # blocked, seen; rows: queries 0-1 (matching), 2 (group 0), 3 (group 1)
    assert m.tolist() == [[o, o, x, x], [o, o, x, x], [o, o, o, x], [o, o, x, o]]


def test_a_batch_without_boxes_has_no_denoising_queries():
    assert denoising_queries(targets_of(0, 0), 3, 0.2, 0.4, 3, 5) is None
    assert denoising_queries(targets_of(2), 0, 0.2, 0.4, 3, 5) is None


def test_a_batch_without_boxes_still_trains():
    model = tiny_detr(query_type="anchor", dn_number=3).train()
    targets = targets_of(0, 0)
    out = model(torch.randn(2, 3, 32, 32), targets=targets)
    assert "dn_outputs" not in out
    criterion = SetCriterion(3, HungarianMatcher(1, 5, 2), num_aux=2, denoising=True)
    loss = criterion.total(criterion(out, targets))
    loss.backward()
    assert torch.isfinite(loss) and model.class_embed.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "key, kwargs",
    [
        ("dn_number", {"dn_number": -1}),
        ("dn_label_noise", {"dn_label_noise": 1.5}),
        ("dn_box_noise", {"dn_box_noise": -0.1}),
    ],
)
def test_denoising_settings_that_cannot_work_fail_when_built(key, kwargs):
    with pytest.raises(ValueError, match=rf"^model\.{key}=\S+: .*(>= 0|\[0, 1\])") as err:
        tiny_detr(**kwargs)
    assert "\n" not in str(err.value)


# --- no information leaks through the mask -------------------------------------------------------


@pytest.mark.parametrize("query_type", ["vanilla", "anchor"])
def test_perturbing_one_group_changes_no_other_group_nor_the_matching_queries(query_type):
    model = tiny_detr(query_type=query_type, dn_number=3).eval()
    memory, mask, pos, cells = model.encode(torch.randn(2, 3, 32, 32))
    dn = denoising_queries(targets_of(3, 2), 3, 0.2, 0.4, 3, model.num_queries)
    p = 3  # slots per group
    before = model.decode(memory, mask, pos, cells, dn)
    dn.boxes[:, p : 2 * p] = torch.rand(2, p, 4) * 0.5 + 0.25  # group 1: other boxes and labels
    dn.labels[:, p : 2 * p] = (dn.labels[:, p : 2 * p] + 1) % 3
    after = model.decode(memory, mask, pos, cells, dn)
    for key in ("pred_logits", "pred_boxes"):
        layers_before = [before] + before["aux_outputs"]
        layers_after = [after] + after["aux_outputs"]
        for b, a in zip(layers_before, layers_after):
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)  # the matching queries
        dn_before = [before["dn_outputs"]] + before["dn_outputs"]["aux_outputs"]
        dn_after = [after["dn_outputs"]] + after["dn_outputs"]["aux_outputs"]
        for b, a in zip(dn_before, dn_after):
            torch.testing.assert_close(a[key][:, :p], b[key][:, :p], rtol=0, atol=1e-6)  # group 0
            torch.testing.assert_close(a[key][:, 2 * p :], b[key][:, 2 * p :], rtol=0, atol=1e-6)  # group 2
            assert not torch.allclose(a[key][:, p : 2 * p], b[key][:, p : 2 * p])  # group 1 itself did change


def test_padding_slots_are_not_seen_by_their_group():
    model = tiny_detr(dn_number=2).eval()
    memory, mask, pos, cells = model.encode(torch.randn(2, 3, 32, 32))
    dn = denoising_queries(targets_of(3, 1), 2, 0.0, 0.4, 3, model.num_queries)
    before = model.decode(memory, mask, pos, cells, dn)["dn_outputs"]["pred_boxes"]
    dn.boxes[1, 1:3] = 0.7  # image 1's padding slots in group 0
    after = model.decode(memory, mask, pos, cells, dn)["dn_outputs"]["pred_boxes"]
    torch.testing.assert_close(after[1, 0], before[1, 0], rtol=0, atol=1e-6)


# --- denoising loss ------------------------------------------------------------------------------


def test_denoising_indices_pair_each_slot_with_its_own_target():
    (slots0, tgt0), (slots1, tgt1) = denoising_indices(targets_of(3, 1), num_groups=2, pad_size=3)
    assert slots0.tolist() == [0, 1, 2, 3, 4, 5] and tgt0.tolist() == [0, 1, 2, 0, 1, 2]
    assert slots1.tolist() == [0, 3] and tgt1.tolist() == [0, 0]


def test_denoising_box_losses_against_a_direct_computation():
    targets = targets_of(2, 1, seed=1)
    g = torch.Generator().manual_seed(2)
    groups, pad = 3, 2
    dn_out = {
        "pred_logits": torch.randn(2, groups * pad, 4, generator=g),
        "pred_boxes": torch.rand(2, groups * pad, 4, generator=g) * 0.3 + 0.3,
        "aux_outputs": [],
        "num_groups": groups,
    }
    outputs = {
        "pred_logits": torch.randn(2, 5, 4, generator=g),
        "pred_boxes": torch.rand(2, 5, 4, generator=g) * 0.3 + 0.3,
        "aux_outputs": [],
        "dn_outputs": dn_out,
    }
    criterion = SetCriterion(3, HungarianMatcher(1, 5, 2), denoising=True)
    losses = criterion(outputs, targets)
    l1, giou = 0.0, 0.0
    for b, t in enumerate(targets):
        for grp in range(groups):
            for j in range(len(t["labels"])):
                pred, tgt = dn_out["pred_boxes"][b, grp * pad + j], t["boxes"][j]
                l1 += (pred - tgt).abs().sum()
                giou += 1 - generalized_box_iou(box_cxcywh_to_xyxy(pred)[None], box_cxcywh_to_xyxy(tgt)[None])[0, 0]
    torch.testing.assert_close(losses["loss_bbox_dn"], l1 / (3 * groups))  # 3 target boxes, 3 groups
    torch.testing.assert_close(losses["loss_giou_dn"], giou / (3 * groups))
    assert criterion.weight_dict["loss_bbox_dn"] == criterion.weight_dict["loss_bbox"]
    assert "loss_ce_dn" in losses and "loss_ce_dn" not in SetCriterion(3, HungarianMatcher(1, 5, 2)).weight_dict


def test_denoising_only_in_training_and_out_of_the_matched_outputs():
    model = tiny_detr(dn_number=2)
    targets = targets_of(2, 3)
    out = model.train()(torch.randn(2, 3, 32, 32), targets=targets)
    assert out["pred_logits"].shape == (2, 5, 4) and out["dn_outputs"]["pred_boxes"].shape == (2, 2 * 3, 4)
    assert len(out["dn_outputs"]["aux_outputs"]) == 2
    assert "dn_outputs" not in model.eval()(torch.randn(2, 3, 32, 32), targets=targets)


def test_vanilla_defaults_build_no_new_parts():
    names = set(tiny_detr().state_dict())
    assert not any(n.split(".")[0] in ("label_enc", "refpoint_embed", "ref_point_head") for n in names)
    assert tiny_detr().class_embed.out_features == 4
    assert "sigmoid" not in tiny_detr()(torch.randn(1, 3, 32, 32))


# --- anchor-box queries --------------------------------------------------------------------------


def test_box_sine_embedding_orders_y_x_w_h():
    boxes = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    emb = box_sine_embedding(boxes, 8)  # (1, 32)
    assert emb.shape == (1, 32)
    torch.testing.assert_close(emb[0, 0], torch.sin(torch.tensor(0.2 * 2 * torch.pi)))  # y first
    torch.testing.assert_close(emb[0, 8], torch.sin(torch.tensor(0.1 * 2 * torch.pi)))  # then x
    torch.testing.assert_close(
        emb[0, 17], torch.cos(torch.tensor(0.3 * 2 * torch.pi))
    )  # w, cos of the lowest frequency


def test_each_layer_refines_its_anchor_in_inverse_sigmoid_space():
    model = tiny_detr(query_type="anchor").eval()
    with torch.no_grad():
        model.bbox_embed.layers[-1].weight.normal_(0, 0.1)  # the zero init would make every delta 0
    hs = []
    handle = model.transformer.decoder.norm.register_forward_hook(lambda m, i, o: hs.append(o))
    out = model(torch.randn(2, 3, 32, 32))
    handle.remove()
    boxes = [a["pred_boxes"] for a in out["aux_outputs"]] + [out["pred_boxes"]]
    anchor = model.refpoint_embed.weight.sigmoid()[None].expand(2, -1, -1)
    for h, box in zip(hs, boxes):
        torch.testing.assert_close(box, (inverse_sigmoid(anchor) + model.bbox_embed(h)).sigmoid())
        anchor = box
    assert not torch.allclose(boxes[0], boxes[-1])


def test_first_predictions_are_the_anchors_at_init():
    model = tiny_detr(query_type="anchor").eval()
    out = model(torch.randn(2, 3, 32, 32))
    torch.testing.assert_close(
        out["aux_outputs"][0]["pred_boxes"], model.refpoint_embed.weight.sigmoid()[None].expand(2, -1, -1)
    )


def test_no_gradient_flows_through_the_detached_anchors():
    """With the positional-query head zeroed, a layer's hidden state no longer depends on its anchor, so the
    learned anchors reach the last layer's box only through the chain of anchors, which is detached: no
    gradient. The first layer's box is computed from the learned anchor itself: a gradient."""
    model = tiny_detr(query_type="anchor")
    with torch.no_grad():
        model.ref_point_head.layers[-1].weight.zero_()
        model.bbox_embed.layers[-1].weight.normal_(0, 0.1)
    out = model(torch.randn(2, 3, 32, 32))
    (last,) = torch.autograd.grad(
        out["pred_boxes"].sum(), model.refpoint_embed.weight, allow_unused=True, retain_graph=True
    )
    assert last is None or torch.count_nonzero(last) == 0
    (first,) = torch.autograd.grad(out["aux_outputs"][0]["pred_boxes"].sum(), model.refpoint_embed.weight)
    assert torch.count_nonzero(first) > 0


# --- focal classes -------------------------------------------------------------------------------


def test_focal_matcher_cost_and_loss_equal_their_formulas():
    g = torch.Generator().manual_seed(3)
    outputs = {
        "pred_logits": torch.randn(2, 6, 3, generator=g),
        "pred_boxes": torch.rand(2, 6, 4, generator=g) * 0.3 + 0.3,
    }
    targets = targets_of(2, 1, seed=4)
    matcher = HungarianMatcher(2, 5, 2, focal=True)
    cost = matcher.cost_matrix(outputs, targets)
    b, q, t = 0, 4, 1
    p = outputs["pred_logits"][b, q].sigmoid()[targets[b]["labels"][t]]
    focal_cost = 0.25 * (1 - p) ** 2 * -torch.log(p) - 0.75 * p**2 * -torch.log(1 - p)
    boxes_only = HungarianMatcher(0, 5, 2).cost_matrix(outputs, targets)
    torch.testing.assert_close(cost[b, q, t], 2 * focal_cost + boxes_only[b, q, t])

    criterion = SetCriterion(3, matcher, focal_alpha=0.25)
    losses = criterion(outputs, targets)
    onehot = torch.zeros(2, 6, 3)
    for img, (rows, cols) in enumerate(matcher(outputs, targets)):
        onehot[img, rows, targets[img]["labels"][cols]] = 1
    prob = outputs["pred_logits"].sigmoid()
    ce = F.binary_cross_entropy_with_logits(outputs["pred_logits"], onehot, reduction="none")
    p_t = prob * onehot + (1 - prob) * (1 - onehot)
    expected = ((0.25 * onehot + 0.75 * (1 - onehot)) * (1 - p_t) ** 2 * ce).sum() / 3  # 3 target boxes
    torch.testing.assert_close(losses["loss_ce"], expected)


def test_focal_model_has_k_sigmoid_outputs_and_post_process_reads_them():
    model = tiny_detr(class_loss="focal")
    out = model(torch.randn(1, 3, 32, 32))
    assert out["pred_logits"].shape == (1, 5, 3) and out["sigmoid"] is True
    torch.testing.assert_close(
        out["pred_logits"].sigmoid().mean(), torch.tensor(0.01), atol=0.01, rtol=0
    )  # the 1% prior
    (det,) = post_process(
        {"pred_logits": torch.tensor([[[0.0, 2.0, -1.0]]]), "pred_boxes": torch.full((1, 1, 4), 0.5), "sigmoid": True},
        torch.tensor([[10, 10]]),
    )
    assert det["labels"].item() == 1
    torch.testing.assert_close(det["scores"], torch.tensor([2.0]).sigmoid())


# --- queries selected from the encoder's proposals (two-stage) ------------------------------------


def half_padded(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """64 x 64 images (4 x 4 cells at stride 16); the last image's right half is padding."""
    torch.manual_seed(1)
    mask = torch.zeros(batch, 64, 64, dtype=torch.bool)
    mask[-1, :, 32:] = True
    return torch.randn(batch, 3, 64, 64), mask


def test_cell_boxes_by_hand():
    mask = torch.zeros(1, 2, 4, dtype=torch.bool)
    mask[0, :, 3] = True  # 2 x 3 valid cells
    cells = cell_boxes(mask)
    assert cells.shape == (1, 8, 4)
    torch.testing.assert_close(cells[0, 0], torch.tensor([1 / 6, 1 / 4, 1 / 3, 1 / 2]))
    torch.testing.assert_close(cells[0, 6], torch.tensor([5 / 6, 3 / 4, 1 / 3, 1 / 2]))  # row 1, column 2
    assert cells[0, 3, 0] > 1  # a padded cell lies outside the image


class HandPlaced(torch.nn.Module):
    """Stands in for the cells' classifier: the given logits (B, h·w, C), whatever the memory."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits


# `half_padded`'s 4 x 4 cells: image 1's columns 2 and 3 are padding
WINNERS = [[2, 7, 9, 12, 15], [0, 5, 8, 9, 13]]  # the 5 most probable real classes, by construction
DECOYS = [5, 4]  # softmax: the largest real logit among the unpadded cells, and a larger no-object logit
PADDED = [2, 3, 6, 7, 10, 11, 14, 15]


def hand_placed_cell_logits(class_loss: str) -> torch.Tensor:
    """(2, 16, C) cell logits whose 5 best unpadded cells are `WINNERS`: the winners' best real class has
    probability 0.48 to 0.87 (softmax) or 0.73 to 0.95 (sigmoid), every other unpadded cell below 0.01;
    the decoy's real logit (6) is larger than every winner's (at most 3), but softmax gives its class
    e^6 / (e^6 + 2 + e^12) = 0.002; the padded cells are the most probable of all (logit 20)."""
    focal = class_loss == "focal"
    logits = torch.full((2, 16, 3), -5.0) if focal else torch.tensor([0.0, 0.0, 0.0, 5.0]).repeat(2, 16, 1)
    for image, cells in enumerate(WINNERS):
        for j, cell in enumerate(cells):
            logits[image, cell, j % 3] = 1.0 + 0.5 * j
            if not focal:
                logits[image, cell, 3] = 0.0
        if not focal:
            logits[image, DECOYS[image]] = torch.tensor([6.0, 0.0, 0.0, 12.0])
    logits[1, PADDED, 0] = 20.0
    if not focal:
        logits[1, PADDED, 3] = -20.0
    return logits


@pytest.mark.parametrize("class_loss", ["ce", "focal"])
def test_encoder_queries_are_the_best_unpadded_cells_and_start_at_their_proposals(class_loss):
    model = tiny_detr(query_type="encoder", class_loss=class_loss).eval()
    model.proposals.enc_class_embed = HandPlaced(hand_placed_cell_logits(class_loss))
    with torch.no_grad():
        model.proposals.enc_bbox_embed.layers[-1].weight.normal_(0, 0.1)  # proposals that differ from the cells
    images, mask = half_padded()
    memory_mask = model.encode(images, mask)[1]
    assert memory_mask[1].nonzero()[:, 0].tolist() == PADDED and not memory_mask[0].any()
    with torch.no_grad():
        out = model(images, mask)
    enc = out["enc_outputs"]
    assert enc["pred_logits"].shape == (2, 16, 3 if class_loss == "focal" else 4)
    first = out["aux_outputs"][0][
        "pred_boxes"
    ]  # the decoder's box head starts at zero: its first boxes are the anchors
    for image, winners in enumerate(WINNERS):
        chosen = torch.cdist(first[image], enc["pred_boxes"][image]).argmin(1)  # (5,): the cell of each anchor
        assert sorted(chosen.tolist()) == winners
        torch.testing.assert_close(first[image], enc["pred_boxes"][image, chosen])
    if class_loss == "ce":  # a padded cell is certainly "no object"
        assert enc["pred_logits"][1][memory_mask[1]].softmax(-1)[:, -1].min() > 0.999


def test_encoder_proposals_start_as_their_cells():
    model = tiny_detr(query_type="encoder").eval()
    images = torch.randn(1, 3, 64, 64)
    cells = model.encode(images)[3]
    torch.testing.assert_close(model(images)["enc_outputs"]["pred_boxes"], cells, atol=1e-4, rtol=0)


def test_encoder_proposals_are_trained_by_the_set_loss():
    model = tiny_detr(query_type="encoder", class_loss="focal")
    weights = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}
    criterion = SetCriterion(3, HungarianMatcher(2, 5, 2, focal=True), 0.1, weights, 2, focal_alpha=0.25, encoder=True)
    images, mask = half_padded()
    losses = criterion(model(images, mask), targets_of(2, 4))
    assert {"loss_ce_enc", "loss_bbox_enc", "loss_giou_enc"} <= set(losses)
    assert {k: criterion.weight_dict[k] for k in ("loss_ce_enc", "loss_bbox_enc", "loss_giou_enc")} == {
        "loss_ce_enc": 1.0,
        "loss_bbox_enc": 5.0,
        "loss_giou_enc": 2.0,
    }
    trunk = [p for p in model.backbone.parameters() if p.requires_grad]
    grads = torch.autograd.grad(losses["loss_ce_enc"], trunk, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)  # the cells' classes train the trunk


@pytest.mark.parametrize("class_loss", ["ce", "focal"])
def test_encoder_proposals_are_never_matched_to_padding(class_loss):
    """Objects at the right edge of image 1, whose padded cells lie beyond that edge: every cell has the same
    class logits, and the padded cells' proposals (centre x 1) are nearer these objects than the last
    unpadded column's (centre x 0.75), at an equal GIoU; unmasked, the padded cells would take them."""
    focal = class_loss == "focal"
    model = tiny_detr(query_type="encoder", class_loss=class_loss)
    model.proposals.enc_class_embed = HandPlaced(torch.zeros(2, 16, 3 if focal else 4))
    matcher = HungarianMatcher(2, 5, 2, focal=focal)
    images, mask = half_padded()
    edge = torch.tensor([[0.95, 0.125 + 0.25 * row, 0.1, 0.2] for row in range(4)])  # (4, 4) cxcywh
    targets = [
        {"labels": torch.tensor([0, 1]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.2, 0.2]])},
        {"labels": torch.tensor([0, 1, 2, 0]), "boxes": edge},
    ]
    memory_mask = model.encode(images, mask)[1]
    assert memory_mask[1].nonzero()[:, 0].tolist() == PADDED
    with torch.no_grad():
        enc = model(images, mask)["enc_outputs"]
    unmasked = {"pred_logits": torch.zeros_like(enc["pred_logits"]), "pred_boxes": enc["pred_boxes"]}
    assert memory_mask[1, matcher(unmasked, targets)[1][0]].all()  # the construction: padding would win
    matched, _ = matcher(enc, targets)[1]
    assert len(matched) == 4 and not memory_mask[1, matched].any()


def test_more_encoder_queries_than_cells_is_one_line_naming_the_setting():
    model = tiny_detr(query_type="encoder")  # 5 queries, 2 x 2 cells in a 32 x 32 image
    with pytest.raises(ValueError, match=r"^model\.num_queries=5 exceeds the 4 feature cells") as err:
        model(torch.randn(1, 3, 32, 32))
    assert "\n" not in str(err.value)


def test_more_encoder_queries_than_an_images_unpadded_cells_is_one_line_naming_the_setting():
    model = tiny_detr(num_queries=10, query_type="encoder")  # 16 cells a 64 x 64 image; image 1's 8 unpadded
    images, mask = half_padded()
    with pytest.raises(ValueError, match=r"^model\.num_queries=10 exceeds the 8 feature cells of image 1 ") as err:
        model(images, mask)
    assert "\n" not in str(err.value)
    model(images)  # without padding, 16 cells are enough
