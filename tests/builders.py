"""Tiny models and batches that several test files build (`from builders import tiny_seq2seq`, as
`from conftest import TINY_TRUNK`: pytest puts tests/ on sys.path)."""

import subprocess
import sys
from collections.abc import Callable, Iterable

import pytorch_lightning as pl
import torch

from datamodules.text.tokenizers import PAD_ID
from models.text.lm import DecoderOnlyLM
from models.text.seq2seq import Seq2SeqTransformer
from models.vision.vit import VisionTransformer


def encoder_decoder(d_model: int = 32, nhead: int = 4, layers: int = 2, decoder_layers: int | None = None) -> dict:
    """The size arguments of a tiny encoder-decoder (Seq2SeqTransformer, DETR, DETRTransformer): ``layers``
    encoder layers and as many decoder layers unless ``decoder_layers``, an MLP twice as wide as the model."""
    decoder_layers = layers if decoder_layers is None else decoder_layers
    return dict(
        d_model=d_model,
        nhead=nhead,
        num_encoder_layers=layers,
        num_decoder_layers=decoder_layers,
        dim_feedforward=2 * d_model,
    )


# The tiny encoder-decoder of the text and DETR tests: 2 + 2 layers of width 32, 4 heads, no dropout.
SMALL = encoder_decoder() | dict(dropout=0.0)

# A detection datamodule at the tests' size: one 32-pixel training scale, 32-pixel validation images, no crop.
SMALL_DETECTION = dict(num_workers=0, train_scales=[32], max_size=64, crop=False, val_size=32)


def tiny_seq2seq(vocab: int, seed: int = 0, **kw) -> Seq2SeqTransformer:
    """A random `SMALL` Seq2SeqTransformer of 64 positions in eval mode; ``kw`` overrides or adds arguments."""
    torch.manual_seed(seed)
    return Seq2SeqTransformer(vocab, vocab, **{**SMALL, "max_positions": 64, **kw}).eval()


def tiny_lm(vocab: int, positions: str, max_positions: int, d_model: int = 20, nhead: int = 2) -> DecoderOnlyLM:
    """A random 2-layer DecoderOnlyLM without dropout in eval mode (seed 2), for the generation tests."""
    torch.manual_seed(2)
    lm = DecoderOnlyLM(
        vocab, d_model=d_model, nhead=nhead, num_layers=2, dropout=0.0, max_positions=max_positions, positions=positions
    )
    return lm.eval()


def padded_batch(vocab: int, lengths: list[int], seed: int = 1) -> torch.Tensor:
    """(B, max length) random words (ids 4..vocab-1, after the specials), PAD after each sentence."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), max(lengths)), PAD_ID)
    for i, n in enumerate(lengths):
        out[i, :n] = torch.randint(4, vocab, (n,), generator=g)
    return out


def tiny_vit(embed_dim: int = 16, depth: int = 2, num_heads: int = 2, **kw) -> VisionTransformer:
    """A ViT of 8x8 one-channel images in 2x2 patches (16 of them), 10 classes; ``kw`` overrides or adds arguments."""
    size = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10)
    return VisionTransformer(**size | dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads) | kw)


class CallCounter(pl.Callback):
    """A callback that counts, in ``calls``, the calls to the functions that `count` wraps in place (the host's
    reads of tensor values, torch.distributed's collectives): a subclass says when to read and reset it."""

    calls = 0

    def count(self, owner: object, names: Iterable[str], patch: Callable = setattr) -> None:
        """Count the calls to ``owner``'s functions ``names`` from now on; ``patch``: `setattr`, or pytest's
        ``monkeypatch.setattr``, which puts them back after the test."""
        for name in names:
            patch(owner, name, self._counted(getattr(owner, name)))

    def _counted(self, function: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.calls += 1
            return function(*args, **kwargs)

        return counted


def gone_pid() -> int:
    """The pid of a process that has exited and been reaped: the OS no longer knows it (a killed run's)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
