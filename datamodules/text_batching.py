"""What the text DataModules' loaders yield: the datasets, a length-bucketing sampler and the collate
functions that pad a batch. Shapes are in each docstring; PAD is the tokenizer's (0 for attnlab's own).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from datamodules.text_tokenizers import PAD_ID


class LengthBucketSampler(Sampler[int]):
    """Shuffled indices in which neighbours have similar lengths, so padded batches waste little.

    Indices are shuffled, cut into pools of ``pool`` batches, each pool sorted by length and cut
    into batches, and the batches shuffled (fairseq / torchtext bucketing).
    """

    def __init__(self, lengths: list[int], batch_size: int, pool: int = 50):
        self.lengths, self.batch_size, self.pool = lengths, batch_size, pool

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.lengths)).tolist()
        size = self.batch_size * self.pool
        batches = []
        for start in range(0, len(order), size):
            pool = sorted(order[start : start + size], key=self.lengths.__getitem__)
            batches += [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        for b in torch.randperm(len(batches)).tolist():
            yield from batches[b]


def pad(sequences: list[list[int]], pad_id: int = PAD_ID) -> Tensor:
    """(B, L_max) long tensor, right-padded with ``pad_id`` to the longest sequence."""
    out = torch.full((len(sequences), max(map(len, sequences))), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


class ParallelDataset(Dataset):
    """Encoded pairs with their raw text (the references for BLEU). Targets may be absent (predict)."""

    def __init__(
        self,
        src_ids: list[list[int]],
        src_text: list[str],
        tgt_ids: list[list[int]] | None = None,
        tgt_text: list[str] | None = None,
    ):
        self.src_ids, self.src_text, self.tgt_ids, self.tgt_text = src_ids, src_text, tgt_ids, tgt_text

    def __len__(self) -> int:
        return len(self.src_ids)

    def __getitem__(self, i: int) -> dict:
        item = {"index": i, "src": self.src_ids[i], "src_text": self.src_text[i]}
        if self.tgt_ids is not None:
            item.update(tgt=self.tgt_ids[i], tgt_text=self.tgt_text[i])
        return item


def collate_pairs(items: list[dict], pad_id: int = PAD_ID) -> dict:
    """Batch: ``src`` (B, S) and ``tgt`` (B, T) padded with PAD (``tgt`` = BOS ... EOS), ``index`` (B,),
    the raw ``src_text`` / ``tgt_text`` lists, and ``tgt_tokens``, the number of target tokens to predict
    (an int counted here, so the training step reads no count back from the device)."""
    batch = {
        "index": torch.tensor([it["index"] for it in items]),
        "src": pad([it["src"] for it in items], pad_id),
        "src_text": [it["src_text"] for it in items],
    }
    if "tgt" in items[0]:
        batch.update(
            tgt=pad([it["tgt"] for it in items], pad_id),
            tgt_text=[it["tgt_text"] for it in items],
            tgt_tokens=sum(len(it["tgt"]) - 1 for it in items),
        )
    return batch


class BlockDataset(Dataset):
    """Contiguous windows of a token stream: item i is (x, y) = (w[:-1], w[1:]) for a window w of
    ``block_size + 1`` tokens starting near ``i * block_size``; with ``random_offset`` the start moves
    by a random amount each time (nanoGPT samples random windows), so every epoch sees new cuts."""

    def __init__(self, data: Tensor, block_size: int, random_offset: bool):
        self.data, self.block_size, self.random_offset = data, block_size, random_offset

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        start = i * self.block_size
        if self.random_offset:
            start = min(start + int(torch.randint(self.block_size, ())), len(self.data) - self.block_size - 1)
        window = self.data[start : start + self.block_size + 1]
        return {"input": window[:-1], "target": window[1:]}  # (T,), (T,)


def collate_prompts(items: list[dict]) -> dict:
    """Prompts of different lengths are generated one by one, so a batch holds one prompt."""
    return {"prompt": torch.tensor(items[0]["ids"]).unsqueeze(0), "prompt_text": [items[0]["text"]]}  # (1, T0)


class PromptDataset(Dataset):
    """Prompts for `attnlab predict`, each with its token ids."""

    def __init__(self, texts: list[str], tokenizer: Tokenizer):
        self.texts, self.tokenizer = texts, tokenizer

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        return {"ids": self.tokenizer.encode(self.texts[i], add_special_tokens=False).ids, "text": self.texts[i]}
