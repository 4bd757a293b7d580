"""Token-budget batches (fairseq's ``--max-tokens``): as many sentence pairs of similar length as fit a budget of
padded tokens, so that every step sees about as many tokens, whatever the length of its sentences.

A batch's size in tokens is its number of pairs times its longest pair, a pair's length being its longer side as
`datamodules.text.batching.collate_pairs` pads it (BOS/EOS included): fairseq's ``data_utils.batch_by_size``, a
greedy cut of pairs in a given order (sorted by length for training) that never exceeds the budget.

A loader reads these batches without automatic batching (``batch_size=None``): its ``sampler`` yields lists of
indices and `WholeBatches` turns each into the list of items `collate_pairs` pads. The sampler stays the loader's
``sampler``, so `experiments.callbacks.interrupts.ResumableSampler` (and Lightning's DDP wrapper without it) shards
and resumes the list of batches as it does the samples of a batch-size loader.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


def batch_by_size(lengths: np.ndarray, max_tokens: int, max_sentences: int | None = None) -> np.ndarray:
    """The greedy cut of a sequence of pairs into batches of at most ``max_tokens`` padded tokens (pairs × the
    longest) and at most ``max_sentences`` pairs (None: no bound), in that order.

    ``lengths`` (N,): each pair's length in the batching order. Returns (K + 1,) boundaries: batch k holds
    positions ``bounds[k]:bounds[k + 1]``. A batch takes the next pair while it fits, as fairseq's does."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cap, bounds, start = max_sentences or len(lengths), [0], 0
    while start < len(lengths):
        # (pairs × longest so far) only grows along the batch, so the pairs that fit are a prefix; its first
        # pair's length bounds how many can
        room = min(cap, max_tokens // int(lengths[start]), len(lengths) - start)
        if room == 0:
            raise ValueError(f"max_tokens={max_tokens}: a pair of {lengths[start]} tokens does not fit in a batch")
        longest = np.maximum.accumulate(lengths[start : start + room])  # (room,)
        start += int(np.count_nonzero(np.arange(1, room + 1) * longest <= max_tokens))
        bounds.append(start)
    return np.asarray(bounds, dtype=np.int64)


def batches_in_order(order, lengths: np.ndarray, max_tokens: int, max_sentences: int | None = None) -> list[list[int]]:
    """`batch_by_size` of the pairs ``order`` (indices into ``lengths``, (N,)), as lists of indices: the evaluation
    and prediction batches, which keep their order."""
    order = np.asarray(order, dtype=np.int64)
    bounds = batch_by_size(np.asarray(lengths)[order], max_tokens, max_sentences)
    return [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]


class MaxTokensSampler(Sampler[list[int]]):
    """Training batches under a token budget, in a new order each pass: the pairs sorted by length (the longer
    side, then the source) with ties in random order, cut by `batch_by_size`, and the batches shuffled (fairseq
    shuffles its batches each epoch; it breaks ties once, this every epoch).

    The cut depends on the sorted lengths alone, so every pass has the same number of batches of the same sizes
    (``sizes``): a DDP run can share the list of batches out. Random draws come from torch's RNG, which
    `ResumableSampler` seeds with (seed, epoch), like `LengthBucketSampler`'s.

    Args:
        lengths: (N,) each pair's length as batched (`PairDataset.lengths`).
        src_lengths: (N,) each source's length as batched (`PairDataset.src_lengths`).
        max_tokens: padded tokens a batch holds at most.
        max_sentences: pairs a batch holds at most (None: no bound).
    """

    def __init__(self, lengths, src_lengths, max_tokens: int, max_sentences: int | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.src_lengths = np.asarray(src_lengths, dtype=np.int64)
        self.bounds = batch_by_size(np.sort(self.lengths), max_tokens, max_sentences)  # (K + 1,)
        self.sizes = np.diff(self.bounds)  # (K,) pairs of each batch, in sorted order

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self) -> Iterator[list[int]]:
        ties = torch.randperm(len(self.lengths)).numpy()
        # lexsort is stable and its last key is the first: by length, then source length, then the random order;
        # lengths[order] is sorted(lengths), so the precomputed bounds cut it
        order = ties[np.lexsort((self.src_lengths[ties], self.lengths[ties]))]
        for k in torch.randperm(len(self.sizes)).tolist():
            yield order[self.bounds[k] : self.bounds[k + 1]].tolist()


class WholeBatches(Dataset):
    """``dataset``'s items of a list of indices: what a DataLoader without automatic batching (``batch_size=None``)
    reads for each batch its sampler yields, as a list for the collate function."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> list:
        return [self.dataset[i] for i in indices]
