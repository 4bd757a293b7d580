"""Tokenizers for the text DataModules, from three sources: trained here on the training split
(`build_tokenizer`: word, BPE or char, with the ``tokenizers`` library), saved by an earlier run
(`load_tokenizer`), or a pretrained model's own (`load_pretrained_tokenizer` for a ``tokenizer.json``,
`load_pretrained_seq2seq_tokenizer` for a translation model read by ``transformers``).

Trained tokenizers put the special tokens first, so their ids are fixed: PAD=0, BOS=1, EOS=2, UNK=3.
Word and BPE tokenizers mark spaces with ``▁`` (SentencePiece style), so decoding gives back the
original text (detokenized).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import huggingface_hub.constants
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
TokenizerKind = Literal["word", "bpe", "char"]


def build_tokenizer(
    kind: TokenizerKind, texts: Iterable[str] | Iterable[list[str]], vocab_size: int = 8000, min_frequency: int = 2
) -> Tokenizer:
    """Train a tokenizer on ``texts`` (strings, or batches of them: a generator streams a corpus of any size).
    ``vocab_size`` caps word/BPE vocabularies (specials included); words seen fewer than ``min_frequency``
    times become UNK (word) or stay split (BPE)."""
    if kind == "char":
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), "isolated")  # every character, newlines too
        tokenizer.decoder = decoders.Fuse()
        trainer = trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS))
    elif kind in ("word", "bpe"):
        tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>") if kind == "word" else models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()])
        tokenizer.decoder = decoders.Metaspace()
        trainer_class = trainers.WordLevelTrainer if kind == "word" else trainers.BpeTrainer
        trainer = trainer_class(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS))
    else:
        raise ValueError(f"data.tokenizer={kind!r} is not known; choose word, bpe or char")
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def load_tokenizer(path: Path, key: str) -> Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(
            f"{key}: tokenizer file {path} does not exist; it is written beside the checkpoints by `attnlab fit`"
        )
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust library raises a bare Exception for a damaged file
        raise ValueError(
            f"{key}: tokenizer {path} cannot be read ({err}); copy it again from the run that wrote it"
        ) from err
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise ValueError(f"{key}: tokenizer {path} does not map {token} to id {i}; it was not made by attnlab")
    return tokenizer


def load_pretrained_tokenizer(name: str, key: str) -> Tokenizer:
    """The ``tokenizer.json`` of a pretrained model: a local folder, or a hub name (huggingface_hub's cache)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{key}: {folder} has no tokenizer.json; a pretrained model needs the tokenizer it was trained with: "
                "save it into the folder (tokenizer.save_pretrained(folder))"
            )
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(
                hf_hub_download(name, "tokenizer.json", local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE)
            )
        except Exception as err:  # noqa: BLE001  not a hub name, not cached while offline, no network: all one answer
            raise ValueError(
                f"{key}={name} is neither a local folder nor a hub model whose tokenizer.json could be fetched "
                f"({str(err).splitlines()[0]}); give a folder written by save_pretrained"
            ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001  the Rust library raises a bare Exception for a type it does not know
        raise ValueError(
            f"{key}: {path} cannot be read by the tokenizers library ({str(err).splitlines()[0]})"
        ) from None


@dataclass
class Encoding:
    """The ids of one encoded text: what this project reads of a `tokenizers.Encoding`."""

    ids: list[int]

    def __len__(self) -> int:
        return len(self.ids)


class PretrainedTokenizerSide:
    """The source or the target side of a Hugging Face tokenizer, answering the calls of a
    `tokenizers.Tokenizer` this module makes. Marian keeps one SentencePiece model per language over one
    vocabulary: the target side encodes with ``text_target`` and decodes with the target model."""

    def __init__(self, tokenizer, target: bool):
        self.tokenizer, self.target = tokenizer, target

    def encode_batch(self, lines: list[str], add_special_tokens: bool = False) -> list[Encoding]:
        key = "text_target" if self.target else "text"
        return [
            Encoding(ids) for ids in self.tokenizer(**{key: lines}, add_special_tokens=add_special_tokens)["input_ids"]
        ]

    def decode_batch(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab_size(self) -> int:
        return len(self.tokenizer)

    def describe(self) -> str:
        """What decides the ids this side gives: the tokenizer's type, side and vocabulary."""
        vocab = sorted(self.tokenizer.get_vocab().items())
        return json.dumps([type(self.tokenizer).__name__, self.target, self.tokenizer.name_or_path, vocab])


def load_pretrained_seq2seq_tokenizer(
    name: str, key: str
) -> tuple[PretrainedTokenizerSide, PretrainedTokenizerSide, tuple[int, int, int]]:
    """(source side, target side, (PAD, BOS, EOS) ids) of a pretrained translation model's tokenizer, read
    by ``transformers``; BOS is the model's ``decoder_start_token_id`` (Marian: PAD), from its config.json."""
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        raise ValueError(
            f"{key}: a pretrained translation tokenizer is read with transformers; pip install 'attnlab[pretrained-text]'"
        ) from None
    try:
        config = AutoConfig.from_pretrained(name, local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE)
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE)
    except (
        OSError,
        ValueError,
        ImportError,
        json.JSONDecodeError,
    ) as err:  # a missing file or package, an unknown type, offline
        reason = str(err).strip().splitlines()[0]
        raise ValueError(
            f"{key}={name}: its tokenizer cannot be read ({reason}); give a folder written by save_pretrained with the "
            "tokenizer files (Marian: source.spm, target.spm, vocab.json; needs sentencepiece: pip install 'attnlab[pretrained-text]')"
        ) from None
    ids = (tokenizer.pad_token_id, getattr(config, "decoder_start_token_id", None), tokenizer.eos_token_id)
    if None in ids:
        raise ValueError(
            f"{key}={name}: the tokenizer or config.json lacks a PAD, EOS or decoder start token (got {ids})"
        )
    return PretrainedTokenizerSide(tokenizer, False), PretrainedTokenizerSide(tokenizer, True), ids
