"""Two real processes (gloo, CPU, torch.multiprocessing): the set loss's all-reduced box
normalisation, and the gathering of detections for COCO evaluation (`models.distributed.gather_objects`).

Kept apart from test_detr.py so that the spawned processes import only what they need.
"""

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.detection.criterion import SetCriterion
from models.detection.matcher import HungarianMatcher

pytestmark = pytest.mark.slow  # spawns two processes with a process group


def problem():
    """Two images with 1 and 4 target boxes, and the predictions of 6 queries each."""
    g = torch.Generator().manual_seed(9)

    def boxes(n: int) -> torch.Tensor:
        return torch.cat([torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.3 + 0.05], 1)

    outputs = {"pred_logits": torch.randn(2, 6, 4, generator=g), "pred_boxes": torch.stack([boxes(6), boxes(6)])}
    targets = [{"labels": torch.randint(0, 3, (n,), generator=g), "boxes": boxes(n)} for n in (1, 4)]
    return outputs, targets


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        outputs, targets = problem()
        mine = {k: v[rank : rank + 1] for k, v in outputs.items()}  # one image per process
        losses = SetCriterion(3, HungarianMatcher(1, 5, 2))(mine, [targets[rank]])
        from models.distributed import gather_objects

        # a DistributedSampler over 3 images gives rank 0 images 1, 3 and rank 1 images 2, 1 (repeated to even out)
        mine_ids = [1, 3] if rank == 0 else [2, 1]
        parts = gather_objects({i: {"scores": torch.tensor([float(i)])} for i in mine_ids})
        assert [sorted(p) for p in parts] == [[1, 3], [1, 2]]  # in rank order
        gathered = {i: d for part in parts for i, d in part.items()}  # as the detector merges them
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(
                {
                    **{k: float(losses[k]) for k in ("loss_bbox", "loss_giou")},
                    "gathered": {str(i): float(d["scores"]) for i, d in sorted(gathered.items())},
                },
                f,
            )
    finally:
        dist.destroy_process_group()


def test_all_reduced_normalisation_trains_two_processes_like_one(tmp_path):
    outputs, targets = problem()
    whole = SetCriterion(3, HungarianMatcher(1, 5, 2))(outputs, targets)
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # DDP averages the processes' gradients, i.e. trains on the mean of their losses
    for key in ("loss_bbox", "loss_giou"):
        assert (ranks[0][key] + ranks[1][key]) / 2 == pytest.approx(float(whole[key]), rel=1e-5)
    assert (
        ranks[0]["gathered"] == ranks[1]["gathered"] == {"1": 1.0, "2": 2.0, "3": 3.0}
    )  # every image once, on every rank
    # each process dividing by its own 1 and 4 boxes instead would train differently
    local = [
        SetCriterion(3, HungarianMatcher(1, 5, 2))({k: v[r : r + 1] for k, v in outputs.items()}, [targets[r]])
        for r in range(2)
    ]
    assert (float(local[0]["loss_bbox"]) + float(local[1]["loss_bbox"])) / 2 != pytest.approx(
        float(whole["loss_bbox"]), rel=1e-3
    )
