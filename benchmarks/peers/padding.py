"""Padded batches (the padding and gpu sections): our attention's key padding by each of its paths, masked
SDPA and the padding-free kernels of `models.core.padding_free`, in self-attention and in the Multi30k step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from benchmarks.harness import Step
from benchmarks.peers.attention import padding_mask
from benchmarks.peers.bench import Bench, Settings, max_diff, train_step
from benchmarks.peers.text import random_sentences, seq2seq_models
from models.core import attention
from models.core.attention import MultiHeadAttention
from models.text.seq2seq import label_smoothed_nll_loss, teacher_forcing

# side -> our attention's padding-free kernels for a key-padding mask (none: the masked SDPA)
PADDING_PATHS: dict[str, tuple[str, ...]] = {"masked SDPA": (), "varlen": ("varlen",), "nested": ("nested",)}


@contextlib.contextmanager
def padding_path(device: torch.device, kernels: tuple[str, ...]) -> Iterator[None]:
    """Inside the block our attention's padding-free kernels on ``device`` are ``kernels`` (its PADDING_FREE)."""
    before = attention.PADDING_FREE.get(device.type, ())
    attention.PADDING_FREE[device.type] = kernels
    try:
        yield
    finally:
        attention.PADDING_FREE[device.type] = before


def padded_attention_bench(length: int, s: Settings) -> Bench:
    """Our self-attention layer forward + backward on a padded batch (`padding_mask`: lengths uniform in
    [L/2, L]) by each of `PADDING_PATHS`, vs the same layer without a mask at the padded length ("no mask":
    the speed a padding path should reach or beat); shapes as in `attention_bench`, no dropout. Every step gets
    its mask as a new tensor, so the padding-free path packs it (and waits for the device) in every step, as a
    one-layer model would with a new batch; a deeper model packs once for all its layers. Each path's
    output at the valid rows is compared with the masked SDPA's first; a path that fails is named in the
    check and left out."""
    dim, heads, tokens = (32, 4, 64) if s.quick else (256, 8, 4096)
    batch = max(1, tokens // length)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = MultiHeadAttention(dim, heads).to(s.device)
    x = torch.randn(batch, length, dim, generator=g).to(s.device).requires_grad_()
    grad = torch.randn(batch, length, dim, generator=g).to(s.device)
    kpm = padding_mask(batch, length, g, s.device)
    valid = ~kpm

    def forward(mask: Tensor | None, kernels: tuple[str, ...]) -> Tensor:
        with padding_path(s.device, kernels), s.autocast():
            return layer(x, key_padding_mask=mask)[0]

    def step_of(mask: Tensor | None, kernels: tuple[str, ...]) -> Step:
        def step() -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            out = forward(None if mask is None else mask.clone(), kernels)  # a new batch's mask: packed anew
            out.backward(grad.to(out.dtype))

        return step

    with torch.no_grad():
        reference = forward(kpm, ())[valid]
    steps, notes = {"no mask": step_of(None, ())}, [f"{int(valid.sum())}/{kpm.numel()} tokens valid"]
    for side, kernels in PADDING_PATHS.items():
        try:
            with torch.no_grad():
                diff = max_diff(forward(kpm, kernels)[valid], reference)
            step_of(kpm, kernels)()
        except (RuntimeError, NotImplementedError) as err:
            notes.append(f"{side} fails: {str(err).splitlines()[0][:100]}")
            continue
        steps[side] = step_of(kpm, kernels)
        if kernels:
            notes.append(f"{side} max |Δ| at valid rows vs masked SDPA {diff:.1e}")
    return Bench(steps, items=int(valid.sum()), unit="tokens", check="; ".join(notes))


def padded_seq2seq_bench(dropout: float, s: Settings) -> Bench:
    """The Multi30k-shaped translation training step (configs/text/multi30k_en_de.yaml's model; 128 sentences
    of 8-32 tokens, padded per batch as an unbucketed loader pads them) with our attention's key padding by
    each of `PADDING_PATHS`, vs the same model on torch.nn.Transformer on the same batch. With dropout,
    "varlen" would run NJT SDPA (varlen_attn has no dropout): that side is left out. Items: target tokens."""
    ours, theirs, (*_, vocab, batch) = seq2seq_models("multi30k", s, dropout)
    g = torch.Generator().manual_seed(0)
    low, high = (3, 8) if s.quick else (8, 32)
    src = random_sentences(batch, low, high, vocab, g).to(s.device)
    tgt = random_sentences(batch, low, high, vocab, g).to(s.device)
    tgt_in, labels = teacher_forcing(tgt)
    keep = labels.ne(0)

    def loss(m: nn.Module) -> Tensor:
        return label_smoothed_nll_loss(m(src, tgt_in), labels, 0.1, 0)[0]

    def on_path(step: Step, kernels: tuple[str, ...]) -> Step:
        def run() -> None:
            with padding_path(s.device, kernels):
                step()

        return run

    notes = [f"{int(src.ne(0).sum())}/{src.numel()} source and {int(keep.sum())}/{keep.numel()} target tokens valid"]
    with torch.no_grad(), s.autocast():
        peer = theirs.eval()(src, tgt_in)[keep]
    paths = {side: k for side, k in PADDING_PATHS.items() if not ("varlen" in k and dropout > 0)}
    for side, kernels in list(paths.items()):  # every check before any step changes the weights
        with torch.no_grad(), s.autocast(), padding_path(s.device, kernels):
            try:
                diff = max_diff(ours.eval()(src, tgt_in)[keep], peer)
                notes.append(f"{side}: eval logits max |Δ| vs nn.Transformer {diff:.1e}")
            except (RuntimeError, NotImplementedError) as err:
                notes.append(f"{side} fails: {str(err).splitlines()[0][:100]}")
                del paths[side]
    ours.train(), theirs.train()
    steps = {}
    for side, kernels in paths.items():
        step = on_path(train_step(ours, loss, s), kernels)
        try:
            step()
        except (RuntimeError, NotImplementedError) as err:
            notes.append(f"{side} fails in training: {str(err).splitlines()[0][:100]}")
            continue
        steps[f"ours, {side}"] = step
    steps["nn.Transformer"] = train_step(theirs, loss, s)
    return Bench(steps, items=int(keep.sum()), unit="tokens", check="; ".join(notes))
