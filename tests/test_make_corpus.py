"""The benchmarks' corpus generator (`benchmarks.make_corpus`) at a few hundred kB: the requested size in whole
lines of the source's words, and pairs that stay aligned."""

import argparse
import re

import pytest

from benchmarks import make_corpus
from benchmarks.make_corpus import main, parse_size


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 1,000 lines: a few hundred kB cross many chunk boundaries."""
    monkeypatch.setattr(make_corpus, "CHUNK_LINES", 1000)


SOURCE = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


@pytest.mark.parametrize(
    "text,size", [("1GB", 10**9), ("300 MB", 3 * 10**8), ("1.5MiB", 3 * 2**19), ("2kB", 2000), ("123", 123)]
)
def test_sizes_are_read_with_their_units(text, size):
    assert parse_size(text) == size


def test_a_size_without_a_known_unit_is_one_line():
    with pytest.raises(argparse.ArgumentTypeError, match=r"'1 GiBs': expected a number and a unit .*e.g. 1GB"):
        parse_size("1 GiBs")


def test_a_corpus_of_the_requested_size_in_whole_lines_of_the_sources_words(tmp_path):
    (tmp_path / "source.txt").write_text(SOURCE)
    out = tmp_path / "corpus" / "c.txt"
    main(["--size", "300kB", "--out", str(out), "--source", str(tmp_path / "source.txt"), "--seed", "1"])
    data = out.read_bytes()
    longest = max(len(line) for line in SOURCE.splitlines()) * 3  # a line of the longest words, generously
    assert 300_000 - longest < len(data) <= 300_000 and data.endswith(b"\n")
    lines = data.decode().split("\n")[:-1]
    assert set(" ".join(lines).split()) == set(SOURCE.split())  # every word of the source, and nothing else
    lengths = {len(line.split(" ")) for line in lines}
    assert lengths == {len(line.split()) for line in SOURCE.splitlines() if line}  # the source's line lengths
    assert not any(re.search(r"^ | $|  ", line) for line in lines)
    assert [p.name for p in out.parent.iterdir()] == ["c.txt"]  # no temporary left beside it
    main(
        [
            "--size",
            "300kB",
            "--out",
            str(tmp_path / "again.txt"),
            "--source",
            str(tmp_path / "source.txt"),
            "--seed",
            "1",
        ]
    )
    assert (tmp_path / "again.txt").read_bytes() == data  # the seed fixes the corpus


def test_pairs_are_drawn_aligned_and_validation_is_the_sources(tmp_path):
    source = tmp_path / "multi30k"
    source.mkdir()
    english = [f"pair {i} in English." for i in range(50)]
    german = [f"Paar {i} auf Deutsch." for i in range(50)]
    (source / "train.en").write_text("\n".join(english) + "\n")
    (source / "train.de").write_text("\n".join(german) + "\n")
    (source / "val.en").write_text("a val line\n")
    (source / "val.de").write_text("eine Val-Zeile\n")
    out = tmp_path / "pairs"
    main(["--pairs", "4500", "--out", str(out), "--source", str(source)])
    en, de = ((out / f"train.{side}").read_text().splitlines() for side in ("en", "de"))
    assert len(en) == len(de) == 4500
    assert all(e.split()[1] == d.split()[1] for e, d in zip(en, de))  # pair i with pair i
    assert set(en) == set(english) and set(de) == set(german)
    assert (out / "val.en").read_text() == "a val line\n" and (out / "val.de").read_text() == "eine Val-Zeile\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multi30k", "pairs"]


def test_misaligned_sources_are_refused_and_leave_nothing(tmp_path):
    """The validation files are read after the training pairs are written: the half-written folder goes."""
    for split, english, german in (("train", "a\nb\n", "x\ny\n"), ("val", "a\nb\n", "x\n")):
        (tmp_path / f"{split}.en").write_text(english)
        (tmp_path / f"{split}.de").write_text(german)
    with pytest.raises(ValueError, match=r"val.en has 2 lines, val.de 1; expected equal"):
        main(["--pairs", "10", "--out", str(tmp_path / "out"), "--source", str(tmp_path)])
    assert len(list(tmp_path.iterdir())) == 4
