"""What the text DataModules' loaders yield: the datasets, a length-bucketing sampler and the collate
functions that pad a batch. Shapes are in each docstring; PAD is the tokenizer's (0 for attnlab's own).

The datasets read token ids from arrays that slice into numpy arrays: a token store's files
(`datamodules.text.token_store.TokenArray`) or arrays in memory; no per-token Python object is kept.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from datamodules.text.tokenizers import PAD_ID


class LengthBucketSampler(Sampler[int]):
    """Shuffled indices in which neighbours have similar lengths, so padded batches waste little.

    Indices are shuffled, cut into pools of ``pool`` batches, each pool sorted by length (stably) and cut
    into batches, and the batches shuffled (fairseq / torchtext bucketing). ``lengths``: one per sample, an
    array (or list) of ints.
    """

    def __init__(self, lengths, batch_size: int, pool: int = 50):
        self.lengths, self.batch_size, self.pool = np.asarray(lengths), batch_size, pool

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(len(self.lengths)).numpy()
        size = self.batch_size * self.pool
        pools = [order[start : start + size] for start in range(0, len(order), size)]
        # a pool holds whole batches (but the last), so the batches are consecutive slices of the sorted pools
        flat = np.concatenate([p[np.argsort(self.lengths[p], kind="stable")] for p in pools]) if pools else order
        n_batches = -(-len(flat) // self.batch_size)
        for b in torch.randperm(n_batches).tolist():
            yield from flat[b * self.batch_size : (b + 1) * self.batch_size].tolist()


def pad(sequences: list, pad_id: int = PAD_ID) -> Tensor:
    """(B, L_max) long tensor, right-padded with ``pad_id`` to the longest sequence."""
    out = torch.full((len(sequences), max(map(len, sequences))), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
    return out


class Sentences:
    """Sentence i of a flat id array: ``ids[offsets[i]:offsets[i + 1]]`` (a token store's files, or arrays)."""

    def __init__(self, ids, offsets):
        self.ids, self.offsets = ids, offsets

    @classmethod
    def of(cls, ids: list[list[int]]) -> Sentences:
        """Sentences held in memory (the inputs of `attnlab predict`)."""
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        return cls(np.fromiter((i for s in ids for i in s), np.int64, int(lengths.sum())), np.r_[0, np.cumsum(lengths)])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        start, stop = self.offsets[i : i + 2]
        return self.ids[int(start) : int(stop)]

    def lengths(self) -> np.ndarray:
        """(N,) tokens of each sentence."""
        return np.diff(np.asarray(self.offsets[:], dtype=np.int64))


class PairDataset(Dataset):
    """Sentence pairs as the model reads them: the source + EOS, and BOS + the target + EOS, cut to ``max_len``
    tokens. The raw text (BLEU's references, samples, predictions) comes along where given: the evaluation splits
    and the inputs to translate, which are small; a training split's text stays on disk. Targets may be absent."""

    def __init__(
        self,
        src: Sentences,
        tgt: Sentences | None,
        max_len: int,
        bos_id: int,
        eos_id: int,
        src_text: list[str] | None = None,
        tgt_text: list[str] | None = None,
    ):
        self.src, self.tgt, self.src_text, self.tgt_text = src, tgt, src_text, tgt_text
        self.rooms = (max_len - 1, max_len - 2)  # tokens of text that fit beside EOS, and BOS + EOS
        self.bos_id, self.eos_id = bos_id, eos_id

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> dict:
        src = np.r_[self.src[i][: self.rooms[0]], self.eos_id]
        item = {"index": i, "src": torch.from_numpy(src.astype(np.int64))}
        if self.src_text is not None:
            item["src_text"] = self.src_text[i]
        if self.tgt is not None:
            tgt = np.r_[self.bos_id, self.tgt[i][: self.rooms[1]], self.eos_id]
            item["tgt"] = torch.from_numpy(tgt.astype(np.int64))
        if self.tgt_text is not None:
            item["tgt_text"] = self.tgt_text[i]
        return item

    def src_lengths(self) -> np.ndarray:
        """(N,) tokens of each source as batched (EOS included, cut to ``max_len``)."""
        return np.minimum(self.src.lengths(), self.rooms[0]) + 1

    def tgt_lengths(self) -> np.ndarray:
        """(N,) tokens of each target as batched (BOS and EOS included, cut to ``max_len``); targets are needed."""
        return np.minimum(self.tgt.lengths(), self.rooms[1]) + 2

    def lengths(self) -> np.ndarray:
        """(N,) tokens of each pair's longer side as batched (BOS and EOS included, cut to ``max_len``)."""
        src = self.src_lengths()
        return src if self.tgt is None else np.maximum(src, self.tgt_lengths())

    def truncated(self) -> list[int]:
        """How many sentences of each side (source, target) are longer than ``max_len`` allows."""
        sides = [self.src] + ([self.tgt] if self.tgt is not None else [])
        return [int((side.lengths() > room).sum()) for side, room in zip(sides, self.rooms)]


def collate_pairs(items: list[dict], pad_id: int = PAD_ID) -> dict:
    """Batch: ``src`` (B, S) and ``tgt`` (B, T) padded with PAD (``tgt`` = BOS ... EOS), ``index`` (B,),
    the raw ``src_text`` / ``tgt_text`` lists where the items have them, and ``tgt_tokens``, the number of target
    tokens to predict (an int counted here, so the training step reads no count back from the device)."""
    batch = {"index": torch.tensor([it["index"] for it in items]), "src": pad([it["src"] for it in items], pad_id)}
    if "tgt" in items[0]:
        batch.update(tgt=pad([it["tgt"] for it in items], pad_id), tgt_tokens=sum(len(it["tgt"]) - 1 for it in items))
    for key in ("src_text", "tgt_text"):
        if key in items[0]:
            batch[key] = [it[key] for it in items]
    return batch


class BlockDataset(Dataset):
    """Contiguous windows of a token stream: item i is (x, y) = (w[:-1], w[1:]) for a window w of
    ``block_size + 1`` tokens starting near ``i * block_size``; with ``random_offset`` the start moves
    by a random amount each time (nanoGPT samples random windows), so every epoch sees new cuts.
    ``data``: the ids, anything whose slices are numpy arrays (a token store's `TokenArray`)."""

    def __init__(self, data, block_size: int, random_offset: bool):
        self.data, self.block_size, self.random_offset = data, block_size, random_offset

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        start = i * self.block_size
        if self.random_offset:
            start = min(start + int(torch.randint(self.block_size, ())), len(self.data) - self.block_size - 1)
        window = torch.from_numpy(np.asarray(self.data[start : start + self.block_size + 1], dtype=np.int64))
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
