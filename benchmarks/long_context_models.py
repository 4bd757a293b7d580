"""A training step of a long-context model in each modality, on the CPU: extra peak memory and time, each in a fresh
process (`benchmarks.harness`), on the chunked path (the default ``attention.memory_budget_mib``) and the full one.

    python -m benchmarks.long_context_models > runs/long_context_models.md

- text: a 4-layer decoder-only LM (D = 256, 8 heads) at context 8,192 with sigmoid attention, batch 1;
- images: a ViT-Ti/16 (D = 192, 3 heads, 12 layers) at 1,024 px (4,096 patches) with clipped softmax, batch 1;
- detection: DETR (ResNet-50 trunk at stride 16, 6 + 6 layers) at 1,333 x 800 px (84 x 50 = 4,200 cells) with 2D
  axial RoPE in its encoder and sigmoid attention, one image with 3 boxes.
One step: forward, loss, backward (no optimiser step), one thread, after a warm-up step on a small input.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import step_peak_mib
from benchmarks.long_context import in_fresh_process
from models.core.attention_config import AttentionConfig

FULL = 1e9  # MiB: the full path


def lm_step(budget: float, small: bool):
    from models.text.lm import DecoderOnlyLM

    length = 256 if small else 8192
    attention = AttentionConfig(normalization="sigmoid", memory_budget_mib=budget)
    model = DecoderOnlyLM(
        256, d_model=256, nhead=8, num_layers=4, max_positions=8192, positions="rope", attention=attention
    )
    tokens = torch.randint(256, (1, length + 1))

    def step():
        logits = model(tokens[:, :-1])  # (1, L, V)
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    return step


def vit_step(budget: float, small: bool):
    from models.vision.vit import VisionTransformer

    size = 64 if small else 1024
    attention = AttentionConfig(normalization="clipped", memory_budget_mib=budget)
    model = VisionTransformer(img_size=1024, embed_dim=192, depth=12, num_heads=3, num_classes=10, attention=attention)
    images = torch.randn(1, 3, size, size)

    def step():
        F.cross_entropy(model(images), torch.tensor([3])).backward()

    return step


def detr_step(budget: float, small: bool):
    from models.detection.criterion import SetCriterion
    from models.detection.detr import build_detr
    from models.detection.matcher import HungarianMatcher

    height, width = (160, 96) if small else (800, 1333)
    attention = AttentionConfig(normalization="sigmoid", memory_budget_mib=budget)
    model = build_detr(backbone_out_index=3, num_classes=4, encoder_positions="rope_axial", attention=attention)
    criterion = SetCriterion(4, HungarianMatcher(1, 5, 2), eos_coef=0.1)
    images, boxes = torch.randn(1, 3, height, width), torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.6, 0.5, 0.3, 0.4]] * 2)
    targets = [{"labels": torch.tensor([0, 1, 2, 3]), "boxes": boxes}]

    def step():
        criterion.total(criterion(model(images), targets)).backward()

    return step


MODELS = {"text: LM, context 8,192, sigmoid": lm_step, "images: ViT-Ti/16, 1,024 px, clipped": vit_step}
MODELS["detection: DETR, 1,333 x 800, RoPE encoder, sigmoid"] = detr_step


def probe(name: str, budget: float) -> dict:
    torch.manual_seed(0)
    MODELS[name](budget, small=True)()
    step = MODELS[name](budget, small=False)
    start = time.process_time()
    peak = step_peak_mib(step, torch.device("cpu"))
    return {"peak_mib": peak, "seconds": time.process_time() - start}


def _cell(result: dict | None) -> str:
    return "-" if result is None else f"{result['peak_mib'] / 1024:.2f} GB / {result['seconds']:.0f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also the full path (GBs: minutes each)")
    parser.add_argument("--probe", nargs=2, metavar=("MODEL", "BUDGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        torch.set_num_threads(1)
        print(json.dumps(probe(args.probe[0], float(args.probe[1]))))
        return
    print("| model | chunked path (default budget) | full path |\n|---|---|---|")
    for name in MODELS:
        chunked = in_fresh_process("benchmarks.long_context_models", name, str(AttentionConfig().memory_budget_mib))
        full = in_fresh_process("benchmarks.long_context_models", name, str(FULL)) if args.full else None
        print(f"| {name} | {_cell(chunked)} | {_cell(full)} |", flush=True)


if __name__ == "__main__":
    main()
