"""Text sources (`datamodules.text.sources`): every kind a user has reads the same text in bounded batches, and bad
input stops with one line that names the setting, the file and the line (or row)."""

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datamodules.checks import read_lines
from datamodules.text import sources as text_sources
from datamodules.text.sources import ParallelFiles, corpus_source, pair_source, read_text_lines

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PIECES = st.sampled_from(
    [b"a", b" ", b"\n", b"\r", b"\r\n", b"\xc3\xa4", b"\xe4", b"\xf0\x9f", b"\xef\xbb\xbf", b"\x00"]
)


def texts(source, size=3) -> list[tuple]:
    return [row for batch in source.batches(size) for row in zip(*batch)]


@PROPERTY
@given(raw=st.one_of(st.binary(max_size=60), st.lists(PIECES, max_size=20).map(b"".join)), block=st.integers(1, 9))
@example(raw=b"\xef\xbb\xbfab\r\ncd", block=1)  # a byte-order mark longer than the block
def test_lines_read_in_blocks_are_those_of_the_whole_file(tmp_path, monkeypatch, raw, block):
    """The reader of corpora of any size against `read_lines` (the whole file at once): the same lines, the same
    line and column for a byte that is not UTF-8, wherever the blocks end; and a NUL byte (binary data), when it
    comes first, is named by its line and column (in characters) in the text before it."""
    monkeypatch.setattr(text_sources, "BLOCK", block)
    path = tmp_path / "corpus.txt"
    path.write_bytes(raw)
    read = lambda: [line for lines in read_text_lines(path, f"data.path: {path}") for line in lines]  # noqa: E731
    body = raw.removeprefix(b"\xef\xbb\xbf")
    nul = body.find(b"\x00")
    try:
        expected = read_lines(path, "data.path")
    except ValueError as err:
        if nul < 0 or nul > int(re.search(r"column (\d+)", str(err))[1]) - 1 + _line_start(body, str(err)):
            with pytest.raises(ValueError, match=re.escape(f"data.path: {err}")):
                read()
            return
    if nul >= 0:
        before = re.split(r"\r\n|\r|\n", body[:nul].decode())
        with pytest.raises(
            ValueError, match=rf"{path} line {len(before)}: a NUL byte at column {len(before[-1]) + 1}: "
        ):
            read()
        return
    assert read() == expected


def _line_start(body: bytes, message: str) -> int:
    """The offset in ``body`` of the first byte of the line that ``message`` ("... line N: ...") names."""
    number = int(re.search(r"line (\d+)", message)[1])
    return sum(map(len, body.splitlines(keepends=True)[: number - 1]))


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_file_a_folder_and_a_glob_give_their_files_lines_in_order(tmp_path):
    write(tmp_path / "b.txt", "b1\nb2\n")
    write(tmp_path / "a" / "x.txt", "a1\n\n")
    write(tmp_path / "notes.md", "not read from a folder\n")
    assert texts(corpus_source(str(tmp_path / "b.txt"), "text")) == [("b1",), ("b2",)]
    assert texts(corpus_source(str(tmp_path), "text")) == [("a1",), ("",), ("b1",), ("b2",)]  # a/x.txt, b.txt
    assert texts(corpus_source(str(tmp_path / "*.md"), "text")) == [("not read from a folder",)]
    for path, message in (
        (tmp_path / "nowhere.txt", r"data.path: file .*nowhere.txt does not exist"),
        (tmp_path / "*.csv", r"data.path: no file matches .*\*.csv"),
        (tmp_path / "a" / "empty", r"data.path: folder .*empty holds no .txt, .jsonl or .parquet file"),
    ):
        if path.name == "empty":
            path.mkdir()
        with pytest.raises(FileNotFoundError, match=message):
            corpus_source(str(path), "text")
    write(tmp_path / "c.jsonl", '{"text": "c"}\n')
    with pytest.raises(ValueError, match=r"data.path: .* mixes jsonl and text files; name files of one kind"):
        corpus_source(str(tmp_path), "text")


def test_records_give_their_named_field_dotted_for_nested_ones(tmp_path):
    path = write(tmp_path / "docs.jsonl", '{"text": "one", "id": 1}\n\n{"text": "two\\nlines"}\n{"text": ""}\n')
    assert texts(corpus_source(str(path), "text")) == [("one",), ("two\nlines",), ("",)]  # blank lines are no records
    nested = write(tmp_path / "n" / "t.jsonl", '{"meta": {"body": "x"}}\n')
    assert texts(corpus_source(str(nested), "meta.body")) == [("x",)]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"body": "x"}', r"line 2: no field 'text' \(the record has body\); set data.text_field"),
        ('{"text": 3}', r"line 2: field 'text' holds int, not text"),
        ('{"text": "a\\u0000b"}', r"line 2: field 'text' holds a NUL character: binary data, not text"),
        ('{"text": "x"', r"line 2: not JSON \(Expecting ',' delimiter, column 13\); write one JSON object per line"),
        ('["text"]', r"line 2: no field 'text' \(the record has list\)"),
    ],
    ids=["no field", "not a string", "NUL", "not JSON", "not an object"],
)
def test_a_bad_record_names_the_file_the_line_and_the_field(tmp_path, line, message):
    path = write(tmp_path / "docs.jsonl", '{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"^data.path: {re.escape(str(path))} {message}"):
        texts(corpus_source(str(path), "text"))


def test_a_corpus_without_text_or_with_binary_bytes_is_one_line(tmp_path):
    for name, raw in (("empty.txt", b""), ("blank.txt", b" \n\n\t\n")):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ValueError, match=rf"^data.path: {re.escape(str(tmp_path / name))} holds no text$"):
            texts(corpus_source(str(tmp_path / name), "text"))
    (tmp_path / "image.txt").write_bytes(b"GIF89a\n\x01\x00\xff\x00")
    with pytest.raises(ValueError, match=r"image.txt line 2: a NUL byte at column 2: this is binary data, not text"):
        texts(corpus_source(str(tmp_path / "image.txt"), "text"))
    (tmp_path / "zeros.txt").write_bytes(b"text\nm\xf6re \x00\x00")  # the first of the two errors counts
    with pytest.raises(ValueError, match=r"zeros.txt line 2: byte 0xf6 at column 2 is not UTF-8"):
        texts(corpus_source(str(tmp_path / "zeros.txt"), "text"))


def test_parallel_files_read_in_step_and_are_checked(tmp_path):
    src, tgt = write(tmp_path / "train.en", "A.\nB.\nC.\n"), write(tmp_path / "train.de", "Ä.\nB.\nC.\n")
    assert texts(ParallelFiles(src, tgt, "data.train_split"), size=2) == [("A.", "Ä."), ("B.", "B."), ("C.", "C.")]
    write(tgt, "Ä.\nB.\nC.\nD.\nE.\n")
    with pytest.raises(ValueError, match=rf"data.train_split: {src} has 3 lines but {tgt} has 5; line i of one"):
        texts(ParallelFiles(src, tgt, "data.train_split"), size=2)
    write(tgt, "Ä.\nB.\n \n")
    with pytest.raises(ValueError, match=rf"{tgt} line 3 is empty; remove the pair from both train.en and train.de"):
        texts(ParallelFiles(src, tgt, "data.train_split"), size=2)


PAIRS = [("A dog.", "Ein Hund."), ("A cat.", "Eine Katze."), ("Two birds.", "Zwei Vögel.")]


def pair_layouts(tmp_path):
    """The same pairs as {split}.{lang} files, JSON lines and Parquet with HF's translation records."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    write(tmp_path / "files" / "train.en", "".join(e + "\n" for e, _ in PAIRS))
    write(tmp_path / "files" / "train.de", "".join(d + "\n" for _, d in PAIRS))
    records = [{"translation": {"en": e, "de": d}} for e, d in PAIRS]
    write(tmp_path / "jsonl" / "train.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "parquet" / "train.parquet", row_group_size=2)
    return [str(tmp_path / name) for name in ("files", "jsonl", "parquet")]


def test_every_layout_of_pairs_gives_the_same_pairs(tmp_path):
    for folder in pair_layouts(tmp_path):
        source = pair_source(folder, "train", "train", ("en", "de"), ("translation.en", "translation.de"))
        assert texts(source, size=2) == PAIRS, folder
    with pytest.raises(
        FileNotFoundError,
        match=r"data.val_split: file .*val.en does not exist \(expected val.en and val.de, val.jsonl or val.parquet in",
    ):
        pair_source(str(tmp_path / "jsonl"), "val", "val", ("en", "de"), ("translation.en", "translation.de"))


def test_a_parquet_record_without_the_field_or_with_an_empty_sentence_names_the_row(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"en": "A.", "de": "B."}, {"en": "C.", "de": " "}]), path)
    source = pair_source(str(tmp_path), "train", "train", ("en", "de"), ("en", "de"))
    assert source.text_bytes() >= len("A.B.C. ")  # the columns' uncompressed bytes
    with pytest.raises(ValueError, match=rf"data.train_split: {path} row 2: field 'de' is empty; remove the record"):
        texts(source)
    source = pair_source(str(tmp_path), "train", "train", ("en", "de"), ("translation.en", "translation.de"))
    with pytest.raises(
        ValueError, match=rf"{path}: no column 'translation' \(its columns: en, de\); set data.src_field"
    ):
        texts(source)


def test_a_hugging_face_dataset_name_reads_through_datasets(tmp_path):
    """``hf:FOLDER`` goes through ``datasets.load_dataset(FOLDER, split=..., streaming=True)``, the call that reads
    a hub dataset when online: its splits are the data files' names."""
    pytest.importorskip("datasets")
    write(tmp_path / "train.jsonl", "".join(json.dumps({"translation": {"en": e, "de": d}}) + "\n" for e, d in PAIRS))
    write(tmp_path / "validation.jsonl", json.dumps({"translation": {"en": "X.", "de": "Y."}}) + "\n")
    fields = ("translation.en", "translation.de")
    assert texts(pair_source(f"hf:{tmp_path}", "train", "train", ("en", "de"), fields), size=2) == PAIRS
    assert texts(pair_source(f"hf:{tmp_path}", "val", "validation", ("en", "de"), fields)) == [("X.", "Y.")]
    with pytest.raises(ValueError, match=r"data.test_split: hf:.* split 'test' cannot be read \(Bad split: test"):
        texts(pair_source(f"hf:{tmp_path}", "test", "test", ("en", "de"), fields))
    with pytest.raises(
        ValueError, match=r"split 'train' row 1: no field 'text' \(the record has translation\); set data.text_field"
    ):
        texts(corpus_source(f"hf:{tmp_path}", "text"))
