"""Where text comes from, read in batches of bounded size: text files (one, a folder, a glob), JSON-lines and
Parquet records with named fields, aligned ``{split}.{lang}`` files, and Hugging Face datasets (``hf:NAME[:CONFIG]``,
a hub name when online or a local folder of data files, through ``datasets.load_dataset(..., streaming=True)``).

Each source yields batches as tuples of equal-length lists of strings, one list per field: the text of a line or
record for a language-model corpus, the source and target sentences for pairs. Bad input stops the reading with one
line that names the setting, the file and the line (or row): bytes that are not UTF-8, a NUL byte (binary data), a
record that is not JSON or lacks the field, an empty sentence, files of pairs with different line counts, a source
with no text. Memory holds one block of a file (4 MB, or the longest line) and one batch.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

BLOCK = 1 << 22  # bytes read from a text file at a time
KINDS = {".jsonl": "jsonl", ".parquet": "parquet"}  # any other suffix is plain text


def _fingerprint(paths: list[Path]) -> list[tuple[str, int, int]]:
    stats = [(p.resolve(), p.stat()) for p in paths]
    return [(str(p), s.st_size, s.st_mtime_ns) for p, s in stats]


def _chunks(lines: list[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(lines), size):
        yield lines[start : start + size]


def _position(data: bytes, at: int, before: int) -> tuple[int, bytes]:
    """(line number, the line's bytes before it) of byte ``at`` of ``data``, whose first line is line ``before + 1``."""
    lines = data[:at].splitlines(keepends=True) or [b""]
    if lines[-1].endswith((b"\n", b"\r")):
        return before + len(lines) + 1, b""
    return before + len(lines), lines[-1]


def _not_utf8(data: bytes, err: UnicodeDecodeError, before: int, where: str) -> ValueError:
    line, head = _position(data, err.start, before)
    return ValueError(
        f"{where} line {line}: byte 0x{data[err.start]:02x} at column {len(head) + 1} is not UTF-8; convert the file to UTF-8"
    )


def _decoded(data: bytes, before: int, where: str) -> str:
    """``data`` as text; the first of a byte that is not UTF-8 and a NUL byte (binary data) is an error."""
    nul = data.find(b"\x00")
    try:
        text = data.decode("utf-8") if nul < 0 else data[:nul].decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(data, err, before, where) from None
    if nul >= 0:
        line, head = _position(data, nul, before)
        raise ValueError(
            f"{where} line {line}: a NUL byte at column {len(head.decode()) + 1}: this is binary data, not text"
        )
    return text


def read_text_lines(path: Path, where: str) -> Iterator[list[str]]:
    """The lines of a UTF-8 text file without their ends (``\\n``, ``\\r\\n`` or ``\\r``; a leading byte-order mark
    is dropped), in blocks of about `BLOCK` bytes. ``where`` starts the error messages ("data.path: FILE")."""
    before, rest = 0, b""
    with open(path, "rb") as f:
        if f.read(3) != b"\xef\xbb\xbf":
            f.seek(0)
        while True:
            chunk = f.read(BLOCK)
            data = rest + chunk
            cut = data.rfind(b"\n") + 1 if chunk else len(data)
            data, rest = data[:cut], data[cut:]
            if data:
                lines = _decoded(data, before, where).replace("\r\n", "\n").replace("\r", "\n").split("\n")
                if lines[-1] == "":
                    lines.pop()  # the block ended with a line end
                before += len(lines)
                yield lines
            if not chunk:
                return


@dataclass
class TextFiles:
    """Plain text files, one field: each line. ``name`` is what the user gave (a file, folder or glob)."""

    paths: list[Path]
    name: str
    key: str

    def fingerprint(self) -> dict:
        return {"text files": _fingerprint(self.paths)}

    def text_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    def batches(self, size: int) -> Iterator[tuple[list[str]]]:
        any_text = False
        for path in self.paths:
            for lines in read_text_lines(path, f"{self.key}: {path}"):
                any_text = any_text or any(s.strip() for s in lines)
                yield from ((chunk,) for chunk in _chunks(lines, size))
        if not any_text:
            raise ValueError(f"{self.key}: {self.name} holds no text")


@dataclass
class ParallelFiles:
    """Aligned sentence files (the Multi30k layout): line i of ``src`` translates line i of ``tgt``."""

    src: Path
    tgt: Path
    key: str

    def fingerprint(self) -> dict:
        return {"parallel files": _fingerprint([self.src, self.tgt])}

    def text_bytes(self) -> int:
        return self.src.stat().st_size + self.tgt.stat().st_size

    def _lines(self, path: Path) -> Iterator[str]:
        return (line for lines in read_text_lines(path, f"{self.key}: {path}") for line in lines)

    def batches(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        src, tgt, before = self._lines(self.src), self._lines(self.tgt), 0
        while True:
            pair = list(islice(src, size)), list(islice(tgt, size))
            if len(pair[0]) != len(pair[1]):
                counts = before + len(pair[0]) + sum(1 for _ in src), before + len(pair[1]) + sum(1 for _ in tgt)
                raise ValueError(
                    f"{self.key}: {self.src} has {counts[0]} lines but {self.tgt} has {counts[1]}; line i of one must translate line i of the other"
                )
            if not pair[0]:
                break
            for path, lines in zip((self.src, self.tgt), pair):
                empty = next((i for i, s in enumerate(lines) if not s.strip()), None)
                if empty is not None:
                    raise ValueError(
                        f"{self.key}: {path} line {before + empty + 1} is empty; remove the pair from both {self.src.name} and {self.tgt.name}"
                    )
            before += len(pair[0])
            yield pair
        if before == 0:
            raise ValueError(f"{self.key}: {self.src} and {self.tgt} hold no sentences")


def _field(record, dotted: str):
    for part in dotted.split("."):
        if not isinstance(record, dict) or part not in record:
            raise KeyError(dotted)
        record = record[part]
    return record


@dataclass
class Records:
    """Records with named fields: JSON lines, Parquet files, or a Hugging Face dataset (``hub``: (name, config,
    split)). ``fields``: setting -> dotted field path (``translation.en`` reads record["translation"]["en"]);
    ``allow_empty``: whether an empty string is a record's text (a document may be empty, a sentence not)."""

    paths: list[Path]
    kind: str  # "jsonl", "parquet" or "hf"
    fields: dict[str, str]
    key: str
    allow_empty: bool
    hub: tuple[str, str | None, str] | None = None

    def fingerprint(self) -> dict:
        if self.hub is not None and not self.paths:
            from datamodules.text.arrow_sources import hub_revision

            return {"hub": [*self.hub, hub_revision(self.hub[0])], "fields": self.fields}
        return {self.kind: _fingerprint(self.paths), "fields": self.fields, "hub": self.hub}

    def text_bytes(self) -> int | None:
        if self.kind == "parquet":
            from datamodules.text.arrow_sources import parquet_text_bytes

            return sum(parquet_text_bytes(p, self._tops()) for p in self.paths)
        return sum(p.stat().st_size for p in self.paths) if self.paths else None

    def _tops(self) -> list[str]:
        return list(dict.fromkeys(f.split(".")[0] for f in self.fields.values()))

    def batches(self, size: int) -> Iterator[tuple[list[str], ...]]:
        if self.kind == "jsonl":
            yield from self._json_batches(size)
            return
        from datamodules.text.arrow_sources import hub_batches, parquet_batches

        if self.kind == "parquet":
            for path in self.paths:
                yield from parquet_batches(path, self.fields, size, self._check, f"{self.key}: {path}")
        else:
            yield from hub_batches(*self.hub, self.fields, size, self._check, self.key)

    def _json_batches(self, size: int) -> Iterator[tuple[list[str], ...]]:
        for path in self.paths:
            batch, where = [], f"{self.key}: {path}"
            with open(path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    if raw.strip():
                        batch.append(self._json_record(raw, number, where))
                    if len(batch) == size:
                        yield tuple(map(list, zip(*batch)))
                        batch = []
            if batch:
                yield tuple(map(list, zip(*batch)))

    def _json_record(self, raw: bytes, number: int, where: str) -> list[str]:
        try:
            record = json.loads(raw.rstrip(b"\r\n"))
        except UnicodeDecodeError as err:
            raise _not_utf8(raw, err, number - 1, where) from None
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where} line {number}: not JSON ({err.msg}, column {err.colno}); write one JSON object per line"
            ) from None
        return [
            self._check(record, setting, dotted, f"{where} line {number}") for setting, dotted in self.fields.items()
        ]

    def _check(self, record, setting: str, dotted: str, where: str) -> str:
        """The text of field ``dotted`` of ``record`` (named by ``setting``), checked."""
        try:
            text = _field(record, dotted)
        except KeyError:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: no field {dotted!r} (the record has {keys}); set {setting}") from None
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {dotted!r} holds {type(text).__name__}, not text")
        if "\x00" in text:
            raise ValueError(f"{where}: field {dotted!r} holds a NUL character: binary data, not text")
        if not self.allow_empty and not text.strip():
            raise ValueError(f"{where}: field {dotted!r} is empty; remove the record")
        return text


def _files(path: str, key: str) -> list[Path]:
    """The files that ``path`` names: itself, the data files below a folder, or a glob's matches (sorted)."""
    p = Path(path).expanduser()
    if glob.has_magic(path):
        files = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not files:
            raise FileNotFoundError(f"{key}: no file matches {path}")
        return files
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", *KINDS) and f.is_file())
        if not files:
            raise FileNotFoundError(f"{key}: folder {path} holds no .txt, .jsonl or .parquet file")
        return files
    if not p.is_file():
        raise FileNotFoundError(f"{key}: file {path} does not exist")
    return [p]


def _hub(path: str) -> tuple[str, str | None]:
    name, _, config = path.removeprefix("hf:").partition(":")
    return name, config or None


def corpus_source(path: str, text_field: str, key: str = "data.path") -> TextFiles | Records:
    """The language-model corpus ``path``: a text file, a folder or glob of .txt, .jsonl or .parquet files, or
    ``hf:NAME[:CONFIG]`` (its train split). Records give their ``text_field``."""
    fields = {"data.text_field": text_field}
    if path.startswith("hf:"):
        name, config = _hub(path)
        local = _files(name, key) if Path(name).expanduser().is_dir() else []
        return Records(local, "hf", fields, key, allow_empty=True, hub=(name, config, "train"))
    files = _files(path, key)
    kinds = {KINDS.get(f.suffix, "text") for f in files}
    if len(kinds) > 1:
        raise ValueError(
            f"{key}: {path} mixes {' and '.join(sorted(kinds))} files; name files of one kind (a glob such as {path}/*.txt)"
        )
    kind = kinds.pop()
    return TextFiles(files, path, key) if kind == "text" else Records(files, kind, fields, key, allow_empty=True)


def pair_source(
    data_dir: str, split: str, name: str, langs: tuple[str, str], fields: tuple[str, str]
) -> ParallelFiles | Records:
    """The sentence pairs of split ``name`` (data.``split``_split): ``name.{src}`` and ``name.{tgt}`` in
    ``data_dir``, else ``name.jsonl`` or ``name.parquet`` there (fields ``fields``), or split ``name`` of
    ``hf:NAME[:CONFIG]``."""
    key, settings = f"data.{split}_split", {"data.src_field": fields[0], "data.tgt_field": fields[1]}
    if data_dir.startswith("hf:"):
        hub_name, config = _hub(data_dir)
        local = _files(hub_name, key) if Path(hub_name).expanduser().is_dir() else []
        return Records(local, "hf", settings, key, allow_empty=False, hub=(hub_name, config, name))
    folder = Path(data_dir)
    src, tgt = (folder / f"{name}.{lang}" for lang in langs)
    if src.is_file() and tgt.is_file():
        return ParallelFiles(src, tgt, key)
    for suffix, kind in KINDS.items():
        if (folder / f"{name}{suffix}").is_file():
            return Records([folder / f"{name}{suffix}"], kind, settings, key, allow_empty=False)
    missing = tgt if src.is_file() else src
    raise FileNotFoundError(
        f"{key}: file {missing} does not exist (expected {src.name} and {tgt.name}, {name}.jsonl or {name}.parquet in {folder})"
    )
