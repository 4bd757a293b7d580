"""`TextCorpusDataModule`: a corpus for language modelling, read once into a token store and cut into blocks.

As `datamodules.text.parallel`: a token store (`datamodules.text.token_store`) from any source of
`datamodules.text.sources`, a tokenizer trained by streaming (``char``, ``word`` or ``bpe``), saved beside the run and
inside every checkpoint. ``tokenizer: pretrained`` reads a pretrained model's ``tokenizer.json`` (GPT-2's byte-level
BPE) with the ``tokenizers`` library.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pytorch_lightning.utilities import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from datamodules.checks import check_train_batches, read_inputs
from datamodules.text.base import TokenizedDataModule
from datamodules.text.batching import BlockDataset, PromptDataset, collate_prompts
from datamodules.text.documents import DocumentBlockDataset, document_batches
from datamodules.text.prepare import corpus_pieces, tokenizer_digest, train_corpus_tokenizer, write_parts
from datamodules.text.sources import corpus_source
from datamodules.text.token_store import check_free_space, open_array, token_dtype
from datamodules.text.tokenizers import load_pretrained_tokenizer, load_tokenizer
from datamodules.text.toy import write_toy_corpus


class TextCorpusDataModule(TokenizedDataModule):
    """A corpus for language modelling, cut into contiguous blocks, split by position (training first, validation
    last).

    Args:
        path: the corpus: a text file (e.g. ../shared/data/tinyshakespeare/input.txt); a folder (every .txt, .jsonl
            or .parquet file below it, sorted, all of one kind) or a glob ("data/*.txt"); .jsonl or .parquet files,
            whose records hold the text in ``text_field``; or ``hf:NAME[:CONFIG]``, the train split of a Hugging
            Face dataset (a hub name when online, or a local folder of data files). Each line (or record) is
            followed by a line end. None: the English side of the embedded toy corpus (``cache_dir``/toy_en_de/train.en).
        text_field: the field of a record that holds its text, dotted for a nested one.
        cache_dir: where the token store (and the toy corpus) is written: ``cache_dir``/tokens/NAME-HASH.
        tokenizer: "char" (one token per character) or "bpe" (trained here; bpe_vocab_size, min_frequency:
            BPE only), or "pretrained": the ``tokenizer.json`` of the pretrained model in ``tokenizer_dir``
            (e.g. GPT-2's byte-level BPE), used as it is. A tokenizer trained here learns from the text before the
            validation part.
        tokenizer_train_chars: at most this many characters train a tokenizer here, every k-th batch of the training
            text (SentencePiece's ``input_sentence_size``); None: all. The whole corpus is encoded either way.
        tokenizer_dir: load ``tokenizer.json`` saved by an earlier fit instead of training; with
            ``tokenizer: pretrained``, the pretrained model's folder (or hub name).
        token_dtype: the store's id type, "uint16" or "uint32"; None: the smallest that holds the tokenizer's ids.
        block_size: tokens of context per sample. val_fraction: the last part of the tokens, held out.
        val_block_size: tokens per validation (and test) window; None: ``block_size``. Longer windows let
            ``model.eval_context`` score the model beyond its training context (`models.text.translation_module`).
        documents: pack documents (`datamodules.text.documents`: records, or a text file's blank-line-separated
            paragraphs): attention, positions and the loss of a block stay inside each document (Llama 3's document
            masking); a document longer than the block is split. A store of its own.
        prompt, predict_file: what `attnlab predict` completes (one prompt, or a file with one per line).
    Linked to the model: ``vocab_size`` (the trained vocabulary's size). The corpus has no test
    split: `attnlab test` evaluates the validation part.
    Batches: ``input`` (B, block_size) and ``target`` (B, block_size), the input shifted by one; with ``documents``
    also ``document_ids`` and ``position_ids`` (B, block_size), and -100 (ignored) as the target of a document's last
    token.
    """

    task, tokenizer_kinds = "language modelling", ("char", "bpe", "pretrained")
    pretrained_hint = " with its tokenizer.json"

    def __init__(
        self,
        path: str | None = None,
        cache_dir: str = "runs/data",
        text_field: str = "text",
        tokenizer: Literal["char", "bpe", "pretrained"] = "char",
        bpe_vocab_size: int = 1000,
        min_frequency: int = 2,
        tokenizer_train_chars: int | None = 100_000_000,
        tokenizer_dir: str | None = None,
        token_dtype: Literal["uint16", "uint32"] | None = None,
        block_size: int = 256,
        val_block_size: int | None = None,
        val_fraction: float = 0.1,
        batch_size: int = 64,
        prompt: str | None = None,
        predict_file: str | None = None,
        documents: bool = False,
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
        self.path = path or str(write_toy_corpus(Path(cache_dir) / "toy_en_de") / "train.en")
        self.source = corpus_source(self.path, text_field)

    @cached_property
    def _given_tokenizer(self) -> Tokenizer | None:
        """The tokenizer not trained here (pretrained, or saved by an earlier fit), or None."""
        hp = self.hparams
        if hp.tokenizer == "pretrained":
            return load_pretrained_tokenizer(hp.tokenizer_dir, "data.tokenizer_dir")
        if hp.tokenizer_dir is not None:
            return load_tokenizer(Path(hp.tokenizer_dir) / "tokenizer.json", "data.tokenizer_dir")
        return None

    @cached_property
    def tokenizer(self) -> Tokenizer:
        if self._given_tokenizer is not None:
            return self._given_tokenizer
        return load_tokenizer(self.store[0] / "tokenizer.json", "data.cache_dir")

    def _tokenizers(self) -> dict[str, Tokenizer]:
        return {"tokenizer": self.tokenizer}

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.decode_batch(ids, skip_special_tokens=True)

    def _store_label(self) -> str:
        return f"{Path(self.path.removeprefix('hf:')).stem}-{self.hparams.tokenizer}"

    def _store_key(self) -> dict:
        hp = self.hparams
        if self._given_tokenizer is not None:
            tokenizer = {"sha256": tokenizer_digest(self._given_tokenizer)}
        else:  # trained on the text before the validation part
            settings = ("bpe_vocab_size", "min_frequency") if hp.tokenizer == "bpe" else ()
            tokenizer = {k: hp[k] for k in ("tokenizer", "val_fraction", "tokenizer_train_chars", *settings)}
        key = {"corpus": self.source.fingerprint(), "tokenizer": tokenizer, "token_dtype": hp.token_dtype}
        return {**key, "documents": True} if hp.documents else key  # a store without documents keeps its folder

    def _build(self, folder: Path) -> dict:
        hp, given, source = self.hparams, self._given_tokenizer, self.source
        expected = given.get_vocab_size() if given else hp.bpe_vocab_size if hp.tokenizer == "bpe" else 0
        if source.text_bytes() is not None:  # at most one id per byte of text
            check_free_space(folder, source.text_bytes() * token_dtype(expected, hp.token_dtype).itemsize, self.path)
        tokenizer = given or train_corpus_tokenizer(
            source, hp.tokenizer, hp.bpe_vocab_size, hp.min_frequency, hp.val_fraction, hp.tokenizer_train_chars
        )
        if given is None:
            tokenizer.save(str(folder / "tokenizer.json"))
        dtype = token_dtype(tokenizer.get_vocab_size(), hp.token_dtype)
        batches = document_batches(source, self.path) if hp.documents else corpus_pieces(source)
        pieces = ((batch,) for batch in batches)
        arrays = write_parts(
            folder, ["corpus"], dtype, [tokenizer], pieces, hp.documents, source.text_bytes(), "tokenizing"
        )
        return {"dtype": dtype.name, "arrays": arrays}

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
        ids = open_array(*self.store, "corpus.ids")  # (N,) on disk
        n_train = int(len(ids) * (1 - hp.val_fraction))
        val_block = hp.val_block_size or hp.block_size
        for name, part, key, size in (
            ("training", ids.part(0, n_train), "block_size", hp.block_size),
            (
                "validation",
                ids.part(n_train, len(ids)),
                "val_block_size" if hp.val_block_size else "block_size",
                val_block,
            ),
        ):
            if len(part) < size + 1:
                raise ValueError(
                    f"data.path: the {name} part of {self.path} has {len(part)} tokens, fewer than data.{key} + 1 = {size + 1}"
                )
        self.train_set = self._blocks(ids.part(0, n_train), 0, hp.block_size, random_offset=True)
        self.val_set = self._blocks(ids.part(n_train, len(ids)), n_train, val_block, random_offset=False)
        rank_zero_info(
            f"{self.path}: {len(ids)} tokens, vocabulary {self.vocab_size}, {len(self.train_set)} training blocks of {hp.block_size}"
        )

    def _blocks(self, part, first: int, size: int, random_offset: bool) -> BlockDataset:
        """The blocks of ``part``, the tokens from ``first`` on; with documents, each token's document from the
        store's offsets (document i starts at offsets[i])."""
        if not self.hparams.documents:
            return BlockDataset(part, size, random_offset)
        offsets = open_array(*self.store, "corpus.offsets")
        return DocumentBlockDataset(part, offsets[:-1] - first, size, random_offset)

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
