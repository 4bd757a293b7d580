"""Synthetic corpora at the sizes researchers train on, for the data benchmarks (not for tests).

    python -m benchmarks.make_corpus --size 1GB --out runs/bench/corpus_1GB.txt
        Plain text: lines of Tiny Shakespeare's words, drawn with a seeded RNG (each word as often as in
        Tiny Shakespeare, each line as long as one of its lines), up to the last whole line within the size.
    python -m benchmarks.make_corpus --pairs 5000000 --out runs/bench/pairs_5M
        A parallel corpus of WMT14 En-De's size in the Multi30k layout: train.en and train.de hold 5 M
        aligned pairs drawn with repetition from Multi30k's training pairs; val.en and val.de are
        Multi30k's own validation pairs, so validation stays unseen.

Sizes are decimal (kB, MB, GB) or binary (KiB, MiB, GiB). ``--source`` replaces the default source
(Tiny Shakespeare's input.txt, or the Multi30k folder), ``--seed`` the RNG's seed. The output is written
in chunks of a few MB, so memory stays flat in the corpus size (peak RSS about 0.2 GB); it appears under
its name only once complete. On a 2-core machine under load, 100 MB of text took 2.1 s of CPU (7 s wall)
and 1 M pairs (130 MB) 0.9 s of CPU (3.4 s wall): about 20 s of CPU a GB.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
UNITS = {"": 1, "B": 1, "kB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
CHUNK_LINES = 200_000  # about 7 MB of text, or of each side of the pairs


def parse_size(text: str) -> int:
    """``"1GB"`` -> 10**9 bytes; ``"1.5MiB"``, ``"300 MB"`` and a plain number of bytes too."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2] not in UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a number and a unit ({', '.join(u for u in UNITS if u)}), e.g. 1GB"
        )
    return int(float(match[1]) * UNITS[match[2]])


def text_chunks(source: Path, rng: np.random.Generator) -> Iterator[bytes]:
    """Endless chunks of whole lines of ``source``'s words: word frequencies and line lengths (in words) as in
    ``source``'s non-empty lines. Built as arrays of bytes, not one Python object a word."""
    lines = [line.split() for line in source.read_bytes().splitlines()]
    lengths = np.array([len(words) for words in lines if words])
    words = [word for line in lines for word in line]
    if not words:
        raise ValueError(f"--source {source}: holds no words")
    spaced = np.frombuffer(b" ".join(words) + b" ", dtype=np.uint8)  # each word and the separator after it
    size = np.array([len(word) + 1 for word in words], dtype=np.int32)  # (V,); int32 halves the traffic
    start = np.cumsum(size) - size  # (V,) each word's first byte in spaced
    while True:
        last = np.cumsum(rng.choice(lengths, CHUNK_LINES)) - 1  # (CHUNK_LINES,) each line's last word
        chosen = rng.integers(0, len(words), last[-1] + 1)  # (W,)
        n = size[chosen]  # (W,)
        end = np.cumsum(n, dtype=np.int32)  # (W,) where each chosen word's separator ends in the chunk
        chunk = spaced[np.arange(end[-1], dtype=np.int32) + np.repeat(start[chosen] - (end - n), n)]  # (bytes,)
        chunk[end[last] - 1] = ord("\n")  # a line's last separator ends the line
        yield chunk.tobytes()


def write_text(out: Path, size: int, chunks: Iterator[bytes]) -> None:
    """Whole lines from ``chunks`` into ``out``, as many as fit in ``size`` bytes."""
    written = 0
    with open(out, "wb") as f:
        for chunk in chunks:
            if written + len(chunk) > size:
                f.write(chunk[: chunk.rfind(b"\n", 0, size - written) + 1])
                return
            f.write(chunk)
            written += len(chunk)


def read_pairs(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The aligned lines of ``folder``/``split``.en and .de, each with its newline, as object arrays (N,)."""
    en, de = ((folder / f"{split}.{side}").read_bytes().splitlines(keepends=True) for side in ("en", "de"))
    if len(en) != len(de) or not en:
        raise ValueError(
            f"--source {folder}: {split}.en has {len(en)} lines, {split}.de {len(de)}; expected equal, > 0"
        )
    return np.array(en, dtype=object), np.array(de, dtype=object)


def write_pairs(out: Path, source: Path, pairs: int, rng: np.random.Generator) -> None:
    """``pairs`` pairs drawn with repetition from ``source``'s train split, and its val split, into ``out``."""
    en, de = read_pairs(source, "train")
    out.mkdir()
    with open(out / "train.en", "wb") as f_en, open(out / "train.de", "wb") as f_de:
        for start in range(0, pairs, CHUNK_LINES):
            chosen = rng.integers(0, len(en), min(CHUNK_LINES, pairs - start))
            f_en.write(b"".join(en[chosen].tolist()))
            f_de.write(b"".join(de[chosen].tolist()))
    read_pairs(source, "val")
    for side in ("en", "de"):
        shutil.copyfile(source / f"val.{side}", out / f"val.{side}")


def publish(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a temporary name beside ``out``, then rename it to ``out``: a killed run leaves no corpus
    that a benchmark would read as complete."""
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(temporary)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(temporary, out)
    finally:
        if temporary.is_dir():
            shutil.rmtree(temporary)
        elif temporary.exists():
            temporary.unlink()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--size", type=parse_size, help="a plain-text corpus of this size, e.g. 1GB")
    what.add_argument("--pairs", type=int, help="a parallel corpus of this many training pairs, e.g. 5000000")
    parser.add_argument("--out", type=Path, required=True, help="the text file (--size) or folder (--pairs)")
    parser.add_argument(
        "--source", type=Path, help="Tiny Shakespeare's input.txt (--size), Multi30k's folder (--pairs)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    source = args.source or (DATA / "tinyshakespeare" / "input.txt" if args.size is not None else DATA / "multi30k")
    if not source.exists():
        parser.error(f"--source {source} does not exist")
    if args.size is not None:
        publish(args.out, lambda path: write_text(path, args.size, text_chunks(source, rng)))
        print(f"{args.out}: {args.out.stat().st_size:,} bytes of lines of {source}'s words")
    else:
        if args.pairs < 1:
            parser.error(f"--pairs {args.pairs}: expected a number of pairs >= 1")
        publish(args.out, lambda path: write_pairs(path, source, args.pairs, rng))
        print(f"{args.out}/: train.en, train.de ({args.pairs:,} pairs drawn from {source}), val.en, val.de")


if __name__ == "__main__":
    main()
