"""Text DataModules: parallel sentences for translation and a plain corpus for language modelling.

Words become indices through a tokenizer from the ``tokenizers`` library, trained on the training
split only: ``word`` (one index per word or punctuation mark, as in the seeds), ``bpe`` (subwords,
Sennrich et al. 2016) or ``char`` (one index per character, for the LM). The special tokens come
first, so their ids are fixed: PAD=0, BOS=1, EOS=2, UNK=3. Word and BPE tokenizers mark spaces
with ``▁`` (SentencePiece style), so decoding gives back the original text (detokenized).

`ParallelTextDataModule` reads aligned files ``{split}.{lang}`` (the Multi30k layout); without a
``data_dir`` it uses the embedded toy English-German corpus (`toy_translation_pairs`), generated
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

import json
import os
import random
from collections import namedtuple
from collections.abc import Iterator
from functools import cached_property, partial
from pathlib import Path
from typing import Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from datamodules.checks import check_train_batches, read_lines
from datamodules.loading import loader_settings

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
TokenizerKind = Literal["word", "bpe", "char"]


# ----------------------------------------------------------------------------- reading files


def read_parallel(src_path: Path, tgt_path: Path, key: str) -> tuple[list[str], list[str]]:
    """Aligned source/target sentences; both files must have the same number of non-empty lines."""
    src, tgt = read_lines(src_path, key), read_lines(tgt_path, key)
    if len(src) != len(tgt):
        raise ValueError(
            f"{key}: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; line i of one must translate line i of the other"
        )
    if not src:
        raise ValueError(f"{key}: {src_path} and {tgt_path} hold no sentences")
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                raise ValueError(
                    f"{path} line {number} is empty; remove the pair from both {src_path.name} and {tgt_path.name}"
                )
    return src, tgt


def read_inputs(path: str, key: str, blank_lines: bool) -> list[str]:
    """What `attnlab predict` works on, one input per line ("-": standard input). ``blank_lines``:
    whether an empty line is an input (a translation keeps it, so output line i answers input line i)."""
    lines, name = read_lines(path, key), "<stdin>" if path == "-" else path
    if not lines:
        raise ValueError(f"{key}: {name} holds no lines; write one input per line")
    for number, line in enumerate(lines, start=1):
        if not blank_lines and not line.strip():
            raise ValueError(f"{key}: {name} line {number} is empty; write one input per line")
    return lines


# ----------------------------------------------------------------------------- tokenizers


def build_tokenizer(kind: TokenizerKind, texts: list[str], vocab_size: int = 8000, min_frequency: int = 2) -> Tokenizer:
    """Train a tokenizer on ``texts``. ``vocab_size`` caps word/BPE vocabularies (specials included);
    words seen fewer than ``min_frequency`` times become UNK (word) or stay split (BPE)."""
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


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


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
            path = Path(hf_hub_download(name, "tokenizer.json", local_files_only=_offline()))
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


Encoding = namedtuple("Encoding", "ids")


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
        config = AutoConfig.from_pretrained(name, local_files_only=_offline())
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=_offline())
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


def encode(
    tokenizer: Tokenizer,
    lines: list[str],
    max_len: int,
    bos: bool,
    what: str,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> list[list[int]]:
    """Token ids + EOS (and BOS first when ``bos``), truncated to ``max_len`` with a warning that counts them."""
    room = max_len - 1 - int(bos)
    ids, truncated = [], 0
    for e in tokenizer.encode_batch(lines, add_special_tokens=False):
        truncated += len(e.ids) > room
        ids.append(([bos_id] if bos else []) + e.ids[:room] + [eos_id])
    if truncated:
        rank_zero_warn(f"{truncated} of {len(lines)} {what} longer than data.max_len={max_len} tokens were truncated")
    return ids


# ----------------------------------------------------------------------------- the embedded corpus

# A toy English -> German translation task from a small grammar: gender, case and number agreement
# (der/den/dem, ein/einen/einem, adjective endings), plural verbs, and verb-second word order when a
# place comes first ("In the park, a dog sleeps." -> "Im Park schläft ein Hund."). Deterministic,
# about 100 words per language, learnable to BLEU ~100 by a tiny model in seconds.
_ANIMATE = [  # English singular, plural; German singular, plural, gender
    ("man", "men", "Mann", "Männer", "m"),
    ("woman", "women", "Frau", "Frauen", "f"),
    ("child", "children", "Kind", "Kinder", "n"),
    ("dog", "dogs", "Hund", "Hunde", "m"),
    ("cat", "cats", "Katze", "Katzen", "f"),
    ("girl", "girls", "Mädchen", "Mädchen", "n"),
    ("boy", "boys", "Junge", "Jungen", "m"),
    ("bird", "birds", "Vogel", "Vögel", "m"),
]
_THINGS = [
    ("ball", "balls", "Ball", "Bälle", "m"),
    ("bike", "bikes", "Fahrrad", "Fahrräder", "n"),
    ("car", "cars", "Auto", "Autos", "n"),
    ("book", "books", "Buch", "Bücher", "n"),
    ("apple", "apples", "Apfel", "Äpfel", "m"),
    ("flower", "flowers", "Blume", "Blumen", "f"),
    ("hat", "hats", "Hut", "Hüte", "m"),
    ("cup", "cups", "Tasse", "Tassen", "f"),
]
_PLACES = [
    ("park", "Park", "m"),
    ("street", "Straße", "f"),
    ("house", "Haus", "n"),
    ("garden", "Garten", "m"),
    ("beach", "Strand", "m"),
    ("city", "Stadt", "f"),
    ("field", "Feld", "n"),
    ("lake", "See", "m"),
]
_PREPOSITIONS = [("in", "in"), ("on", "auf"), ("behind", "hinter"), ("in front of", "vor"), ("next to", "neben")]
_ADJECTIVES = [
    ("red", "rot"),
    ("big", "groß"),
    ("small", "klein"),
    ("old", "alt"),
    ("young", "jung"),
    ("black", "schwarz"),
    ("white", "weiß"),
    ("happy", "glücklich"),
    ("blue", "blau"),
    ("green", "grün"),
]
_TRANSITIVE = [
    ("sees", "see", "sieht", "sehen"),
    ("holds", "hold", "hält", "halten"),
    ("carries", "carry", "trägt", "tragen"),
    ("throws", "throw", "wirft", "werfen"),
    ("finds", "find", "findet", "finden"),
    ("buys", "buy", "kauft", "kaufen"),
    ("watches", "watch", "beobachtet", "beobachten"),
    ("paints", "paint", "malt", "malen"),
]
_INTRANSITIVE = [
    ("sits", "sit", "sitzt", "sitzen"),
    ("stands", "stand", "steht", "stehen"),
    ("plays", "play", "spielt", "spielen"),
    ("sleeps", "sleep", "schläft", "schlafen"),
    ("waits", "wait", "wartet", "warten"),
    ("runs", "run", "läuft", "laufen"),
]
_DEFINITE = {
    "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
}
_INDEFINITE = {
    "nom": {"m": "ein", "f": "eine", "n": "ein"},
    "acc": {"m": "einen", "f": "eine", "n": "ein"},
    "dat": {"m": "einem", "f": "einer", "n": "einem"},
}
_ENDING_AFTER_DEFINITE = {"nom": {"m": "e", "f": "e", "n": "e"}, "acc": {"m": "en", "f": "e", "n": "e"}}
_ENDING_AFTER_INDEFINITE = {"nom": {"m": "er", "f": "e", "n": "es"}, "acc": {"m": "en", "f": "e", "n": "es"}}


def _noun_phrase(rng: random.Random, noun: tuple, case: str) -> tuple[str, str, bool]:
    """(English, German, plural) for a determiner, an optional adjective and ``noun`` in ``case``."""
    en_sg, en_pl, de_sg, de_pl, gender = noun
    det = rng.choice(["a", "the", "the", "two", "three"])
    plural = det in ("two", "three") or (det == "the" and rng.random() < 0.3)
    adj = rng.choice(_ADJECTIVES) if rng.random() < 0.4 else None
    g = "pl" if plural else gender
    if det in ("two", "three"):  # no article: strong adjective ending
        de_det, ending = {"two": "zwei", "three": "drei"}[det], "en" if case == "dat" else "e"
    elif det == "the":
        de_det = _DEFINITE[case][g]
        ending = "en" if plural or case == "dat" else _ENDING_AFTER_DEFINITE[case][g]
    else:
        de_det = _INDEFINITE[case][g]
        ending = "en" if case == "dat" else _ENDING_AFTER_INDEFINITE[case][g]
    de_noun = de_pl if plural else de_sg
    if plural and case == "dat" and not de_noun.endswith(("n", "s")):
        de_noun += "n"  # dative plural: den Hunden, zwei Bällen
    words = ([adj[0]] if adj else []) + [en_pl if plural else en_sg]
    en = " ".join(["an" if det == "a" and words[0][0] in "aeiou" else det] + words)
    de = " ".join([de_det] + ([adj[1] + ending] if adj else []) + [de_noun])
    return en, de, plural


def _place(rng: random.Random) -> tuple[str, str]:
    en_prep, de_prep = rng.choice(_PREPOSITIONS)
    en_noun, de_noun, gender = rng.choice(_PLACES)
    article = _DEFINITE["dat"][gender]
    de = f"im {de_noun}" if de_prep == "in" and article == "dem" else f"{de_prep} {article} {de_noun}"
    return f"{en_prep} the {en_noun}", de


def toy_translation_pair(rng: random.Random) -> tuple[str, str]:
    """One English sentence and its German translation from the toy grammar."""
    subj_en, subj_de, plural = _noun_phrase(rng, rng.choice(_ANIMATE), "nom")
    if rng.random() < 0.5:
        verb = rng.choice(_TRANSITIVE)
        obj_en, obj_de, _ = _noun_phrase(rng, rng.choice(_THINGS + _ANIMATE), "acc")
    else:
        verb, obj_en, obj_de = rng.choice(_INTRANSITIVE), "", ""
    verb_en, verb_de = (verb[1], verb[3]) if plural else (verb[0], verb[2])
    place = _place(rng) if not obj_en or rng.random() < 0.5 else None
    if place and rng.random() < 0.4:  # place first: German puts the verb second, before the subject
        en = f"{place[0]}, {subj_en} {verb_en} {obj_en}".strip()
        de = f"{place[1]} {verb_de} {subj_de} {obj_de}".strip()
    else:
        en = " ".join(x for x in (subj_en, verb_en, obj_en, place[0] if place else "") if x)
        de = " ".join(x for x in (subj_de, verb_de, obj_de, place[1] if place else "") if x)
    return en[0].upper() + en[1:] + ".", de[0].upper() + de[1:] + "."


def toy_translation_pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct sentence pairs from the toy grammar, deterministic given ``seed``."""
    rng, pairs = random.Random(seed), {}
    while len(pairs) < n:
        en, de = toy_translation_pair(rng)
        pairs.setdefault(en, de)
    return list(pairs.items())


TOY_SPLITS = {"train": 3000, "val": 300, "test": 300}


def write_toy_corpus(folder: str | Path) -> Path:
    """Write the toy corpus as ``{train,val,test}.{en,de}`` into ``folder`` once; return the folder."""
    folder = Path(folder)
    if all((folder / f"{s}.{l}").is_file() for s in TOY_SPLITS for l in ("en", "de")):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    pairs = toy_translation_pairs(sum(TOY_SPLITS.values()))
    start = 0
    for split, size in TOY_SPLITS.items():  # distinct sentences, so no val/test sentence is in train
        for lang, side in (("en", 0), ("de", 1)):
            tmp = folder / f".{split}.{lang}.tmp"
            tmp.write_text("".join(p[side] + "\n" for p in pairs[start : start + size]), encoding="utf-8")
            tmp.replace(folder / f"{split}.{lang}")  # atomic: concurrent runs never read half a file
        start += size
    return folder


# ----------------------------------------------------------------------------- batching


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


# ----------------------------------------------------------------------------- DataModules


class _TokenizedDataModule(pl.LightningDataModule):
    """Tokenizer bookkeeping shared by both DataModules: saving beside the run, checkpoint round trip."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID

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

    def __init__(
        self,
        data_dir: str | None = None,
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
        cache_dir: str = "runs/data",
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ):
        super().__init__()
        self.save_hyperparameters()
        loader_settings(
            num_workers, pin_memory, persistent_workers
        )  # refuses a bad num_workers now, not at the first batch
        for key, value, low in (
            ("batch_size", batch_size, 1),
            ("max_len", max_len, 3),
            ("vocab_size", vocab_size, len(SPECIAL_TOKENS) + 1),
        ):
            if value < low:
                raise ValueError(f"data.{key}={value} must be >= {low}")
        if tokenizer not in ("word", "bpe", "pretrained"):
            raise ValueError(
                f"data.tokenizer={tokenizer!r} is not known for translation; choose word, bpe or pretrained"
            )
        if tokenizer == "pretrained" and tokenizer_dir is None:
            raise ValueError(
                "data.tokenizer=pretrained needs data.tokenizer_dir: the pretrained model's folder (or hub name)"
            )
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
        if predict_file not in (None, "-") and not Path(predict_file).is_file():
            raise FileNotFoundError(f"data.predict_file: file {predict_file} does not exist")

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

    def setup(self, stage: str | None = None) -> None:
        if stage == "fit":
            self._save_tokenizers()
        if stage == "predict":
            if self.hparams.predict_file is None:
                raise ValueError(
                    "attnlab predict needs data.predict_file: a file with one sentence per line, or - for standard input"
                )
            lines = read_inputs(self.hparams.predict_file, "data.predict_file", blank_lines=True)
            self.predict_set = ParallelDataset(
                encode(self.tokenizers[0], lines, self.max_len, False, "input sentences", eos_id=self.eos_id), lines
            )
            return
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


class _Prompts(Dataset):
    def __init__(self, texts: list[str], tokenizer: Tokenizer):
        self.texts, self.tokenizer = texts, tokenizer

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        return {"ids": self.tokenizer.encode(self.texts[i], add_special_tokens=False).ids, "text": self.texts[i]}


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
        prompt, predict_file: what `attnlab predict` completes (one prompt, or a file with one per line).
    Linked to the model: ``vocab_size`` (the trained vocabulary's size). The corpus has no test
    split: `attnlab test` evaluates the validation part.
    Batches: ``input`` (B, block_size) and ``target`` (B, block_size), the input shifted by one.
    """

    def __init__(
        self,
        path: str | None = None,
        tokenizer: Literal["char", "bpe", "pretrained"] = "char",
        bpe_vocab_size: int = 1000,
        min_frequency: int = 2,
        tokenizer_dir: str | None = None,
        block_size: int = 256,
        val_fraction: float = 0.1,
        batch_size: int = 64,
        prompt: str | None = None,
        predict_file: str | None = None,
        cache_dir: str = "runs/data",
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
    ):
        super().__init__()
        self.save_hyperparameters()
        loader_settings(
            num_workers, pin_memory, persistent_workers
        )  # refuses a bad num_workers now, not at the first batch
        if tokenizer not in ("char", "bpe", "pretrained"):
            raise ValueError(
                f"data.tokenizer={tokenizer!r} is not known for language modelling; choose char, bpe or pretrained"
            )
        if tokenizer == "pretrained" and tokenizer_dir is None:
            raise ValueError(
                "data.tokenizer=pretrained needs data.tokenizer_dir: the pretrained model's folder (or hub name) with its tokenizer.json"
            )
        for key, value, low in (("batch_size", batch_size, 1), ("block_size", block_size, 1)):
            if value < low:
                raise ValueError(f"data.{key}={value} must be >= {low}")
        if not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        if prompt is not None and not prompt:
            raise ValueError("data.prompt is empty; give at least one character to continue, or leave it unset")
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"data.path: file {path} does not exist")
        if predict_file not in (None, "-") and not Path(predict_file).is_file():
            raise FileNotFoundError(f"data.predict_file: file {predict_file} does not exist")
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

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        if stage == "fit":
            self._save_tokenizers()
        if stage == "predict":
            if hp.prompt is None and hp.predict_file is None:
                raise ValueError(
                    "attnlab predict needs data.prompt (a string to complete) or data.predict_file (one prompt per line, - for standard input)"
                )
            prompts = (
                [hp.prompt]
                if hp.prompt is not None
                else read_inputs(hp.predict_file, "data.predict_file", blank_lines=False)
            )
            self.predict_set = _Prompts(prompts, self.tokenizer)
            return
        if hasattr(self, "val_set"):
            return
        ids = torch.tensor(self.tokenizer.encode(self.text, add_special_tokens=False).ids, dtype=torch.long)  # (N,)
        n_train = int(len(ids) * (1 - hp.val_fraction))
        for name, part in (("training", ids[:n_train]), ("validation", ids[n_train:])):
            if len(part) < hp.block_size + 1:
                raise ValueError(
                    f"data.path: the {name} part of {self.path} has {len(part)} tokens, fewer than data.block_size + 1 = {hp.block_size + 1}"
                )
        self.train_set = BlockDataset(ids[:n_train], hp.block_size, random_offset=True)
        self.val_set = BlockDataset(ids[n_train:], hp.block_size, random_offset=False)
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
