"""Preparing a token store (`datamodules.text.token_store`) from a source (`datamodules.text.sources`), in two passes
at most: a tokenizer trained by streaming over the text (``train_from_iterator`` on batches), then every batch of
`BATCH` lines encoded with the tokenizers library's batch API and appended to the store's files.

While one batch is written, the next is encoded in a second thread (the tokenizers library lets go of Python's lock
while it encodes, on every core). A progress bar (bytes of text, with an ETA) shows on a terminal; at the end one
line gives the store's folder, size, token count and speed.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from itertools import chain
from operator import attrgetter
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from datamodules.text.token_store import TokenWriter
from datamodules.text.tokenizers import build_tokenizer

BATCH = 20_000  # lines (or records) encoded in one call


def corpus_pieces(source) -> Iterator[list[str]]:
    """A language-model corpus in batches of pieces: each line (or record's text) followed by a line end, so a
    file's pieces joined are its text (with ``\\n`` line ends, and one at the end)."""
    for (texts,) in source.batches(BATCH):
        yield [text + "\n" for text in texts]


def head(batches: Iterable[list[str]], chars: int) -> Iterator[list[str]]:
    """The batches of pieces that hold the first ``chars`` characters (the last piece cut there)."""
    for batch in batches:
        size = sum(map(len, batch))
        if size < chars:
            chars -= size
            yield batch
            continue
        cut = []
        for piece in batch:
            cut.append(piece[:chars])
            chars -= len(cut[-1])
            if chars == 0:
                break
        yield cut
        return


def sample(batches: Iterable[tuple], total: int | None, chars: int | None) -> Iterator[tuple]:
    """About ``chars`` characters of ``batches`` (tuples of columns) for training a tokenizer, as SentencePiece's
    ``input_sentence_size`` does: every k-th batch, k = ceil(``total`` / ``chars``), so the sample spans the whole
    text. ``total``: the text's characters (None: unknown, the first batches are taken); ``chars`` None: all."""
    size = lambda batch: sum(len(text) for column in batch for text in column)  # noqa: E731
    if chars is None:
        yield from batches
        return
    stride = max(1, -(-total // chars)) if total else 1
    given = 0
    for i, batch in enumerate(batches):
        if i % stride == 0:
            yield batch
            given += size(batch)
            if given >= chars:
                return


def train_corpus_tokenizer(
    source, kind: str, vocab_size: int, min_frequency: int, val_fraction: float, chars: int | None
) -> Tokenizer:
    """A tokenizer trained on the first (1 - ``val_fraction``) of a corpus's characters, or on a ``sample`` of
    ``chars`` of them: a first pass counts them (and checks the whole text before any training), the second trains."""
    total = sum(sum(map(len, batch)) for batch in corpus_pieces(source))
    training = int(total * (1 - val_fraction))
    texts = sample(((batch,) for batch in head(corpus_pieces(source), training)), training, chars)
    return build_tokenizer(kind, (batch for (batch,) in texts), vocab_size, min_frequency)


def train_pair_tokenizers(
    source, kind: str, vocab_size: int, min_frequency: int, shared: bool, chars: int | None
) -> list[Tokenizer]:
    """(source, target) tokenizers trained on a split's sentences, or on a ``sample`` of ``chars`` of them: one for
    both languages (the source sentences, then the target sentences) when ``shared``, else one per side."""
    total = source.text_bytes()  # about its characters
    side = lambda i: (batch[i] for batch in sample(source.batches(BATCH), total, chars))  # noqa: E731
    if shared:
        tokenizer = build_tokenizer(kind, chain(side(0), side(1)), vocab_size, min_frequency)
        return [tokenizer, tokenizer]
    return [build_tokenizer(kind, side(i), vocab_size, min_frequency) for i in (0, 1)]


def tokenizer_digest(tokenizer) -> str:
    """A hash of everything that decides a tokenizer's ids (its serialised form, or a pretrained side's vocabulary)."""
    text = tokenizer.to_str() if isinstance(tokenizer, Tokenizer) else tokenizer.describe()
    return hashlib.sha256(text.encode()).hexdigest()


def _encoded(encoders: list[Callable], batches: Iterable[tuple]) -> Iterator[list[list]]:
    """Each batch's columns encoded (lists of encodings), the next batch encoding in a second thread meanwhile."""

    def encode(columns: tuple) -> list[list]:
        return [enc(texts, add_special_tokens=False) for enc, texts in zip(encoders, columns)]

    with ThreadPoolExecutor(1) as pool:
        pending = None
        for columns in batches:
            future = pool.submit(encode, columns)
            if pending is not None:
                yield pending.result()
            pending = future
        if pending is not None:
            yield pending.result()


def _progress(batches: Iterable[tuple], total: int | None, label: str) -> Iterator[tuple]:
    """The batches, counted on a progress bar (characters of text, about its bytes) when stderr is a terminal."""
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=label, disable=not sys.stderr.isatty(), leave=False) as bar:
        for columns in batches:
            yield columns
            bar.update(sum(sum(map(len, texts)) for texts in columns))


def write_parts(
    folder: Path,
    names: list[str],
    dtype: np.dtype,
    tokenizers: list,
    batches: Iterable[tuple],
    sentences: bool,
    total: int | None,
    label: str,
) -> dict[str, int]:
    """Encode each column of ``batches`` with its tokenizer into the part of the same place in ``names``; returns
    the arrays written (file name -> length)."""
    encoders = [getattr(t, "encode_batch_fast", None) or t.encode_batch for t in tokenizers]
    with ExitStack() as stack:
        writers = [stack.enter_context(TokenWriter(folder, name, dtype, sentences)) for name in names]
        for columns in _encoded(encoders, _progress(batches, total, label)):
            for writer, encodings in zip(writers, columns):
                # each encoding's id list made as it is consumed: 2.4x less time than a list of the lists first
                lengths = np.fromiter(map(len, encodings), np.int64, len(encodings))
                writer.add(lengths, chain.from_iterable(map(attrgetter("ids"), encodings)))
    return {name: length for writer in writers for name, length in writer.arrays.items()}


def report(folder: Path, built: Path, arrays: dict[str, int], seconds: float) -> None:
    """The line that ends a preparation: the store's folder (``folder``, once ``built`` is renamed), size, token
    count and speed."""
    size = sum(f.stat().st_size for f in built.iterdir())
    tokens = sum(length for name, length in arrays.items() if name.endswith(".ids"))
    print(
        f"attnlab: token store {folder}: {size / 1e6:.1f} MB, {tokens:,} tokens, {tokens / max(seconds, 1e-9):,.0f} tokens/s",
        file=sys.stderr,
        flush=True,
    )
