"""The sources read through Apache Arrow: Parquet files (``pyarrow``) and Hugging Face datasets (``datasets``,
which brings ``pyarrow``), imported only when such a source is used (``pip install 'attnlab[hf-data]'``).

Both yield batches of records as `datamodules.text.sources.Records` does, each field checked by its ``check``
(the record, the setting, the dotted field, where the record is) so errors read alike for every source.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from pathlib import Path

Check = Callable[[dict, str, str, str], str]


def _library(name: str, key: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(
            f"{key}: reading this source needs the {name.split('.')[0]} package: pip install 'attnlab[hf-data]'"
        ) from None


def _records(rows: list[dict], first: int, fields: dict[str, str], check: Check, where: str) -> tuple[list[str], ...]:
    return tuple(
        [check(r, setting, dotted, f"{where} row {first + i}") for i, r in enumerate(rows)]
        for setting, dotted in fields.items()
    )


def _tops(fields: dict[str, str]) -> list[str]:
    return list(dict.fromkeys(f.split(".")[0] for f in fields.values()))


def parquet_batches(path: Path, fields: dict[str, str], size: int, check: Check, where: str) -> Iterator[tuple]:
    """The records of one Parquet file, ``size`` rows at a time (rows counted from 1 in messages)."""
    pq = _library("pyarrow.parquet", where)
    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001  pyarrow raises ArrowInvalid, OSError, ... for a file it cannot read
        raise ValueError(f"{where}: not a Parquet file ({str(err).splitlines()[0]})") from None
    columns = file.schema_arrow.names
    for setting, dotted in fields.items():
        if dotted.split(".")[0] not in columns:
            raise ValueError(
                f"{where}: no column {dotted.split('.')[0]!r} (its columns: {', '.join(columns)}); set {setting}"
            )
    row = 1
    for batch in file.iter_batches(batch_size=size, columns=_tops(fields)):
        rows = batch.to_pylist()
        yield _records(rows, row, fields, check, where)
        row += len(rows)


def parquet_text_bytes(path: Path, tops: list[str]) -> int:
    """The uncompressed bytes of the columns ``tops`` of a Parquet file (the text's size, about)."""
    pq = _library("pyarrow.parquet", str(path))
    meta = pq.ParquetFile(path).metadata
    return sum(
        column.total_uncompressed_size
        for group in range(meta.num_row_groups)
        for column in (meta.row_group(group).column(i) for i in range(meta.num_columns))
        if column.path_in_schema.split(".")[0] in tops
    )


def hub_batches(
    name: str, config: str | None, split: str, fields: dict[str, str], size: int, check: Check, key: str
) -> Iterator[tuple]:
    """The records of split ``split`` of the dataset ``name`` (a hub name, or a local folder of data files),
    streamed by ``datasets.load_dataset``: nothing is downloaded or converted beside the store."""
    datasets = _library("datasets", key)
    where = f"{key}: hf:{name}{':' + config if config else ''} split {split!r}"
    try:
        stream = datasets.load_dataset(name, config, split=split, streaming=True)
        batches = iter(stream.iter(batch_size=size))
        first = next(batches, None)
    except Exception as err:  # noqa: BLE001  datasets raises many kinds: no such dataset, split, config, network
        raise ValueError(f"{where} cannot be read ({str(err).splitlines()[0]})") from None
    row = 1
    while first is not None:
        rows = [dict(zip(first, values)) for values in zip(*first.values())]
        yield _records(rows, row, fields, check, where)
        row += len(rows)
        first = next(batches, None)


def hub_revision(name: str) -> str | None:
    """The commit of the hub dataset ``name`` (None offline or unknown): a new commit makes a new store."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(name).sha
    except Exception:  # noqa: BLE001  offline, no such dataset, no network: the name alone keys the store
        return None
