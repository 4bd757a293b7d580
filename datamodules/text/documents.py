"""Packed documents for language modelling (``data.documents: true``; Llama 3's document masking, HF's padding-free
collator): the corpus is read as documents, the store keeps where each one starts, and every block carries each
token's document and its place in it, so that attention, positions and the loss stay inside a document.

A document is a record (a jsonl or parquet row, a Hugging Face example), or in a text file the lines up to the next
paragraph: a non-blank line after a blank one starts a document, and so does each file's first line. A document's
text is its lines, blank ones included, each with its line end, so the documents joined are the corpus's text. Each
document is encoded as one piece: its ids go to ``corpus.ids``, its end to ``corpus.offsets``
(`datamodules.text.token_store`).

Blocks are the contiguous windows of `BlockDataset`, several documents in one. A document longer than the block, or
cut by the block's start, is split: its part in a block is a document of its own there (positions from 0), and no
token sees the part in another block.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from datamodules.text.batching import BlockDataset
from datamodules.text.prepare import BATCH
from datamodules.text.sources import TextFiles

IGNORE_INDEX = -100  # the target no loss reads: F.cross_entropy's default ignore_index


def _paragraphs(source: TextFiles) -> Iterator[str]:
    """The documents of text files: each file's paragraphs, each with the blank lines after it."""
    for path in source.paths:
        lines: list[str] = []
        for (batch,) in TextFiles([path], str(path), source.key).batches(BATCH):
            for line in batch:
                if lines and line.strip() and not lines[-1].strip():
                    yield "".join(lines)
                    lines = []
                lines.append(line + "\n")
        if lines:
            yield "".join(lines)


def document_batches(source, path: str) -> Iterator[list[str]]:
    """The documents of ``source`` (`datamodules.text.sources`) in batches of at most `BATCH`: a record's text with
    its line end, or a paragraph of a text file. One document in all is refused: nothing to keep apart."""
    texts = (
        _paragraphs(source)
        if isinstance(source, TextFiles)
        else (text + "\n" for (batch,) in source.batches(BATCH) for text in batch)
    )
    batch, count = [], 0
    for text in texts:
        batch.append(text)
        count += 1
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch
    if count == 1:
        raise ValueError(
            f"data.documents=true: {path} is one document (a text file's documents are its paragraphs, separated by "
            "blank lines; a jsonl or parquet file's, its records); set data.documents=false"
        )


class DocumentBlockDataset(BlockDataset):
    """`BlockDataset`'s windows of a stream of packed documents. ``starts``: the first token of every document,
    relative to the stream ``data`` (those before it are negative); held in memory, 8 bytes a document.

    Item: ``input`` and ``target`` (T,) as `BlockDataset`'s, the target of each document's last token (the next
    document's first) `IGNORE_INDEX`; ``document_ids`` (T,) from 0, one per document in the block; ``position_ids``
    (T,), each token's place in its document's part in the block."""

    def __init__(self, data, starts: np.ndarray, block_size: int, random_offset: bool):
        super().__init__(data, block_size, random_offset)
        self.starts = np.asarray(starts, dtype=np.int64)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        start = i * self.block_size
        if self.random_offset:  # as BlockDataset draws it
            start = min(start + int(torch.randint(self.block_size, ())), len(self.data) - self.block_size - 1)
        window = np.asarray(self.data[start : start + self.block_size + 1], dtype=np.int64)  # (T + 1,)
        index = np.arange(start, start + self.block_size + 1)
        document = np.searchsorted(self.starts, index, side="right") - 1  # (T + 1,) each token's document
        target = np.where(document[1:] == document[:-1], window[1:], IGNORE_INDEX)
        ids = document[:-1] - document[0]  # (T,)
        first = np.maximum(self.starts[document[:-1]], start)  # the first token of each one's part in the block
        return {
            "input": torch.from_numpy(window[:-1]),
            "target": torch.from_numpy(target),
            "document_ids": torch.from_numpy(ids),
            "position_ids": torch.from_numpy(index[:-1] - first),
        }
