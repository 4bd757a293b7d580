"""Text DataModules: parallel sentences for translation and a plain corpus for language modelling.

Words become indices through a tokenizer (`datamodules.text_tokenizers`), trained on the training
split only: ``word`` (one index per word or punctuation mark, as in the seeds), ``bpe`` (subwords,
Sennrich et al. 2016) or ``char`` (one index per character, for the LM). Batches are made by
`datamodules.text_batching`.

`ParallelTextDataModule` reads aligned files ``{split}.{lang}`` (the Multi30k layout); without a
``data_dir`` it uses the embedded toy English-German corpus (`datamodules.toy_text`), generated
into ``cache_dir`` on first use. `TextCorpusDataModule` cuts one text file into contiguous blocks
and splits it by position (train first, validation last).

The tokenizers are written beside the checkpoints (``trainer.default_root_dir``) when fitting and
stored inside every checkpoint; loading a checkpoint whose tokenizer differs from the data's is an
error. ``tokenizer_dir`` loads saved tokenizer files instead of training new ones.

``tokenizer: pretrained`` uses the tokenizer of a pretrained model (a folder written by
``save_pretrained``, or a hub name resolved when online) as it is, with its own special tokens: the
language model reads the folder's ``tokenizer.json`` with the ``tokenizers`` library (GPT-2's
byte-level BPE); translation reads the folder with ``transformers`` (Marian's SentencePiece models,
which need the ``sentencepiece`` package: ``pip install 'attnlab[pretrained-text]'``).
"""

from __future__ import annotations

from functools import cached_property, partial
from pathlib import Path
from typing import Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset

from datamodules.checks import check_train_batches, read_inputs, read_lines, read_parallel
from datamodules.loading import loader_settings
from datamodules.text_batching import (
    BlockDataset,
    LengthBucketSampler,
    ParallelDataset,
    PromptDataset,
    collate_pairs,
    collate_prompts,
)
from datamodules.text_tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    PretrainedTokenizerSide,
    build_tokenizer,
    encode,
    load_pretrained_seq2seq_tokenizer,
    load_pretrained_tokenizer,
    load_tokenizer,
)
from datamodules.toy_text import write_toy_corpus


class _TokenizedDataModule(pl.LightningDataModule):
    """What both DataModules share: the checks of their common arguments, the stages of ``setup``, tokenizer
    bookkeeping (saving beside the run, checkpoint round trip) and the loaders.

    Subclasses implement `_tokenizers`, `_predict_set` (the inputs of `attnlab predict`) and
    `_setup_splits` (the datasets another stage needs).
    """

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

    task: str  # for messages: "translation", "language modelling"
    tokenizer_kinds: tuple[str, ...]  # the values of data.tokenizer
    pretrained_hint: str = ""  # what the folder of data.tokenizer=pretrained holds, for messages

    def __init__(self):
        """Saves the subclass's arguments as ``hparams`` and refuses bad values of those both take."""
        super().__init__()
        self.save_hyperparameters()  # Lightning collects the arguments of the subclass's __init__ too
        hp = self.hparams
        # refuses a bad num_workers now, not at the first batch
        loader_settings(hp.num_workers, hp.pin_memory, hp.persistent_workers)
        if hp.tokenizer not in self.tokenizer_kinds:
            raise ValueError(
                f"data.tokenizer={hp.tokenizer!r} is not known for {self.task}; choose {', '.join(self.tokenizer_kinds[:-1])} or {self.tokenizer_kinds[-1]}"
            )
        if hp.tokenizer == "pretrained" and hp.tokenizer_dir is None:
            raise ValueError(
                f"data.tokenizer=pretrained needs data.tokenizer_dir: the pretrained model's folder (or hub name){self.pretrained_hint}"
            )
        if hp.batch_size < 1:
            raise ValueError(f"data.batch_size={hp.batch_size} must be >= 1")
        if hp.predict_file not in (None, "-") and not Path(hp.predict_file).is_file():
            raise FileNotFoundError(f"data.predict_file: file {hp.predict_file} does not exist")

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit":
            self._save_tokenizers()
        if stage == "predict":
            self.predict_set = self._predict_set()
        else:
            self._setup_splits(stage)

    def _predict_set(self) -> Dataset:
        raise NotImplementedError

    def _setup_splits(self, stage: str | None) -> None:
        raise NotImplementedError

    def _tokenizers(self) -> dict[str, Tokenizer]:
        """File stem -> tokenizer, e.g. {"tokenizer": ...} or {"tokenizer.en": ..., "tokenizer.de": ...}."""
        raise NotImplementedError

    def _save_tokenizers(self) -> None:
        if self.trainer is None or self.trainer.global_rank != 0:
            return
        root = Path(self.trainer.default_root_dir)
        root.mkdir(parents=True, exist_ok=True)
        for stem, tokenizer in self._tokenizers().items():
            tokenizer.save(str(root / f"{stem}.json"))

    def state_dict(self) -> dict:
        return {"tokenizers": {stem: t.to_str() for stem, t in self._tokenizers().items()}}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("tokenizers", {})
        for stem, tokenizer in self._tokenizers().items():
            if stem in saved and saved[stem] != tokenizer.to_str():
                theirs = Tokenizer.from_str(saved[stem]).get_vocab_size()
                raise ValueError(
                    f"the checkpoint's {stem} ({theirs} tokens) is not the one this data built ({tokenizer.get_vocab_size()} tokens): "
                    "use the same tokenizer settings and training data as the run that made the checkpoint, or set "
                    f"data.tokenizer_dir to that run's folder (it holds {stem}.json)"
                )

    def _loader(self, dataset: Dataset, collate, sampler=None, shuffle: bool = False) -> DataLoader:
        hp = self.hparams
        return DataLoader(
            dataset,
            batch_size=hp.batch_size,
            sampler=sampler,
            shuffle=shuffle,
            collate_fn=collate,
            **loader_settings(hp.num_workers, hp.pin_memory, hp.persistent_workers),
        )


class ParallelTextDataModule(_TokenizedDataModule):
    """Aligned sentence pairs ``{split}.{src_lang}`` / ``{split}.{tgt_lang}`` for translation.

    Args:
        data_dir: folder with the split files (e.g. ../shared/data/multi30k); None: the embedded toy
            English-German corpus, written to ``cache_dir``/toy_en_de on first use.
        src_lang, tgt_lang: file suffixes; the direction of translation is src -> tgt.
        train_split, val_split, test_split: file prefixes; None leaves that split out (without a
            training split, e.g. to translate with a trained model, ``tokenizer_dir`` is needed).
        tokenizer: "word" or "bpe" (trained here; vocab_size, min_frequency: see `build_tokenizer`), or
            "pretrained": the tokenizer of the pretrained model in ``tokenizer_dir`` (a Marian folder or hub
            name), with its own special ids (Marian: PAD starts the target), linked to the model as usual.
        shared_vocab: one tokenizer for both languages (needed for shared embeddings).
        tokenizer_dir: load the tokenizer files saved by an earlier fit (its default_root_dir) instead of training;
            with ``tokenizer: pretrained``, the pretrained model's folder.
        max_len: longest sequence in tokens, BOS/EOS included; longer sentences are truncated.
        batch_size: sentences per batch. bucket: batch sentences of similar length together.
        predict_file: sentences to translate with `attnlab predict`, one per line ("-": standard input).
    Linked to the model: ``src_vocab_size``, ``tgt_vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``.
    Batches: see `collate_pairs`.
    """

    task, tokenizer_kinds = "translation", ("word", "bpe", "pretrained")

    def __init__(
        self,
        data_dir: str | None = None,
        cache_dir: str = "runs/data",
        src_lang: str = "en",
        tgt_lang: str = "de",
        train_split: str | None = "train",
        val_split: str | None = "val",
        test_split: str | None = "test",
        tokenizer: Literal["word", "bpe", "pretrained"] = "bpe",
        vocab_size: int = 8000,
        min_frequency: int = 2,
        shared_vocab: bool = True,
        tokenizer_dir: str | None = None,
        max_len: int = 128,
        batch_size: int = 64,
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
        if src_lang == tgt_lang:
            raise ValueError(f"data.src_lang and data.tgt_lang are both {src_lang!r}; name two languages")
        if train_split is None and tokenizer_dir is None:
            raise ValueError(
                "data.train_split=null needs data.tokenizer_dir: the tokenizer is trained on the training split"
            )
        if data_dir is not None and not Path(data_dir).is_dir():
            raise FileNotFoundError(f"data.data_dir: folder {data_dir} does not exist")
        self.data_dir = Path(data_dir) if data_dir is not None else write_toy_corpus(Path(cache_dir) / "toy_en_de")
        self.max_len = max_len
        self.splits = {
            s: name for s, name in (("train", train_split), ("val", val_split), ("test", test_split)) if name
        }
        for split, name in self.splits.items():
            for lang in (src_lang, tgt_lang):
                path = self.data_dir / f"{name}.{lang}"
                if not path.is_file():
                    raise FileNotFoundError(
                        f"data.{split}_split: file {path} does not exist (expected {name}.{src_lang} and {name}.{tgt_lang} in {self.data_dir})"
                    )

    @cached_property
    def corpus(self) -> dict[str, tuple[list[str], list[str]]]:
        """split -> (source sentences, target sentences), read and checked once."""
        hp = self.hparams
        return {
            split: read_parallel(
                self.data_dir / f"{name}.{hp.src_lang}", self.data_dir / f"{name}.{hp.tgt_lang}", f"data.{split}_split"
            )
            for split, name in self.splits.items()
        }

    @cached_property
    def tokenizers(self) -> tuple[Tokenizer, Tokenizer]:
        """(source tokenizer, target tokenizer): the same object when ``shared_vocab``."""
        hp = self.hparams
        if hp.tokenizer == "pretrained":
            return self._pretrained[:2]
        stems = self._stems()
        if hp.tokenizer_dir is not None:
            loaded = [load_tokenizer(Path(hp.tokenizer_dir) / f"{s}.json", "data.tokenizer_dir") for s in stems]
            return (loaded[0], loaded[0]) if hp.shared_vocab else (loaded[0], loaded[1])
        self.corpus  # noqa: B018  # read and check every split before spending time on training
        src, tgt = self.corpus["train"]
        if hp.shared_vocab:
            shared = build_tokenizer(hp.tokenizer, src + tgt, hp.vocab_size, hp.min_frequency)
            return shared, shared
        return (
            build_tokenizer(hp.tokenizer, src, hp.vocab_size, hp.min_frequency),
            build_tokenizer(hp.tokenizer, tgt, hp.vocab_size, hp.min_frequency),
        )

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

    def _dataset(self, split: str) -> ParallelDataset:
        src, tgt = self.corpus[split]
        src_tok, tgt_tok = self.tokenizers
        what = f"{split} sentences ({self.hparams.src_lang}, {self.hparams.tgt_lang})"
        ids = {"bos_id": self.bos_id, "eos_id": self.eos_id}
        return ParallelDataset(
            encode(src_tok, src, self.max_len, False, what, **ids),
            src,
            encode(tgt_tok, tgt, self.max_len, True, what, **ids),
            tgt,
        )

    def _predict_set(self) -> ParallelDataset:
        if self.hparams.predict_file is None:
            raise ValueError(
                "attnlab predict needs data.predict_file: a file with one sentence per line, or - for standard input"
            )
        lines = read_inputs(self.hparams.predict_file, "data.predict_file", blank_lines=True)
        return ParallelDataset(
            encode(self.tokenizers[0], lines, self.max_len, False, "input sentences", eos_id=self.eos_id), lines
        )

    def _setup_splits(self, stage: str | None) -> None:
        needed = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, tuple(self.splits))
        for split in needed:
            if split not in self.splits:
                raise ValueError(f"data.{split}_split is not set; {stage} needs it")
            if not hasattr(self, f"{split}_set"):
                setattr(self, f"{split}_set", self._dataset(split))

    def _eval_loader(self, dataset: ParallelDataset) -> DataLoader:
        # sorted by length: less padding, and decoding stops as soon as a batch of similar sentences ends
        order = sorted(range(len(dataset)), key=lambda i: len(dataset.src_ids[i])) if self.hparams.bucket else None
        return self._loader(dataset, partial(collate_pairs, pad_id=self.pad_id), sampler=order)

    def train_dataloader(self) -> DataLoader:
        check_train_batches(
            len(self.train_set), self.hparams.batch_size, False, f"{self.data_dir}/{self.splits['train']}.*"
        )
        if self.hparams.bucket:
            lengths = [max(len(s), len(t)) for s, t in zip(self.train_set.src_ids, self.train_set.tgt_ids)]
            return self._loader(
                self.train_set,
                partial(collate_pairs, pad_id=self.pad_id),
                sampler=LengthBucketSampler(lengths, self.hparams.batch_size),
            )
        return self._loader(self.train_set, partial(collate_pairs, pad_id=self.pad_id), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader(self.val_set)

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader(self.test_set)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set, partial(collate_pairs, pad_id=self.pad_id))  # input order is output order


class TextCorpusDataModule(_TokenizedDataModule):
    """One text file for language modelling, cut into contiguous blocks, split by position.

    Args:
        path: the text file (e.g. ../shared/data/tinyshakespeare/input.txt); None: the English side of
            the embedded toy corpus (``cache_dir``/toy_en_de/train.en).
        tokenizer: "char" (one token per character) or "bpe" (trained here; bpe_vocab_size, min_frequency:
            BPE only), or "pretrained": the ``tokenizer.json`` of the pretrained model in ``tokenizer_dir``
            (e.g. GPT-2's byte-level BPE), used as it is.
        tokenizer_dir: load ``tokenizer.json`` saved by an earlier fit instead of training; with
            ``tokenizer: pretrained``, the pretrained model's folder (or hub name).
        block_size: tokens of context per sample. val_fraction: the last part of the text, held out.
        val_block_size: tokens per validation (and test) window; None: ``block_size``. Longer windows let
            ``model.eval_context`` score the model beyond its training context (`models.text_module`).
        prompt, predict_file: what `attnlab predict` completes (one prompt, or a file with one per line).
    Linked to the model: ``vocab_size`` (the trained vocabulary's size). The corpus has no test
    split: `attnlab test` evaluates the validation part.
    Batches: ``input`` (B, block_size) and ``target`` (B, block_size), the input shifted by one.
    """

    task, tokenizer_kinds = "language modelling", ("char", "bpe", "pretrained")
    pretrained_hint = " with its tokenizer.json"

    def __init__(
        self,
        path: str | None = None,
        cache_dir: str = "runs/data",
        tokenizer: Literal["char", "bpe", "pretrained"] = "char",
        bpe_vocab_size: int = 1000,
        min_frequency: int = 2,
        tokenizer_dir: str | None = None,
        block_size: int = 256,
        val_block_size: int | None = None,
        val_fraction: float = 0.1,
        batch_size: int = 64,
        prompt: str | None = None,
        predict_file: str | None = None,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ):
        super().__init__()
        if block_size < 1:
            raise ValueError(f"data.block_size={block_size} must be >= 1")
        if val_block_size is not None and val_block_size < 1:
            raise ValueError(f"data.val_block_size={val_block_size} must be >= 1")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        if prompt is not None and not prompt:
            raise ValueError("data.prompt is empty; give at least one character to continue, or leave it unset")
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"data.path: file {path} does not exist")
        self.path = Path(path) if path is not None else write_toy_corpus(Path(cache_dir) / "toy_en_de") / "train.en"

    @cached_property
    def text(self) -> str:
        lines = read_lines(self.path, "data.path")
        if not any(line.strip() for line in lines):
            raise ValueError(f"data.path: {self.path} holds no text")
        return "\n".join(lines) + "\n"

    @cached_property
    def tokenizer(self) -> Tokenizer:
        hp = self.hparams
        if hp.tokenizer == "pretrained":
            return load_pretrained_tokenizer(hp.tokenizer_dir, "data.tokenizer_dir")
        if hp.tokenizer_dir is not None:
            return load_tokenizer(Path(hp.tokenizer_dir) / "tokenizer.json", "data.tokenizer_dir")
        train_text = self.text[: int(len(self.text) * (1 - hp.val_fraction))]
        return build_tokenizer(hp.tokenizer, train_text.splitlines(keepends=True), hp.bpe_vocab_size, hp.min_frequency)

    def _tokenizers(self) -> dict[str, Tokenizer]:
        return {"tokenizer": self.tokenizer}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.decode_batch(ids, skip_special_tokens=True)

    def _predict_set(self) -> PromptDataset:
        hp = self.hparams
        if hp.prompt is None and hp.predict_file is None:
            raise ValueError(
                "attnlab predict needs data.prompt (a string to complete) or data.predict_file (one prompt per line, - for standard input)"
            )
        prompts = (
            [hp.prompt]
            if hp.prompt is not None
            else read_inputs(hp.predict_file, "data.predict_file", blank_lines=False)
        )
        return PromptDataset(prompts, self.tokenizer)

    def _setup_splits(self, stage: str | None) -> None:
        hp = self.hparams
        if hasattr(self, "val_set"):
            return
        ids = torch.tensor(self.tokenizer.encode(self.text, add_special_tokens=False).ids, dtype=torch.long)  # (N,)
        n_train = int(len(ids) * (1 - hp.val_fraction))
        val_block = hp.val_block_size or hp.block_size
        for name, part, key, size in (
            ("training", ids[:n_train], "block_size", hp.block_size),
            ("validation", ids[n_train:], "val_block_size" if hp.val_block_size else "block_size", val_block),
        ):
            if len(part) < size + 1:
                raise ValueError(
                    f"data.path: the {name} part of {self.path} has {len(part)} tokens, fewer than data.{key} + 1 = {size + 1}"
                )
        self.train_set = BlockDataset(ids[:n_train], hp.block_size, random_offset=True)
        self.val_set = BlockDataset(ids[n_train:], val_block, random_offset=False)
        rank_zero_info(
            f"{self.path}: {len(ids)} tokens, vocabulary {self.vocab_size}, {len(self.train_set)} training blocks of {hp.block_size}"
        )

    def train_dataloader(self) -> DataLoader:
        check_train_batches(
            len(self.train_set),
            self.hparams.batch_size,
            False,
            f"{self.path} (blocks of {self.hparams.block_size} tokens)",
        )
        return self._loader(self.train_set, None, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, None)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, None)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.predict_set, batch_size=1, collate_fn=collate_prompts)
