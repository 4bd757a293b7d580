"""Reading users' files, and the dataset-size checks every DataModule shares.

Bad input is a one-line error that names the file and the record (a ValueError or
FileNotFoundError, which the CLI prints as ``attnlab: error: ...``), or a skip counted in one
warning; never a traceback from deep inside PIL or torch, never a silently wrong run.
"""

from __future__ import annotations

import codecs
import sys
from pathlib import Path

from PIL import Image
from pytorch_lightning.utilities import rank_zero_warn


def read_lines(path: str | Path, key: str) -> list[str]:
    """Lines of a UTF-8 file without line endings (a leading byte-order mark is dropped); ``key``
    names the setting the path came from.

    ``path`` "-" reads standard input. Errors name the file (and the line, for bad bytes).
    """
    if str(path) == "-":
        raw, name = sys.stdin.buffer.read(), "<stdin>"
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(
                f"{key}: file {p} does not exist" if not p.exists() else f"{key}: {p} is not a file"
            )
        try:
            raw = p.read_bytes()
        except OSError as err:
            raise ValueError(f"{key}: cannot read {p}: {err.strerror}") from err
        name = str(p)
    lines = []
    for number, line in enumerate(raw.removeprefix(codecs.BOM_UTF8).splitlines(), start=1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{name} line {number}: byte 0x{line[err.start]:02x} at column {err.start + 1} is not UTF-8; convert the file to UTF-8"
            ) from err
    return lines


def open_image(path: str | Path, mode: str) -> Image.Image:
    """The decoded image at ``path`` in ``mode`` ("RGB", "L"). A file that cannot be decoded
    (truncated, empty, not an image) is a ValueError naming it: it is found only when read."""
    try:
        with Image.open(path) as image:
            return image.convert(mode)
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, struct.error, ... for a bad file
        raise ValueError(
            f"{path}: cannot read the image ({type(err).__name__}: {err}); replace or remove the file"
        ) from err


def check_train_batches(num_samples: int, batch_size: int, drop_last: bool, what: str) -> None:
    """Refuse a training set that would run no optimizer step; warn when one batch holds all of it.

    ``what`` names the data (a file or folder) in the messages.
    """
    if num_samples == 0:
        raise ValueError(f"{what}: no training samples")
    if num_samples < batch_size and drop_last:
        raise ValueError(
            f"data.batch_size={batch_size} is larger than the {num_samples} training samples of {what}; the incomplete last "
            "batch is dropped, so no training step would run: lower data.batch_size"
        )
    if num_samples < batch_size:
        rank_zero_warn(
            f"data.batch_size={batch_size} is larger than the {num_samples} training samples of {what}: each epoch is one batch of {num_samples}"
        )


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
