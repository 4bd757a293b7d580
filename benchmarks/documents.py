"""Packed documents (``data.documents: true``): how much a block sees across documents without the mask, and the
loss of a tiny model trained with and without the mask for the same steps, on one corpus (CPU, one thread).

    python -m benchmarks.documents --path ../shared/data/tinyshakespeare/input.txt --block-sizes 64 256 1024
    python -m benchmarks.documents --path ../shared/data/tinyshakespeare/input.txt --block-sizes 256 --steps 100

Share: of the causal pairs (query i, key j <= i) of the training blocks (`BlockDataset`'s cuts at multiples of the
block), those whose key is of another document. Loss: both models are scored on the same validation blocks, plainly
(every target, no mask: what training without documents optimises) and by document (the mask, each document's last
target ignored).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from datamodules.text.batching import BlockDataset
from datamodules.text.corpus import TextCorpusDataModule
from models.text.lm import DecoderOnlyLM


def crossing_share(document_ids: np.ndarray) -> float:
    """The share of causal pairs of blocks (N, T) of ``document_ids`` whose key is of another document (a block's
    documents are runs of one id: n tokens of one hold n(n + 1)/2 pairs within it)."""
    n, t = document_ids.shape
    same = sum(int((c * (c + 1) // 2).sum()) for c in (np.unique(row, return_counts=True)[1] for row in document_ids))
    return 1 - same / (n * t * (t + 1) // 2)


def blocks(dataset, index) -> dict[str, torch.Tensor]:
    """The items ``index`` of ``dataset``, stacked (N, T)."""
    items = [dataset[i] for i in index]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def nll(model: DecoderOnlyLM, batch: dict) -> torch.Tensor:
    """Mean next-token loss of a batch of `BlockDataset` (every target, no mask) or of `DocumentBlockDataset` (the
    mask, each document's last target ignored)."""
    logits = model(batch["input"], document_ids=batch.get("document_ids"), position_ids=batch.get("position_ids"))
    return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten())


def train(dataset, vocab_size: int, steps: int, batch_size: int, seed: int) -> DecoderOnlyLM:
    """A tiny model trained ``steps`` steps of ``batch_size`` random blocks of ``dataset``; the seed fixes the blocks
    (their random offsets too), so both datasets give the same windows."""
    torch.manual_seed(seed)
    model = DecoderOnlyLM(vocab_size, 64, 4, 2, dropout=0.0, max_positions=dataset.block_size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = torch.randint(len(dataset), (steps, batch_size), generator=torch.Generator().manual_seed(seed))
    for step in range(steps):
        batch = blocks(dataset, order[step].tolist())
        loss = nll(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True)
    parser.add_argument("--cache-dir", default="runs/data")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=0, help="train for the loss comparison (0: the share only)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--val-blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()}")
    print("| block | documents in the corpus | blocks | mean documents a block | cross-document causal pairs |")
    print("|---|---|---|---|---|")
    for size in args.block_sizes:
        dm = TextCorpusDataModule(args.path, cache_dir=args.cache_dir, block_size=size, documents=True)
        dm.setup("fit")
        dm.train_set.random_offset = False  # BlockDataset's fixed cuts: every training token once
        ids = blocks(dm.train_set, range(len(dm.train_set)))["document_ids"].numpy()
        docs = len(dm.train_set.starts)
        print(f"| {size} | {docs} | {len(ids)} | {(ids[:, -1] + 1).mean():.2f} | {crossing_share(ids):.1%} |")
    if not args.steps:
        return
    index = range(min(args.val_blocks, len(dm.val_set)))
    val = [blocks(BlockDataset(dm.val_set.data, size, False), index), blocks(dm.val_set, index)]  # the same windows
    print(f"\n{args.steps} steps of {args.batch_size} x {size} tokens; val loss on {len(index)} blocks")
    print("| trained | val loss, plain | val loss, by document | seconds |\n|---|---|---|---|")
    dm.train_set.random_offset = True
    for name, dataset in (("without the mask", BlockDataset(dm.train_set.data, size, True)), ("with", dm.train_set)):
        start = time.perf_counter()
        model = train(dataset, dm.vocab_size, args.steps, args.batch_size, args.seed)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            plain, by_doc = (nll(model, batch).item() for batch in val)
        print(f"| {name} | {plain:.4f} | {by_doc:.4f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
