"""`ParallelTextDataModule`: parallel sentences for translation, read once into a token store and trained from it.

The text is read into a token store (`datamodules.text.token_store`: flat files of ids under ``cache_dir``/tokens,
keyed by the source's fingerprint and the tokenizer): no process holds the text or a Python object per token, and
every rank of a run reads the same files (`datamodules.text.base`). Sources (`datamodules.text.sources`): text
files, JSON-lines and Parquet records, Hugging Face datasets (``hf:NAME[:CONFIG]``), the Multi30k layout; the
embedded toy English-German corpus by default.

Words become indices through a tokenizer (`datamodules.text.tokenizers`), trained by streaming over the training
text: ``word`` (one index per word or punctuation mark, as in the seeds) or ``bpe`` (subwords, Sennrich et al.
2016). Batches are made by `datamodules.text.batching`: ``batch_size`` pairs of similar length, or with ``max_tokens``
as many as fit a budget of padded tokens (`datamodules.text.token_budget`, fairseq's ``--max-tokens``).

The tokenizers are written beside the checkpoints (``trainer.default_root_dir``) when fitting and
stored inside every checkpoint; loading a checkpoint whose tokenizer differs from the data's is an
error. ``tokenizer_dir`` loads saved tokenizer files instead of training new ones.

``tokenizer: pretrained`` uses the tokenizer of a pretrained model (a folder written by ``save_pretrained``, or a hub
name resolved when online) as it is, with its own special tokens, read with ``transformers`` (Marian's SentencePiece
models, which need the ``sentencepiece`` package: ``pip install 'attnlab[pretrained-text]'``).
"""

from __future__ import annotations

from functools import cached_property, partial
from pathlib import Path
from typing import Literal

import numpy as np
from pytorch_lightning.utilities import rank_zero_warn
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from datamodules.checks import check_train_batches, read_inputs
from datamodules.text.base import TokenizedDataModule
from datamodules.text.batching import LengthBucketSampler, PairDataset, Sentences, collate_pairs
from datamodules.text.prepare import BATCH, tokenizer_digest, train_pair_tokenizers, write_parts
from datamodules.text.sources import pair_source
from datamodules.text.token_budget import MaxTokensSampler, batches_in_order
from datamodules.text.token_store import check_free_space, open_array, token_dtype
from datamodules.text.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    PretrainedTokenizerSide,
    load_pretrained_seq2seq_tokenizer,
    load_tokenizer,
)
from datamodules.text.toy import write_toy_corpus


class ParallelTextDataModule(TokenizedDataModule):
    """Aligned sentence pairs for translation, the direction src -> tgt.

    Args:
        data_dir: where the splits are: a folder with ``{split}.{src_lang}`` and ``{split}.{tgt_lang}`` (the Multi30k
            layout, e.g. ../shared/data/multi30k), or with ``{split}.jsonl`` / ``{split}.parquet`` records whose
            ``src_field`` and ``tgt_field`` hold the sentences; or ``hf:NAME[:CONFIG]``, a Hugging Face dataset
            (a hub name when online, or a local folder of data files) whose splits the split names name. None: the
            embedded toy English-German corpus, written to ``cache_dir``/toy_en_de on first use.
        cache_dir: where the token store (and the toy corpus) is written: ``cache_dir``/tokens/NAME-HASH.
        src_lang, tgt_lang: the languages (file suffixes of the Multi30k layout).
        src_field, tgt_field: a record's fields with the sentences, dotted for nested ones; None:
            ``translation.{lang}``, the layout of Hugging Face's translation datasets (wmt14, opus).
        train_split, val_split, test_split: the splits' names (file prefixes); None leaves that split out (without
            a training split, e.g. to translate with a trained model, ``tokenizer_dir`` is needed).
        tokenizer: "word" or "bpe" (trained here; vocab_size, min_frequency: see `build_tokenizer`), or
            "pretrained": the tokenizer of the pretrained model in ``tokenizer_dir`` (a Marian folder or hub
            name), with its own special ids (Marian: PAD starts the target), linked to the model as usual.
        shared_vocab: one tokenizer for both languages (needed for shared embeddings).
        tokenizer_train_chars: at most this many characters train a tokenizer here, every k-th batch of the training
            text (SentencePiece's ``input_sentence_size``); None: all. Every sentence is encoded either way.
        tokenizer_dir: load the tokenizer files saved by an earlier fit (its default_root_dir) instead of training;
            with ``tokenizer: pretrained``, the pretrained model's folder.
        token_dtype: the store's id type, "uint16" or "uint32"; None: the smallest that holds the tokenizer's ids.
        max_len: longest sequence in tokens, BOS/EOS included; longer sentences are truncated.
        batch_size: sentences per batch; with ``max_tokens``, the most a batch holds (null: no bound).
        max_tokens: batch by tokens (fairseq's ``--max-tokens``): every batch (training, validation, test, predict)
            holds as many pairs as fit this many padded tokens, its pairs times its longest pair (the longer side,
            BOS/EOS included), per process as ``batch_size`` is; training batches are cut from the pairs sorted by
            length and shuffled each epoch, the others keep their order. None: ``batch_size`` pairs a batch.
        bucket: batch sentences of similar length together.
        predict_file: sentences to translate with `attnlab predict`, one per line ("-": standard input).
    Linked to the model: ``src_vocab_size``, ``tgt_vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``.
    Batches: see `collate_pairs`. The evaluation splits keep their text in memory (BLEU's references).
    """

    task, tokenizer_kinds = "translation", ("word", "bpe", "pretrained")
    # what a tokenizer trained here depends on: train_pair_tokenizers' arguments, in its order, and the store's key
    trained_by = ("tokenizer", "vocab_size", "min_frequency", "shared_vocab", "tokenizer_train_chars")

    def __init__(
        self,
        data_dir: str | None = None,
        cache_dir: str = "runs/data",
        src_lang: str = "en",
        tgt_lang: str = "de",
        src_field: str | None = None,
        tgt_field: str | None = None,
        train_split: str | None = "train",
        val_split: str | None = "val",
        test_split: str | None = "test",
        tokenizer: Literal["word", "bpe", "pretrained"] = "bpe",
        vocab_size: int = 8000,
        min_frequency: int = 2,
        shared_vocab: bool = True,
        tokenizer_train_chars: int | None = 100_000_000,
        tokenizer_dir: str | None = None,
        token_dtype: Literal["uint16", "uint32"] | None = None,
        max_len: int = 128,
        batch_size: int | None = 64,
        max_tokens: int | None = None,
        bucket: bool = True,
        predict_file: str | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ):
        super().__init__()
        for key, value, low in (("max_len", max_len, 3), ("vocab_size", vocab_size, len(SPECIAL_TOKENS) + 1)):
            if value < low:
                raise ValueError(f"data.{key}={value} must be >= {low}")
        check_budget(max_tokens, batch_size, max_len, bucket)
        if src_lang == tgt_lang:
            raise ValueError(f"data.src_lang and data.tgt_lang are both {src_lang!r}; name two languages")
        if train_split is None and tokenizer_dir is None:
            raise ValueError(
                "data.train_split=null needs data.tokenizer_dir: the tokenizer is trained on the training split"
            )
        if data_dir is not None and not data_dir.startswith("hf:") and not Path(data_dir).is_dir():
            raise FileNotFoundError(f"data.data_dir: folder {data_dir} does not exist")
        self.data_dir = data_dir or str(write_toy_corpus(Path(cache_dir) / "toy_en_de"))
        self.max_len = max_len
        self.splits = {
            s: name for s, name in (("train", train_split), ("val", val_split), ("test", test_split)) if name
        }
        fields = (src_field or f"translation.{src_lang}", tgt_field or f"translation.{tgt_lang}")
        self.sources = {
            split: pair_source(self.data_dir, split, name, (src_lang, tgt_lang), fields)
            for split, name in self.splits.items()
        }

    @cached_property
    def _given_tokenizers(self) -> tuple | None:
        """The tokenizers not trained here (loaded or pretrained), or None."""
        hp = self.hparams
        if hp.tokenizer == "pretrained":
            return self._pretrained[:2]
        if hp.tokenizer_dir is None:
            return None
        return self._pair(
            [load_tokenizer(Path(hp.tokenizer_dir) / f"{s}.json", "data.tokenizer_dir") for s in self._stems()]
        )

    @cached_property
    def tokenizers(self) -> tuple[Tokenizer, Tokenizer]:
        """(source tokenizer, target tokenizer): the same object when ``shared_vocab``."""
        if self._given_tokenizers is not None:
            return self._given_tokenizers
        folder = self.store[0]
        return self._pair([load_tokenizer(folder / f"{s}.json", "data.cache_dir") for s in self._stems()])

    def _pair(self, tokenizers: list[Tokenizer]) -> tuple[Tokenizer, Tokenizer]:
        return (tokenizers[0], tokenizers[0]) if self.hparams.shared_vocab else (tokenizers[0], tokenizers[1])

    @cached_property
    def _pretrained(self) -> tuple[PretrainedTokenizerSide, PretrainedTokenizerSide, tuple[int, int, int]]:
        return load_pretrained_seq2seq_tokenizer(self.hparams.tokenizer_dir, "data.tokenizer_dir")

    @property
    def pad_id(self) -> int:
        return self._pretrained[2][0] if self.hparams.tokenizer == "pretrained" else PAD_ID

    @property
    def bos_id(self) -> int:
        return self._pretrained[2][1] if self.hparams.tokenizer == "pretrained" else BOS_ID

    @property
    def eos_id(self) -> int:
        return self._pretrained[2][2] if self.hparams.tokenizer == "pretrained" else EOS_ID

    def _stems(self) -> list[str]:
        hp = self.hparams
        return ["tokenizer"] if hp.shared_vocab else [f"tokenizer.{hp.src_lang}", f"tokenizer.{hp.tgt_lang}"]

    def _tokenizers(self) -> dict[str, Tokenizer]:
        if self.hparams.tokenizer == "pretrained":  # the pretrained folder is the tokenizer: nothing to save
            return {}
        return dict(zip(self._stems(), self.tokenizers))

    @property
    def src_vocab_size(self) -> int:
        return self.tokenizers[0].get_vocab_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tokenizers[1].get_vocab_size()

    def decode_target(self, ids: list[list[int]]) -> list[str]:
        """Detokenized target-language text; special tokens (PAD, BOS, EOS) are dropped."""
        return self.tokenizers[1].decode_batch(ids, skip_special_tokens=True)

    def _store_label(self) -> str:
        hp = self.hparams
        return f"{Path(self.data_dir.removeprefix('hf:')).name}-{hp.src_lang}-{hp.tgt_lang}-{hp.tokenizer}"

    def _store_key(self) -> dict:
        hp = self.hparams
        given = self._given_tokenizers
        tokenizer = [tokenizer_digest(t) for t in given] if given is not None else {k: hp[k] for k in self.trained_by}
        splits = {split: source.fingerprint() for split, source in self.sources.items()}
        return {"pairs": splits, "tokenizer": tokenizer, "token_dtype": hp.token_dtype}

    def _build(self, folder: Path) -> dict:
        hp, given = self.hparams, self._given_tokenizers
        text = sum(source.text_bytes() or 0 for source in self.sources.values())
        itemsize = token_dtype(
            max(t.get_vocab_size() for t in given) if given else hp.vocab_size, hp.token_dtype
        ).itemsize
        # at most one id per byte of text, and an offset per sentence (a sentence per 16 bytes, about)
        check_free_space(folder, text * itemsize + text // 2, str(self.data_dir))
        tokenizers = given or train_pair_tokenizers(self.sources["train"], *(hp[k] for k in self.trained_by))
        if given is None:
            for stem, tokenizer in zip(self._stems(), tokenizers):
                tokenizer.save(str(folder / f"{stem}.json"))
        dtype = token_dtype(max(t.get_vocab_size() for t in tokenizers), hp.token_dtype)
        arrays = {}
        for split, source in self.sources.items():
            names = [f"{split}.src", f"{split}.tgt"]
            batches = source.batches(BATCH)
            arrays |= write_parts(folder, names, dtype, list(tokenizers), batches, True, source.text_bytes(), split)
        return {"dtype": dtype.name, "arrays": arrays}

    def _texts(self, split: str) -> tuple[list[str], list[str]]:
        src, tgt = [], []
        for s, t in self.sources[split].batches(BATCH):
            src += s
            tgt += t
        return src, tgt

    def _dataset(self, split: str) -> PairDataset:
        folder, meta = self.store
        src, tgt = (
            Sentences(
                open_array(folder, meta, f"{split}.{side}.ids"), open_array(folder, meta, f"{split}.{side}.offsets")
            )
            for side in ("src", "tgt")
        )
        texts = self._texts(split) if split != "train" else (None, None)  # a training split's text stays on disk
        dataset = PairDataset(src, tgt, self.max_len, self.bos_id, self.eos_id, *texts)
        self._warn_truncated(dataset, f"{split} sentences ({self.hparams.src_lang}, {self.hparams.tgt_lang})")
        return dataset

    def _warn_truncated(self, dataset: PairDataset, what: str) -> None:
        for count in dataset.truncated():
            if count:
                rank_zero_warn(
                    f"{count} of {len(dataset)} {what} longer than data.max_len={self.max_len} tokens were truncated"
                )

    def _predict_set(self) -> PairDataset:
        if self.hparams.predict_file is None:
            raise ValueError(
                "attnlab predict needs data.predict_file: a file with one sentence per line, or - for standard input"
            )
        lines = read_inputs(self.hparams.predict_file, "data.predict_file", blank_lines=True)
        ids = [e.ids for e in self.tokenizers[0].encode_batch(lines, add_special_tokens=False)]
        dataset = PairDataset(Sentences.of(ids), None, self.max_len, self.bos_id, self.eos_id, lines)
        self._warn_truncated(dataset, "input sentences")
        return dataset

    def _setup_splits(self, stage: str | None) -> None:
        needed = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, tuple(self.splits))
        for split in needed:
            if split not in self.splits:
                raise ValueError(f"data.{split}_split is not set; {stage} needs it")
            if not hasattr(self, f"{split}_set"):
                setattr(self, f"{split}_set", self._dataset(split))

    def _lengths_within_budget(self, dataset: PairDataset, what: str) -> np.ndarray:
        """(N,) ``dataset.lengths()``, refused if a pair does not fit ``data.max_tokens`` alone."""
        lengths, budget = dataset.lengths(), self.hparams.max_tokens
        longest = int(lengths.max(initial=0))
        if longest > budget:
            raise ValueError(
                f"data.max_tokens={budget} is less than the {longest} tokens of the longest {what} (BOS/EOS included, "
                f"as batched); set data.max_tokens >= {longest}, or data.max_len <= {budget} to cut longer sentences"
            )
        return lengths

    def _train_batches(self) -> MaxTokensSampler:
        hp = self.hparams
        lengths = self._lengths_within_budget(self.train_set, "training pair")
        sampler = MaxTokensSampler(lengths, self.train_set.src_lengths(), hp.max_tokens, hp.batch_size)
        capped = float(np.mean(sampler.sizes == hp.batch_size)) if hp.batch_size else 0.0
        if capped > 0.5:  # then the budget rarely decides, which a user of max_tokens does not expect
            rank_zero_warn(
                f"data.batch_size={hp.batch_size} closes {capped:.0%} of the training batches before "
                f"data.max_tokens={hp.max_tokens} fills them; set data.batch_size: null to batch by tokens alone"
            )
        return sampler

    def _eval_loader(self, dataset: PairDataset, split: str) -> DataLoader:
        hp, collate = self.hparams, partial(collate_pairs, pad_id=self.pad_id)
        # sorted by length: less padding, and decoding stops as soon as a batch of similar sentences ends
        order = np.argsort(dataset.src_lengths(), kind="stable") if hp.bucket else np.arange(len(dataset))
        if hp.max_tokens is not None:
            lengths = self._lengths_within_budget(dataset, f"{split} pair")
            batches = batches_in_order(order, lengths, hp.max_tokens, hp.batch_size)
            return self._loader(dataset, collate, sampler=batches, whole_batches=True)
        return self._loader(dataset, collate, sampler=order.tolist() if hp.bucket else None)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        what = f"{self.data_dir}/{self.splits['train']}.*"
        # a token budget makes at least one batch of any training set: only an empty one is refused
        check_train_batches(len(self.train_set), 1 if hp.max_tokens else hp.batch_size, False, what)
        collate = partial(collate_pairs, pad_id=self.pad_id)
        if hp.max_tokens is not None:
            return self._loader(self.train_set, collate, sampler=self._train_batches(), whole_batches=True)
        if hp.bucket:
            return self._loader(
                self.train_set, collate, sampler=LengthBucketSampler(self.train_set.lengths(), hp.batch_size)
            )
        return self._loader(self.train_set, collate, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set, "val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set, "test")

    def predict_dataloader(self) -> DataLoader:
        hp, dataset, collate = self.hparams, self.predict_set, partial(collate_pairs, pad_id=self.pad_id)
        if hp.max_tokens is None:
            return self._loader(dataset, collate)  # input order is output order
        lengths = self._lengths_within_budget(dataset, "input sentence")
        batches = batches_in_order(np.arange(len(dataset)), lengths, hp.max_tokens, hp.batch_size)
        return self._loader(dataset, collate, sampler=batches, whole_batches=True)


def check_budget(max_tokens: int | None, batch_size: int | None, max_len: int, bucket: bool) -> None:
    """Refuse a batch bound that is missing or that contradicts the others, in one line naming the keys."""
    if max_tokens is None:
        if batch_size is None:
            raise ValueError("data.batch_size=null needs data.max_tokens: set one of them to bound a batch")
        return
    if max_tokens < 1:
        raise ValueError(
            f"data.max_tokens={max_tokens} must be >= 1 (padded tokens a batch holds), "
            "or null to batch by data.batch_size"
        )
    if not bucket:
        raise ValueError(
            "data.bucket=false contradicts data.max_tokens, whose training batches are cut from pairs sorted by "
            "length; set data.bucket: true, or data.max_tokens: null"
        )
    if batch_size is not None and batch_size * max_len <= max_tokens:
        raise ValueError(
            f"data.max_tokens={max_tokens} never bounds a batch: data.batch_size={batch_size} pairs of at most "
            f"data.max_len={max_len} tokens hold {batch_size * max_len}; set data.batch_size: null to batch by "
            "tokens alone, or lower data.max_tokens"
        )
