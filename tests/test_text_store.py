"""The text DataModules on the token store: the ids and batches of the text read whole and encoded at once, from
every source; a second run maps the store and prepares nothing; bad input is one line and leaves no store."""

import json
import pickle
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models

from datamodules.text import prepare as text_prepare
from datamodules.text import token_store
from datamodules.text.batching import LengthBucketSampler
from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.text.token_store import TokenWriter, open_array
from datamodules.text.tokenizers import EOS_ID, build_tokenizer

LINES = ["First Citizen:", "Before we proceed, hear me speak.", "", "  Ünïcode: ä ß — ok", "All:", "Speak, speak."]


def corpus(tmp_path, lines=LINES, repeat=30, name="c.txt"):
    """A text file of ``lines`` repeated, with Windows line ends and no final one (read as ``\\n`` lines)."""
    random.seed(0)
    body = [random.choice(lines) for _ in range(len(lines) * repeat)]
    path = tmp_path / name
    path.write_bytes("\r\n".join(body).encode())
    return path, body


def store_ids(dm) -> list[int]:
    return open_array(*dm.store, "corpus.ids")[:].tolist()


def left_in(cache) -> list[str]:
    """What a preparation left in the cache besides lock files: stores and temporary folders."""
    tokens = cache / "tokens"
    return sorted(p.name for p in tokens.iterdir() if p.suffix != ".lock") if tokens.exists() else []


def test_a_char_corpus_gives_the_ids_of_the_whole_text_encoded_at_once(tmp_path, monkeypatch):
    """The oracle is the text read whole: the tokenizers library trains on its first 90% of characters (in lines,
    line ends kept) and encodes it in one call. The store is written in batches of 7 lines."""
    monkeypatch.setattr(text_prepare, "BATCH", 7)
    path, lines = corpus(tmp_path)
    dm = TextCorpusDataModule(str(path), cache_dir=str(tmp_path / "cache"), block_size=16)
    text = "\n".join(lines) + "\n"
    oracle = build_tokenizer("char", text[: int(len(text) * 0.9)].splitlines(keepends=True))
    assert dm.tokenizer.to_str() == oracle.to_str()
    assert store_ids(dm) == oracle.encode(text, add_special_tokens=False).ids
    meta = dm.store[1]
    assert meta["dtype"] == "uint16" and (dm.store[0] / "corpus.ids").stat().st_size == 2 * len(text)
    dm.setup("fit")
    n_train = int(len(text) * 0.9)
    assert dm.val_set[0]["input"].tolist() == oracle.encode(text[n_train : n_train + 16]).ids


def test_files_folders_jsonl_parquet_and_hf_give_the_ids_of_the_same_text(tmp_path):
    """Each line of a text, or record of a dataset, followed by a line end: every source of the same lines is the
    same token stream (bpe)."""
    path, lines = corpus(tmp_path)
    (tmp_path / "parts").mkdir()
    for i, part in enumerate((lines[:50], lines[50:])):
        (tmp_path / "parts" / f"{i}.txt").write_text("".join(line + "\n" for line in part))
    records = [{"text": line, "id": i} for i, line in enumerate(lines)]
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    paths = [path, tmp_path / "parts", tmp_path / "parts" / "*.txt", tmp_path / "jsonl" / "train.jsonl"]
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "docs.parquet", row_group_size=40)
    paths.append(tmp_path / "docs.parquet")
    if pytest.importorskip("datasets"):
        paths.append(f"hf:{tmp_path / 'jsonl'}")
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=80, block_size=8)
    ids = [store_ids(TextCorpusDataModule(str(p), **settings)) for p in paths]
    assert all(x == ids[0] for x in ids[1:]) and len(ids[0]) > 100


def test_a_second_run_maps_the_store_and_a_changed_file_or_setting_prepares_again(tmp_path, monkeypatch, capsys):
    path, _ = corpus(tmp_path)
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=60, block_size=8)
    first = TextCorpusDataModule(str(path), **settings)
    assert first.vocab_size <= 60 and "attnlab: token store" in capsys.readouterr().err

    def no_preparation(*args):
        raise AssertionError("prepared again")

    with monkeypatch.context() as patch:
        patch.setattr(text_prepare, "build_tokenizer", no_preparation)
        patch.setattr(TokenWriter, "add", no_preparation)
        second = TextCorpusDataModule(str(path), **settings)
        second.setup("fit")
        assert second.tokenizer.to_str() == first.tokenizer.to_str() and second.store == first.store
        assert next(iter(second.train_dataloader()))["input"].shape == (64, 8)
    assert "token store" not in capsys.readouterr().err
    other = TextCorpusDataModule(str(path), **{**settings, "bpe_vocab_size": 50})
    path.write_text(path.read_text() + "\nA new line.")
    changed = TextCorpusDataModule(str(path), **settings)
    assert len({first.store[0], other.store[0], changed.store[0]}) == 3 and other.vocab_size <= 50
    assert len(store_ids(changed)) > len(store_ids(first))


def test_a_token_array_dataset_pickles_without_its_data(tmp_path):
    path, _ = corpus(tmp_path, repeat=300)
    dm = TextCorpusDataModule(str(path), cache_dir=str(tmp_path / "cache"), block_size=16)
    dm.setup("fit")
    copy = pickle.loads(pickle.dumps(dm.train_set))  # what a loader worker started by spawn or forkserver gets
    assert len(pickle.dumps(dm.train_set)) < 2000 < len(store_ids(dm))
    assert np.array_equal(copy.data[:101], dm.train_set.data[:101])


def test_ids_beyond_uint16_are_stored_as_uint32_or_refused_when_uint16_is_asked(tmp_path):
    """A BPE over 66,000 distinct characters, and a given tokenizer whose added tokens pass 65,536 ids."""
    chars = [chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c < 0xE000][:66_000]
    path = tmp_path / "many.txt"
    path.write_text("".join("".join(chars[i : i + 100]) + "\n" for i in range(0, len(chars), 100)) * 2)
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=70_000, block_size=8)
    wide = TextCorpusDataModule(str(path), **settings)
    assert wide.vocab_size > 1 << 16 and wide.store[1]["dtype"] == "uint32"
    last = wide.tokenizer.encode(path.read_text().splitlines()[-1] + "\n").ids  # the last line, encoded alone
    assert max(store_ids(wide)) >= 1 << 16 and store_ids(wide)[-len(last) :] == last
    refused = r"^data.token_dtype=uint16: the tokenizer has {} ids \(added tokens included\), more than uint16 holds \(65536\)"
    with pytest.raises(ValueError, match=refused.format(70000)):  # before any training
        TextCorpusDataModule(str(path), token_dtype="uint16", **settings).vocab_size
    given = Tokenizer(models.WordLevel({f"w{i}": i for i in range(65_530)}, unk_token="w3"))
    given.add_tokens([f"<extra{i}>" for i in range(10)])
    given.save(str(tmp_path / "tokenizer.json"))
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="pretrained", tokenizer_dir=str(tmp_path))
    with pytest.raises(ValueError, match=refused.format(65540)):
        TextCorpusDataModule(str(path), token_dtype="uint16", **settings).setup("fit")
    assert TextCorpusDataModule(str(path), **settings).store[1]["dtype"] == "uint32"
    assert len(left_in(tmp_path / "cache")) == 2  # the two stores made, nothing of the refused ones
    with pytest.raises(ValueError, match="data.token_dtype='int8' is not an id type"):
        TextCorpusDataModule(str(path), token_dtype="int8")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", b"", r"data.path: .*empty.txt holds no text"),
        (
            "binary.txt",
            b"\x7fELF\x02\x01\x01\x00\x00\x00",
            r"data.path: .*binary.txt line 1: a NUL byte at column 8: this is binary data, not text",
        ),
        ("latin1.txt", b"to be\nor n\xf6t\n", r"data.path: .*latin1.txt line 2: byte 0xf6 at column 5 is not UTF-8"),
        (
            "docs.jsonl",
            b'{"text": "a"}\n{"body": "b"}\n',
            r"data.path: .*docs.jsonl line 2: no field 'text' \(the record has body\); set data.text_field",
        ),
    ],
    ids=["empty", "binary", "not UTF-8", "jsonl without the field"],
)
@pytest.mark.parametrize("tokenizer", ["char", "pretrained"])
def test_bad_input_is_one_line_and_leaves_no_store(tmp_path, name, content, message, tokenizer):
    """Whether the text is met in training a tokenizer (char) or only in encoding it (a given tokenizer)."""
    (tmp_path / name).write_bytes(content)
    given = {}
    if tokenizer == "pretrained":
        build_tokenizer("char", ["abc"]).save(str(tmp_path / "tokenizer.json"))
        given = dict(tokenizer="pretrained", tokenizer_dir=str(tmp_path))
    dm = TextCorpusDataModule(str(tmp_path / name), cache_dir=str(tmp_path / "cache"), **given)
    with pytest.raises(ValueError, match=message):
        dm.setup("fit")
    assert left_in(tmp_path / "cache") == []


def test_an_interrupted_preparation_leaves_nothing_and_the_next_run_prepares(tmp_path, monkeypatch):
    path, _ = corpus(tmp_path, repeat=2000)
    monkeypatch.setattr(text_prepare, "BATCH", 500)
    calls, add = [], TokenWriter.add

    def interrupted(self, lengths, ids):
        calls.append(len(lengths))
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C (a SIGKILL: tests/test_token_store.py) half-way through the corpus
        add(self, lengths, ids)

    monkeypatch.setattr(TokenWriter, "add", interrupted)
    settings = dict(cache_dir=str(tmp_path / "cache"), block_size=8)
    with pytest.raises(KeyboardInterrupt):
        TextCorpusDataModule(str(path), **settings).vocab_size
    assert left_in(tmp_path / "cache") == []
    monkeypatch.setattr(TokenWriter, "add", add)
    dm = TextCorpusDataModule(str(path), **settings)
    assert len(store_ids(dm)) == len(path.read_text().replace("\r\n", "\n")) + 1


def test_too_little_disk_or_an_unwritable_cache_is_refused_before_any_work(tmp_path, monkeypatch):
    path, _ = corpus(tmp_path)
    free = type("usage", (), {"free": 1000})()
    with monkeypatch.context() as patch:
        patch.setattr(token_store.shutil, "disk_usage", lambda folder: free)
        patch.setattr(text_prepare, "build_tokenizer", lambda *a: pytest.fail("trained a tokenizer"))
        with pytest.raises(
            ValueError,
            match=r"data.cache_dir: .* has 0.0 MB free, and the token store of .*c.txt may take up to 0.0 MB",
        ):
            TextCorpusDataModule(str(path), cache_dir=str(tmp_path / "cache")).vocab_size
    assert left_in(tmp_path / "cache") == []
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ValueError, match=r"data.cache_dir: cannot write the token store in .*file/tokens .*; set data.cache_dir"
    ):
        TextCorpusDataModule(str(path), cache_dir=str(tmp_path / "file")).vocab_size


# ----------------------------------------------------------------------------- translation


def toy_pairs(tmp_path):
    """The toy corpus's files, and the same pairs as JSON lines and Parquet records (HF's translation layout)."""
    toy = ParallelTextDataModule(cache_dir=str(tmp_path / "cache")).data_dir
    layouts = {"files": toy}
    jsonl, parquet = tmp_path / "jsonl", tmp_path / "parquet"
    jsonl.mkdir(), parquet.mkdir()
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    for split in ("train", "val", "test"):
        en, de = (open(f"{toy}/{split}.{lang}").read().splitlines() for lang in ("en", "de"))
        records = [{"translation": {"en": e, "de": d}} for e, d in zip(en, de)]
        (jsonl / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        pq.write_table(pa.Table.from_pylist(records), parquet / f"{split}.parquet", row_group_size=700)
    return {**layouts, "jsonl": str(jsonl), "parquet": str(parquet)}


def batches(dm, n=2):
    torch.manual_seed(0)
    train = [{k: v for k, v in b.items()} for _, b in zip(range(n), dm.train_dataloader())]
    return train, next(iter(dm.val_dataloader()))


def test_the_toy_tokenizer_and_batches_are_the_library_trained_on_the_lines(tmp_path):
    """The tokenizers library trained on every English then every German training line (shared vocabulary), and
    each sentence encoded alone: the vocabulary, the validation batch, and the training batches' sentences."""
    dm = ParallelTextDataModule(cache_dir=str(tmp_path / "cache"), tokenizer="word", min_frequency=1, max_len=64)
    en, de = (open(f"{dm.data_dir}/train.{lang}").read().splitlines() for lang in ("en", "de"))
    oracle = build_tokenizer("word", en + de, 8000, 1)
    assert dm.tokenizers[0].to_str() == oracle.to_str() and dm.tokenizers[1] is dm.tokenizers[0]
    dm.setup("fit")
    train, val = batches(dm)
    for i, e in zip(val["index"].tolist(), val["src_text"]):
        row = val["src"][val["index"].tolist().index(i)]
        assert row[row != 0].tolist() == oracle.encode(e, add_special_tokens=False).ids + [EOS_ID]
    assert "src_text" not in train[0]  # the training split's text stays on disk
    for i, row in zip(train[0]["index"].tolist(), train[0]["tgt"]):
        assert row[row != 0].tolist()[1:-1] == oracle.encode(de[i], add_special_tokens=False).ids


def test_pairs_from_jsonl_parquet_and_hf_give_the_batches_of_the_multi30k_layout(tmp_path):
    layouts = toy_pairs(tmp_path)
    if pytest.importorskip("datasets"):  # its split names come from the files: train, validation, test
        layouts["hf"] = f"hf:{layouts['jsonl']}"
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="bpe", vocab_size=200, batch_size=16, max_len=12)
    seen = {}
    for name, data_dir in layouts.items():
        dm = ParallelTextDataModule(data_dir, val_split="validation" if name == "hf" else "val", **settings)
        dm.setup("fit")
        seen[name] = dm.tokenizers[0].to_str(), batches(dm)
    reference = seen.pop("files")
    for name, (tokenizer, (train, val)) in seen.items():
        assert tokenizer == reference[0], name
        for ours, theirs in zip([*train, val], [*reference[1][0], reference[1][1]]):
            assert ours.keys() == theirs.keys() and all(
                torch.equal(v, theirs[k]) if torch.is_tensor(v) else v == theirs[k] for k, v in ours.items()
            ), name


def test_length_buckets_are_those_of_the_plain_python_bucketing():
    """fairseq's bucketing written out with lists (shuffle, pools of 50 batches sorted by length, batches shuffled)."""
    lengths = np.random.default_rng(0).integers(1, 60, 1234)

    def plain(seed: int) -> list[int]:
        torch.manual_seed(seed)
        order, size, cut = torch.randperm(len(lengths)).tolist(), 10 * 50, []
        for start in range(0, len(order), size):
            pool = sorted(order[start : start + size], key=lambda i: lengths[i])
            cut += [pool[i : i + 10] for i in range(0, len(pool), 10)]
        return [i for b in torch.randperm(len(cut)).tolist() for i in cut[b]]

    torch.manual_seed(3)
    assert list(LengthBucketSampler(lengths, batch_size=10)) == plain(3)
    torch.manual_seed(3)
    assert list(LengthBucketSampler(lengths.tolist(), batch_size=10)) == plain(3)


def test_a_sample_is_every_kth_batch_across_the_text():
    """By hand: ten batches of 10 characters, 100 in all, and a sample of 30: k = ceil(100 / 30) = 4, so batches 0,
    4 and 8 (30 characters, enough); unknown size: the first batches; no bound: all."""
    first = lambda taken: [b[0][0] for b in taken]  # noqa: E731
    numbered = [([str(i) * 10],) for i in range(10)]
    assert first(text_prepare.sample(iter(numbered), 100, 30)) == ["0" * 10, "4" * 10, "8" * 10]
    assert first(text_prepare.sample(iter(numbered), None, 30)) == first(numbered[:3])
    assert first(text_prepare.sample(iter(numbered), 100, None)) == first(numbered)


def segments(words, lines=10):
    """``lines`` lines of each word repeated, segment after segment."""
    return [f"{w} {w} {w}" for w in words for _ in range(lines)]


def test_a_tokenizer_learns_from_a_sample_spread_over_the_corpus_and_every_line_is_encoded(tmp_path, monkeypatch):
    """Six segments of 10 lines (one batch each), the last 10% held out: 5.4 segments to train on, a sample of two
    segments' characters takes every ceil(5.4 / 2) = 3rd batch, segments 0 and 3. The oracle is the tokenizers
    library trained on those lines alone; the store still holds every line encoded."""
    monkeypatch.setattr(text_prepare, "BATCH", 10)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    lines = segments(words)
    path = tmp_path / "c.txt"
    path.write_text("\n".join(lines) + "\n")
    segment = sum(len(line) + 1 for line in lines[:10])
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="bpe", bpe_vocab_size=60, block_size=8)
    dm = TextCorpusDataModule(str(path), tokenizer_train_chars=2 * segment, **settings)
    sampled = [line + "\n" for line in lines[:10] + lines[30:40]]
    oracle = build_tokenizer("bpe", [sampled], 60, 2)
    assert dm.tokenizer.to_str() == oracle.to_str()
    assert dm.tokenizer.token_to_id("▁delta") is not None and dm.tokenizer.token_to_id("▁bravo") is None
    pieces = oracle.encode_batch([line + "\n" for line in lines], add_special_tokens=False)  # a line is a piece
    assert store_ids(dm) == [i for piece in pieces for i in piece.ids]
    whole = TextCorpusDataModule(str(path), tokenizer_train_chars=None, **settings)
    assert whole.store[0] != dm.store[0] and whole.tokenizer.token_to_id("▁bravo") is not None


def test_pair_tokenizers_learn_from_a_sample_of_the_pairs(tmp_path, monkeypatch):
    """Four segments of 10 pairs (one batch each) and a sample of one segment's characters, both sides: every 4th
    batch, segment 0 only. The oracle: the library trained on its English then its German lines."""
    monkeypatch.setattr(text_prepare, "BATCH", 10)
    en, de = segments(["one", "two", "three", "four"]), segments(["eins", "zwei", "drei", "vier"])
    for split, rows in (("train", slice(None)), ("val", slice(0, 4))):
        (tmp_path / f"{split}.en").write_text("\n".join(en[rows]) + "\n")
        (tmp_path / f"{split}.de").write_text("\n".join(de[rows]) + "\n")
    first = sum(len(s) + 1 for s in en[:10] + de[:10])
    settings = dict(cache_dir=str(tmp_path / "cache"), tokenizer="word", min_frequency=1, test_split=None)
    dm = ParallelTextDataModule(str(tmp_path), tokenizer_train_chars=first, **settings)
    oracle = build_tokenizer("word", [en[:10], de[:10]], 8000, 1)
    assert dm.tokenizers[0].to_str() == oracle.to_str() and dm.tokenizers[0].token_to_id("▁vier") is None
    dm.setup("fit")
    assert len(dm.train_set) == 40  # every pair encoded


@pytest.mark.parametrize("module", [TextCorpusDataModule, ParallelTextDataModule])
def test_a_tokenizer_sample_of_no_characters_is_refused_before_any_work(tmp_path, module):
    with pytest.raises(ValueError, match=r"^data.tokenizer_train_chars=0 must be >= 1, or null to train on all"):
        module(cache_dir=str(tmp_path / "cache"), tokenizer_train_chars=0)
    assert not (tmp_path / "cache" / "tokens").exists()
