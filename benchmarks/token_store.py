"""The token store (`datamodules.text.token_store`) against its ceiling and its peers, on a corpus given by path (made
by `benchmarks.make_corpus`); run by hand, each phase in a Python process of its own, one after the other:

    python -m benchmarks.token_store CORPUS [--tokenizer bpe] [--vocab-size 8000] [--out runs/bench/token_store]
    python -m benchmarks.token_store CORPUS --compare   # also the peers' formats (a corpus of about 30 MB)
    python -m benchmarks.token_store PAIRS_DIR --pairs  # sentence pairs in the Multi30k layout (train.en, train.de)

Phases (peak RSS: the process's ``getrusage`` high-water mark; "RSS before": the same once torch, Lightning and
the DataModule are imported, about 1 GB here, which the phase's work adds to):
  prepare   `TextCorpusDataModule`'s whole preparation into an empty cache: a pass that counts the characters, the
            tokenizer trained on the first 90%, the corpus encoded and written; wall seconds.
  ceiling   the tokenizers library alone: ``encode_batch_fast`` over the same pieces (lines and their ends) in
            the same batches, only the calls timed (reading the lines is left out): tokens/s.
  encode    the preparation with that tokenizer given (nothing trained): reading, encoding, writing; tokens/s,
            and its ratio to the ceiling.
  first     a cache hit: from building the DataModule to the first training batch (imports left out), seconds.
  compare   (--compare) the encode phase's ids written as our files, as a Hugging Face ``datasets`` table of
            blocks (``save_to_disk``, as run_clm groups texts) and as litdata chunks (``optimize`` with
            ``TokensLoader``, as litgpt prepares corpora), each where the library imports: write seconds, size on
            disk, and 10,000 random blocks of 257 tokens read back (our files also through ``np.memmap``).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

BLOCK, READS = 257, 10_000


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def _corpus(args: argparse.Namespace, cache: str, **settings):
    """The DataModule of the corpus (or, with ``--pairs``, of the pairs), its store under ``out/cache``."""
    from datamodules.text.corpus import TextCorpusDataModule
    from datamodules.text.parallel import ParallelTextDataModule

    cache_dir = str(Path(args.out) / cache)
    if args.pairs:
        options = dict(tokenizer="bpe", vocab_size=args.vocab_size, test_split=None, batch_size=64)
        return ParallelTextDataModule(args.corpus, cache_dir=cache_dir, **{**options, **settings})
    options = dict(tokenizer=args.tokenizer, bpe_vocab_size=args.vocab_size, block_size=256, batch_size=64)
    return TextCorpusDataModule(args.corpus, cache_dir=cache_dir, **{**options, **settings})


def _tokens(meta: dict) -> int:
    return sum(length for name, length in meta["arrays"].items() if name.endswith(".ids"))


def _given(args: argparse.Namespace) -> dict:
    """The settings that hand the DataModule the tokenizer the prepare phase trained."""
    folder = str(Path(args.out) / "tokenizer")
    return dict(tokenizer_dir=folder) if args.pairs else dict(tokenizer="pretrained", tokenizer_dir=folder)


def _pieces(args: argparse.Namespace):
    """What the preparation encodes, batch by batch: the corpus's pieces, or the pairs' sentences side by side."""
    from datamodules.text.prepare import BATCH, corpus_pieces
    from datamodules.text.sources import corpus_source

    if not args.pairs:
        return corpus_pieces(corpus_source(args.corpus, "text"))
    data = _corpus(args, "unused")
    return (src + tgt for split in data.sources.values() for src, tgt in split.batches(BATCH))


def _built(data) -> tuple[Path, dict]:
    """The DataModule's store built (or found): its folder and the time, tokens, speed and RSS before it."""
    before, start = _peak_mb(), time.perf_counter()
    folder, meta = data.store
    seconds, tokens = time.perf_counter() - start, _tokens(meta)
    return folder, {"seconds": seconds, "tokens": tokens, "tokens/s": tokens / seconds, "RSS before MB": before}


def prepare(args: argparse.Namespace) -> dict:
    folder, result = _built(_corpus(args, "cold"))
    (Path(args.out) / "tokenizer").mkdir(exist_ok=True)
    shutil.copy(folder / "tokenizer.json", Path(args.out) / "tokenizer" / "tokenizer.json")
    return {**result, "store MB": _folder_mb(folder)}


def ceiling(args: argparse.Namespace) -> dict:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.out) / "tokenizer" / "tokenizer.json"))
    seconds, tokens = 0.0, 0
    for pieces in _pieces(args):
        start = time.perf_counter()
        encodings = tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        seconds += time.perf_counter() - start
        tokens += sum(map(len, encodings))
    return {"seconds": seconds, "tokens": tokens, "tokens/s": tokens / seconds}


def encode(args: argparse.Namespace) -> dict:
    folder, result = _built(_corpus(args, "given", **_given(args)))
    return {**result, "store": str(folder)}


def first(args: argparse.Namespace) -> dict:
    import datamodules.text  # noqa: F401  the imports, which a run pays anyway, are left out

    before, start = _peak_mb(), time.perf_counter()
    data = _corpus(args, "cold")
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    shape = batch["src"].shape if args.pairs else batch["input"].shape
    return {"seconds": time.perf_counter() - start, "batch": list(shape), "RSS before MB": before}


def _random_reads(read, n_blocks: int, ids: np.ndarray) -> float:
    """Seconds to read `READS` random blocks with ``read(i)`` (block i), after checking that one holds its ids."""
    middle = n_blocks // 2
    if not np.array_equal(np.asarray(read(middle)), ids[middle * BLOCK : (middle + 1) * BLOCK]):
        raise AssertionError("a block read back differs from the ids written")
    starts = np.random.default_rng(0).integers(0, n_blocks, READS)
    start = time.perf_counter()
    for i in starts.tolist():
        read(i)
    return time.perf_counter() - start


def _ours(ids: np.ndarray, folder: Path) -> dict:
    from datamodules.text.token_store import TokenArray

    start = time.perf_counter()
    ids.tofile(folder / "corpus.ids")  # the store's format: the array as it is
    seconds = time.perf_counter() - start
    array = TokenArray(folder / "corpus.ids", ids.dtype, 0, len(ids))
    mapped = np.memmap(folder / "corpus.ids", ids.dtype, mode="r")
    n = len(ids) // BLOCK
    return {
        "write s": seconds,
        "MB": _folder_mb(folder),
        "read s (pread)": _random_reads(lambda i: np.asarray(array[i * BLOCK : (i + 1) * BLOCK], np.int64), n, ids),
        "read s (memmap)": _random_reads(lambda i: np.asarray(mapped[i * BLOCK : (i + 1) * BLOCK], np.int64), n, ids),
    }


def _hf_datasets(ids: np.ndarray, folder: Path) -> dict:
    import datasets

    n = len(ids) // BLOCK
    start = time.perf_counter()
    datasets.Dataset.from_dict({"input_ids": ids[: n * BLOCK].reshape(n, BLOCK)}).save_to_disk(str(folder))
    seconds = time.perf_counter() - start
    table = datasets.load_from_disk(str(folder)).with_format("numpy")
    return {
        "write s": seconds,
        "MB": _folder_mb(folder),
        "read s": _random_reads(lambda i: table[i]["input_ids"], n, ids),
    }


def _litdata_chunk(span: tuple[int, int], path: str):
    yield np.array(np.load(path, mmap_mode="r")[span[0] : span[1]])  # the store's id type, as litgpt's int arrays


def _litdata(ids: np.ndarray, folder: Path) -> dict:
    from litdata import StreamingDataset, TokensLoader, optimize

    np.save(folder.parent / "ids.npy", ids)
    item = BLOCK * 4096  # a chunk holds two items: its blocks are the ids' blocks (none crosses a chunk)
    spans = [(s, min(s + item, len(ids))) for s in range(0, len(ids), item)]
    start = time.perf_counter()
    fn = partial(_litdata_chunk, path=str(folder.parent / "ids.npy"))
    optimize(
        fn=fn, inputs=spans, output_dir=str(folder), chunk_size=2 * item, item_loader=TokensLoader(), num_workers=1
    )
    seconds = time.perf_counter() - start
    dataset = StreamingDataset(str(folder), item_loader=TokensLoader(block_size=BLOCK))
    return {
        "write s": seconds,
        "MB": _folder_mb(folder),
        "read s": _random_reads(dataset.__getitem__, len(dataset), ids),
    }


def compare(args: argparse.Namespace) -> dict:
    store = Path(args.store)
    ids = np.fromfile(store / "corpus.ids", dtype=json.loads((store / "meta.json").read_text())["dtype"])
    results = {}
    for name, write, library in (
        ("numpy files", _ours, None),
        ("HF datasets", _hf_datasets, "datasets"),
        ("litdata", _litdata, "litdata"),
    ):
        try:
            if library:
                __import__(library)
        except ImportError:
            results[name] = "not installed"
            continue
        folder = Path(args.out) / "compare" / name.replace(" ", "_")
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        results[name] = write(ids, folder)
    return results


PHASES = {"prepare": prepare, "ceiling": ceiling, "encode": encode, "first": first, "compare": compare}


def run_phase(args: argparse.Namespace, phase: str, *extra: str) -> dict:
    """``phase`` in a fresh process; its result with the process's peak RSS."""
    command = [sys.executable, "-m", "benchmarks.token_store", args.corpus, "--phase", phase, "--out", args.out]
    command += ["--tokenizer", args.tokenizer, "--vocab-size", str(args.vocab_size), *extra]
    command += ["--pairs"] if args.pairs else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"phase {phase} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus")
    parser.add_argument("--tokenizer", default="bpe", choices=["bpe", "char"])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--out", default="runs/bench/token_store")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--pairs", action="store_true", help="CORPUS is a folder of {split}.en/{split}.de pairs")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps({**PHASES[args.phase](args), "peak RSS MB": _peak_mb()}))
        return
    shutil.rmtree(args.out, ignore_errors=True)
    Path(args.out).mkdir(parents=True)
    results = {phase: run_phase(args, phase) for phase in ("prepare", "ceiling", "encode", "first")}
    results["encode"]["of the ceiling"] = results["encode"]["tokens/s"] / results["ceiling"]["tokens/s"]
    if args.compare:
        results["compare"] = run_phase(args, "compare", "--store", results["encode"]["store"])
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
