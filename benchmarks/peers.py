"""The side-by-side cases of `python -m benchmarks`: each of our models against its peer, with the
same shapes, weights where the layouts allow it, precision, optimiser and loss.

A case builder takes the `Settings` and returns a `Bench`: one callable per side that runs one step
(forward + backward, or a training step with AdamW, or one beam search), ``"ours"`` first. Where the
peer can hold our weights (nn.MultiheadAttention, timm's ViT, torch.nn.Transformer), the builder
loads them and records in ``Bench.check`` how far the two outputs are apart, so a ratio is never
a comparison of two different computations.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.harness import Step, synchronize
from models import attention
from models.attention import MultiHeadAttention, attention_fast, merge_masks
from models.backbone import Backbone
from models.criterion import SetCriterion
from models.decoding import beam_search, greedy_decode
from models.detr import DETR
from models.matcher import HungarianMatcher
from models.position import sinusoidal_encoding
from models.text import Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing
from models.vit import VisionTransformer, load_timm_state_dict


@dataclass(frozen=True)
class Settings:
    """How every case runs: shapes (``quick``: the smallest, for smoke tests), device, bf16 autocast,
    torch.compile, channels-last images for the DETR backbones."""

    quick: bool = False
    device: torch.device = torch.device("cpu")
    amp: bool = False
    compile: bool = False
    channels_last: bool = False

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.amp else contextlib.nullcontext()

    def maybe_compile(self, model: nn.Module) -> nn.Module:
        return torch.compile(model) if self.compile else model


@dataclass
class Bench:
    """What a case builder returns. ``steps``: side -> one step, ours first. ``items``: samples or
    tokens one step processes (for throughput), ``unit`` their name. ``check``: how the sides were
    verified to compute the same thing. ``repeats``: samples to take, when the case wants fewer
    than the default (slow steps). ``inference``: the steps keep no state (no gradients or optimiser
    state to create in warm-up). ``side_info``: side -> its shape, where sides differ in shape
    (scaling). ``extra``: side -> callable returning further figures (e.g. the
    share of the step spent in Hungarian matching)."""

    steps: dict[str, Step]
    items: int = 0
    unit: str = ""
    check: str = ""
    repeats: int | None = None
    inference: bool = False
    side_info: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Callable[[], dict[str, str]]] = field(default_factory=dict)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def train_step(
    model: nn.Module, loss_fn: Callable[[nn.Module], Tensor], settings: Settings, lr: float = 1e-4, fused: bool = False
) -> Step:
    """zero_grad, forward and loss under ``settings.autocast()``, backward, AdamW step (``fused``: one
    kernel for the whole update, CUDA only)."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, fused=fused or None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with settings.autocast():
            loss = loss_fn(model)
        loss.backward()
        optimizer.step()

    return step


# ----------------------------------------------------------------------------- attention


class SDPAAttention(nn.Module):
    """The least an attention layer must do, as a peer: packed input projection, one
    `F.scaled_dot_product_attention` on the projected (B, H, L, d) tensors, output projection.
    Parameter names are nn.MultiheadAttention's, so our weights load unchanged."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        b, l, d = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(b, l, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, L, d)
        mask = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]  # SDPA: True = attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, l, d))


def padding_mask(batch: int, length: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """(B, L) True at padding: lengths drawn in [L/2, L], the first row full."""
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    lengths[0] = length
    return (torch.arange(length)[None, :] >= lengths[:, None]).to(device)


def attention_bench(length: int, masked: bool, s: Settings) -> Bench:
    """Self-attention forward + backward: our `MultiHeadAttention` vs the minimal SDPA layer and
    nn.MultiheadAttention (need_weights=False, its fast setting), all with the same weights.
    Tokens per batch are fixed (B·L = 4096), so growing L grows only the quadratic part."""
    dim, heads, tokens = (32, 4, 64) if s.quick else (256, 8, 4096)
    batch = max(1, tokens // length)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ours = MultiHeadAttention(dim, heads).to(s.device)
    sdpa, mha = SDPAAttention(dim, heads).to(s.device), nn.MultiheadAttention(dim, heads, batch_first=True).to(s.device)
    sdpa.load_state_dict(ours.state_dict())
    mha.load_state_dict(ours.state_dict())
    x = torch.randn(batch, length, dim, generator=g).to(s.device).requires_grad_()
    grad = torch.randn(batch, length, dim, generator=g).to(s.device)
    kpm = padding_mask(batch, length, g, s.device) if masked else None
    forwards = {
        "ours": lambda: ours(x, key_padding_mask=kpm)[0],
        "sdpa": lambda: sdpa(x, key_padding_mask=kpm),
        "nn.MHA": lambda: mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0],
    }
    with torch.no_grad():
        ref = forwards["ours"]()
        check = ", ".join(f"max |Δ| vs {k} {_max_diff(ref, f()):.1e}" for k, f in forwards.items() if k != "ours")

    def step_of(forward: Callable[[], Tensor], module: nn.Module) -> Step:
        def step() -> None:
            x.grad = None
            module.zero_grad(set_to_none=True)
            with s.autocast():
                out = forward()
            out.backward(grad.to(out.dtype))

        return step

    steps = {name: step_of(f, m) for (name, f), m in zip(forwards.items(), (ours, sdpa, mha))}
    return Bench(steps, items=batch * length, unit="tokens", check=check)


def core_bench(length: int, masked: bool, s: Settings) -> Bench:
    """The core's attention function alone (`merge_masks` + `attention_fast`, as `MultiHeadAttention`
    calls them) vs `F.scaled_dot_product_attention` on the same projected (B, H, L, d) tensors with
    the same key padding mask, forward + backward; shapes as in `attention_bench`."""
    dim, heads, tokens = (32, 4, 64) if s.quick else (256, 8, 4096)
    batch, head_dim = max(1, tokens // length), dim // heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=g).to(s.device).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, length, head_dim, generator=g).to(s.device)
    kpm = padding_mask(batch, length, g, s.device) if masked else None
    scale = head_dim**-0.5

    def ours() -> Tensor:
        mask = merge_masks(batch, length, length, key_padding_mask=kpm, device=q.device, dtype=q.dtype)
        return attention_fast(q, k, v, mask, scale)

    def sdpa() -> Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if kpm is None else ~kpm[:, None, None, :], scale=scale
        )

    with torch.no_grad():
        check = f"max |Δ| {_max_diff(ours(), sdpa()):.1e}"

    def step_of(forward: Callable[[], Tensor]) -> Step:
        def step() -> None:
            q.grad = k.grad = v.grad = None
            with s.autocast():
                out = forward()
            out.backward(grad.to(out.dtype))

        return step

    return Bench({"ours": step_of(ours), "sdpa": step_of(sdpa)}, items=batch * length, unit="tokens", check=check)


# ----------------------------------------------------------------------------- padded batches (GPU section)

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
                diff = _max_diff(forward(kpm, kernels)[valid], reference)
            step_of(kpm, kernels)()
        except (RuntimeError, NotImplementedError) as err:
            notes.append(f"{side} fails: {str(err).splitlines()[0][:100]}")
            continue
        steps[side] = step_of(kpm, kernels)
        if kernels:
            notes.append(f"{side} max |Δ| at valid rows vs masked SDPA {diff:.1e}")
    return Bench(steps, items=int(valid.sum()), unit="tokens", check="; ".join(notes))


# ----------------------------------------------------------------------------- ViT

VIT_SHAPES = {  # timm's vit_tiny/small/base_patch16_224, and one for dispatch overhead
    "vit_tiny": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "vit_small": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "vit_base": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # timm's depth and heads on tensors so small that dispatch, Python and (on a GPU) kernel launches set the time
    "vit_dispatch": dict(img_size=32, patch_size=8, embed_dim=24, depth=12, num_heads=3),
}
QUICK_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def vit_pair(shape: dict, device: torch.device, num_classes: int = 1000) -> tuple[VisionTransformer, nn.Module]:
    """Our ViT and timm's of the same config, ours holding timm's weights."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    torch.manual_seed(0)
    theirs = TimmViT(num_classes=num_classes, **shape)
    ours = VisionTransformer(num_classes=num_classes, **shape)
    load_timm_state_dict(ours, theirs.state_dict())
    return ours.to(device), theirs.to(device)


def vit_bench(name: str, s: Settings, batch: int | None = None) -> Bench:
    """ViT training step (cross-entropy, AdamW) at timm's ``name`` shape: ours vs timm's VisionTransformer."""
    shape = QUICK_VIT if s.quick else VIT_SHAPES[name]
    batch = batch or (2 if s.quick else 8)
    ours, theirs = vit_pair(shape, s.device)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, shape["img_size"], shape["img_size"], generator=g).to(s.device)
    labels = torch.randint(0, 1000, (batch,), generator=g).to(s.device)
    with torch.no_grad():
        check = (
            f"batch {batch}, {shape['img_size']} px, patch {shape['patch_size']}, width {shape['embed_dim']}, {shape['depth']} blocks; "
            f"same weights, eval logits max |Δ| {_max_diff(ours.eval()(images), theirs.eval()(images)):.1e}"
        )
    ours.train(), theirs.train()
    steps = {
        side: train_step(s.maybe_compile(m), lambda m: F.cross_entropy(m(images), labels), s)
        for side, m in (("ours", ours), ("timm", theirs))
    }
    return Bench(steps, items=batch, unit="images", check=check)


def training_flops(model: nn.Module, loss_fn: Callable[[nn.Module], Tensor]) -> int:
    """FLOPs of one forward + backward (torch.utils.flop_counter; matmuls, convolutions, SDPA)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        loss_fn(model).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# ----------------------------------------------------------------------------- text

SEQ2SEQ_SHAPES = {  # (d_model, nhead, layers each side, FFN, vocabulary, sentences per batch)
    "small": (256, 4, 3, 1024, 8000, 32),
    "base": (512, 8, 6, 2048, 8000, 16),
    "multi30k": (256, 4, 4, 1024, 10000, 128),  # configs/text/multi30k_en_de.yaml
}
QUICK_SEQ2SEQ = (32, 2, 1, 64, 100, 4)


class TorchSeq2Seq(nn.Module):
    """The peer: the same encoder-decoder on ``torch.nn.Transformer`` (post-norm, no final norms, as
    ours without ``norm_first``), with the same scaled embeddings, sinusoidal positions and tied
    output projection. Its state dict is ours with the stacks under ``transformer.``."""

    def __init__(
        self,
        vocab: int,
        d_model: int,
        nhead: int,
        layers: int,
        ffn: int,
        dropout: float,
        pad_id: int,
        max_len: int = 256,
    ):
        super().__init__()
        self.pad_id, self.scale = pad_id, math.sqrt(d_model)
        self.embedding = nn.Embedding(vocab, d_model, padding_idx=pad_id)
        self.register_buffer("pe", sinusoidal_encoding(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        enc = nn.TransformerEncoderLayer(d_model, nhead, ffn, dropout, batch_first=True)
        dec = nn.TransformerDecoderLayer(d_model, nhead, ffn, dropout, batch_first=True)
        self.transformer = nn.Transformer(
            d_model,
            nhead,
            batch_first=True,
            custom_encoder=nn.TransformerEncoder(enc, layers, enable_nested_tensor=False),
            custom_decoder=nn.TransformerDecoder(dec, layers),
        )
        self.generator = nn.Linear(d_model, vocab, bias=False)
        self.generator.weight = self.embedding.weight

    def _embed(self, tokens: Tensor) -> Tensor:
        return self.dropout(self.embedding(tokens) * self.scale + self.pe[: tokens.size(1)])

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool, device=tgt.device).triu(1)
        src_mask = src.eq(self.pad_id)
        h = self.transformer(
            self._embed(src),
            self._embed(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src_mask,
            tgt_key_padding_mask=tgt.eq(self.pad_id),
            memory_key_padding_mask=src_mask,
            tgt_is_causal=True,
        )
        return self.generator(h)

    def load_ours(self, ours: Seq2SeqTransformer) -> None:
        state = {}
        for key, value in ours.state_dict().items():
            if key.startswith(("encoder.", "decoder.")):
                state[f"transformer.{key}"] = value
            elif key == "src_embed.embedding.weight":
                state["embedding.weight"] = value
        self.load_state_dict(state, strict=False)


def random_sentences(
    batch: int, low: int, high: int, vocab: int, g: torch.Generator, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2
) -> Tensor:
    """(B, max length) BOS w1 .. wn EOS PAD.., lengths in [low, high], words drawn from 4..vocab-1."""
    lengths = torch.randint(low, high + 1, (batch,), generator=g)
    tokens = torch.full((batch, int(lengths.max()) + 2), pad_id, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        tokens[i, 0], tokens[i, n + 1] = bos_id, eos_id
        tokens[i, 1 : n + 1] = torch.randint(4, vocab, (n,), generator=g)
    return tokens


def seq2seq_models(size: str, s: Settings, dropout: float = 0.1) -> tuple[Seq2SeqTransformer, TorchSeq2Seq, tuple]:
    d, h, n, ffn, vocab, batch = QUICK_SEQ2SEQ if s.quick else SEQ2SEQ_SHAPES[size]
    torch.manual_seed(0)
    ours = Seq2SeqTransformer(
        vocab, vocab, d, h, n, n, ffn, dropout, share_embeddings=True, tie_output=True, pad_id=0, max_positions=1100
    )
    theirs = TorchSeq2Seq(vocab, d, h, n, ffn, dropout, pad_id=0, max_len=1100)
    theirs.load_ours(ours)
    return ours.to(s.device), theirs.to(s.device), (d, h, n, ffn, vocab, batch)


def seq2seq_bench(size: str, s: Settings, length: tuple[int, int] = (16, 40), batch: int | None = None) -> Bench:
    """Translation training step (teacher forcing, label-smoothed loss, AdamW), sentences of random
    length padded per batch: ours vs the same model on torch.nn.Transformer. Items: target tokens."""
    ours, theirs, (_, _, _, _, vocab, default_batch) = seq2seq_models(size, s)
    batch = batch or default_batch
    g = torch.Generator().manual_seed(0)
    low, high = (3, 8) if s.quick else length
    src = random_sentences(batch, low, high, vocab, g).to(s.device)
    tgt = random_sentences(batch, low, high, vocab, g).to(s.device)
    tgt_in, labels = teacher_forcing(tgt)
    with torch.no_grad():
        keep = labels.ne(0)
        check = f"same weights, eval logits max |Δ| {_max_diff(ours.eval()(src, tgt_in)[keep], theirs.eval()(src, tgt_in)[keep]):.1e}"
    ours.train(), theirs.train()

    def loss(m: nn.Module) -> Tensor:
        return label_smoothed_nll_loss(m(src, tgt_in), labels, 0.1, 0)[0]

    steps = {side: train_step(s.maybe_compile(m), loss, s) for side, m in (("ours", ours), ("nn.Transformer", theirs))}
    return Bench(steps, items=int(labels.ne(0).sum()), unit="tokens", check=check)


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
                diff = _max_diff(ours.eval()(src, tgt_in)[keep], peer)
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


@dataclass
class PrefixCache:
    """The whole prefix (N, t) in place of a key/value cache, reordered with the beams like one."""

    tokens: Tensor | None = None

    def reorder(self, index: Tensor, static_index: Tensor | None) -> None:
        self.tokens = self.tokens.index_select(0, index)


class WithoutCache(nn.Module):
    """Our model seen by `beam_search` as one without a key/value cache: each step re-runs the decoder
    over the whole prefix (kept in a `PrefixCache`, so the search's reordering moves it along with the
    beams) and projects the last position only."""

    def __init__(self, model: Seq2SeqTransformer):
        super().__init__()
        self.model = model

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        return self.model.encode(src, src_key_padding_mask)

    def init_cache(self) -> list[PrefixCache]:
        return [PrefixCache()]

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None,
        cache: list[PrefixCache],
        start_pos: int = 0,
    ) -> Tensor:
        prefix = tgt if cache[0].tokens is None else torch.cat([cache[0].tokens, tgt], dim=1)  # (N, t + 1)
        cache[0].tokens = prefix
        m = self.model
        h = m.decoder(
            m._embed(m.tgt_embed, prefix), memory, memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=True
        )
        return m.generator(h[:, -1:])  # (N, 1, V)


BEAM = dict(d_model=256, nhead=4, layers=3, ffn=1024, vocab=8000, batch=64, max_len=32, src=(8, 24))
QUICK_BEAM = dict(d_model=32, nhead=2, layers=1, ffn=64, vocab=50, batch=4, max_len=6, src=(3, 6))


def decoding_bench(search: str, s: Settings) -> Bench:
    """Beam search (beam 5) or greedy decoding of a batch of sentences with the key/value cache vs
    without it. Random weights: hypotheses run to ``max_len`` (the last step forces EOS)."""
    c = QUICK_BEAM if s.quick else BEAM
    torch.manual_seed(0)
    model = (
        Seq2SeqTransformer(
            c["vocab"],
            c["vocab"],
            c["d_model"],
            c["nhead"],
            c["layers"],
            c["layers"],
            c["ffn"],
            0.0,
            share_embeddings=True,
            pad_id=0,
        )
        .to(s.device)
        .eval()
    )
    src = random_sentences(c["batch"], *c["src"], c["vocab"], torch.Generator().manual_seed(0)).to(s.device)
    ids = dict(bos_id=1, eos_id=2, pad_id=0, max_len=c["max_len"])
    if search == "beam":
        runs = {
            "ours": lambda: beam_search(model, src, beam_size=5, **ids),
            "no cache": lambda: beam_search(WithoutCache(model), src, beam_size=5, **ids),
        }
    else:
        runs = {
            "ours": lambda: greedy_decode(model, src, **ids),
            "no cache": lambda: greedy_decode(model, src, use_cache=False, **ids),
        }

    def step_of(run: Callable[[], tuple[Tensor, Tensor]]) -> Step:
        def step() -> tuple[Tensor, Tensor]:
            with s.autocast():
                return run()

        return step

    steps = {side: step_of(run) for side, run in runs.items()}
    (a, _), (b, _) = steps["ours"](), steps["no cache"]()
    same = sum(bool(x.equal(y)) for x, y in zip(a, b)) if a.shape == b.shape else 0
    return Bench(
        steps,
        items=c["batch"],
        unit="sentences",
        check=f"same hypotheses for {same}/{c['batch']} sentences, length {a.size(1)}",
        repeats=3,
        inference=True,
    )


# configs/text/multi30k_en_de.yaml's model (shared 10k BPE, length_penalty 1.0); sources of 6-30 tokens, as its val
MULTI30K_BEAM = dict(d_model=256, nhead=4, layers=4, ffn=1024, vocab=10000, src=(6, 30), max_positions=256, alpha=1.0)
QUICK_MULTI30K_BEAM = dict(d_model=32, nhead=2, layers=1, ffn=64, vocab=50, src=(3, 6), max_positions=64, alpha=1.0)


def static_cache_bench(search: str, sentences: int, s: Settings) -> Bench:
    """Decoding as validation runs it (`TranslationModule.translate`: max_len = 1.5·|source| + 10) on
    Multi30k-val-shaped input, beam 5 or greedy: the static cache ("ours"; on CUDA each step a CUDA graph) vs
    the dynamic cache of today's path. Random weights: hypotheses run to ``max_len``."""
    c = QUICK_MULTI30K_BEAM if s.quick else MULTI30K_BEAM
    sentences = min(sentences, 4) if s.quick else sentences
    torch.manual_seed(0)
    layers = (c["layers"], c["layers"], c["ffn"], 0.0)
    model = Seq2SeqTransformer(
        c["vocab"],
        c["vocab"],
        c["d_model"],
        c["nhead"],
        *layers,
        share_embeddings=True,
        pad_id=0,
        max_positions=c["max_positions"],
    )
    model = model.to(s.device).eval()
    src = random_sentences(sentences, *c["src"], c["vocab"], torch.Generator().manual_seed(0)).to(s.device)
    max_len = min(c["max_positions"], int(1.5 * int(src.ne(0).sum(1).max()) + 10))
    ids = dict(bos_id=1, eos_id=2, pad_id=0, max_len=max_len)
    if search == "beam":
        ids.update(beam_size=5, alpha=c["alpha"])
    decode = beam_search if search == "beam" else greedy_decode

    def step_of(cache: str) -> Step:
        def step() -> tuple[Tensor, Tensor]:
            with s.autocast():
                return decode(model, src, cache=cache, **ids)

        return step

    steps = {"ours": step_of("static"), "dynamic cache": step_of("dynamic")}
    (a, _), (b, _) = steps["ours"](), steps["dynamic cache"]()
    same = sum(bool(x.equal(y)) for x, y in zip(a, b)) if a.shape == b.shape else 0
    return Bench(
        steps,
        items=sentences,
        unit="sentences",
        check=f"identical translations for {same}/{sentences} sentences, length {a.size(1)} (max_len {max_len})",
        repeats=3,
        inference=True,
    )


# ----------------------------------------------------------------------------- DETR

DETR_SHAPES = {  # backbone, d_model, heads, layers each side, FFN, queries, classes, batch, image (H, W)
    "r50": dict(
        backbone="resnet50",
        d_model=256,
        nhead=8,
        layers=6,
        ffn=2048,
        queries=100,
        classes=91,
        batch=2,
        image=(384, 384),
    ),
    "small": dict(
        backbone="resnet18", d_model=128, nhead=4, layers=2, ffn=512, queries=20, classes=20, batch=4, image=(192, 192)
    ),
}
QUICK_DETR = dict(
    backbone="resnet18", d_model=32, nhead=2, layers=1, ffn=64, queries=8, classes=3, batch=2, image=(64, 64)
)


def detection_batch(
    c: dict, boxes_per_image: int, g: torch.Generator, device: torch.device
) -> tuple[Tensor, Tensor, list[dict[str, Tensor]]]:
    """Random images (B, 3, H, W), the padding mask (B, H, W) (the last image padded on the right and
    bottom by a quarter, as in a batch of unequal images) and targets with normalised cxcywh boxes."""
    b, (h, w) = c["batch"], c["image"]
    images = torch.randn(b, 3, h, w, generator=g)
    mask = torch.zeros(b, h, w, dtype=torch.bool)
    mask[-1, 3 * h // 4 :, :] = True
    mask[-1, :, 3 * w // 4 :] = True
    targets = []
    for _ in range(b):
        centre = torch.rand(boxes_per_image, 2, generator=g) * 0.5 + 0.25
        size = torch.rand(boxes_per_image, 2, generator=g) * 0.3 + 0.05
        targets.append(
            {
                "labels": torch.randint(0, c["classes"], (boxes_per_image,), generator=g).to(device),
                "boxes": torch.cat([centre, size], 1).to(device),
            }
        )
    return images.to(device), mask.to(device), targets


def hf_detr(c: dict, device: torch.device) -> nn.Module:
    """Hugging Face's DetrForObjectDetection of the same size, random weights, built offline (timm
    backbone, no pre-trained weights). As in DETR (and ours): dropout 0.1 on attention weights and in
    the FFN too (transformers defaults those two to 0), stem and layer1 frozen (transformers freezes
    them only for its own ResNet, not for a timm trunk)."""
    from transformers import DetrConfig, DetrForObjectDetection

    config = DetrConfig(
        backbone=c["backbone"],
        use_timm_backbone=True,
        use_pretrained_backbone=False,
        num_labels=c["classes"],
        num_queries=c["queries"],
        d_model=c["d_model"],
        encoder_layers=c["layers"],
        decoder_layers=c["layers"],
        encoder_attention_heads=c["nhead"],
        decoder_attention_heads=c["nhead"],
        encoder_ffn_dim=c["ffn"],
        decoder_ffn_dim=c["ffn"],
        auxiliary_loss=True,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,  # DETR's 0.1 everywhere, as ours
    )
    torch.manual_seed(0)
    model = DetrForObjectDetection(config)
    for name, p in model.model.backbone.named_parameters():
        p.requires_grad_(any(f"layer{i}" in name for i in (2, 3, 4)))
    return model.to(device)


def ours_detr(c: dict, device: torch.device) -> tuple[DETR, SetCriterion]:
    torch.manual_seed(0)
    backbone = Backbone(c["backbone"], out_index=4, norm="frozen_bn", trainable_layers=3)
    model = DETR(
        backbone,
        c["classes"],
        c["queries"],
        c["d_model"],
        c["nhead"],
        c["layers"],
        c["layers"],
        c["ffn"],
        dropout=0.1,
        aux_loss=True,
    )
    weights = {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0}  # the paper's
    criterion = SetCriterion(c["classes"], HungarianMatcher(1, 5, 2), 0.1, weights, num_aux=c["layers"] - 1)
    return model.to(device), criterion.to(device)


def matcher_share(
    step: Step, owner: object, clock: Callable[[], float], steps: int, device: torch.device, method: str = "forward"
) -> dict[str, str]:
    """The share of ``steps`` training steps spent inside ``owner.<method>`` (a Hungarian matcher
    instance or class: ours is entered once per step through ``match_layers``, Hugging Face's once per
    decoder layer through ``forward``), timed by ``clock``; the timer is in place only while measuring. On a GPU the
    timer starts once the kernels queued before the matcher have run, so that the wait for the forward
    pass, which the matcher's copy of its cost matrix to the CPU would otherwise absorb, is not counted."""
    original, spent = getattr(owner, method), [0.0]

    def timed(*args, **kwargs):
        synchronize(device)
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += clock() - start

    setattr(owner, method, timed)
    try:
        synchronize(device)
        start = clock()
        for _ in range(steps):
            step()
        synchronize(device)
        total = clock() - start
    finally:
        if isinstance(owner, type):
            setattr(owner, method, original)
        else:
            delattr(owner, method)  # back to the class's method
    return {"matching": f"{100 * spent[0] / total:.1f}% of the step"}


MATCHING_SHAPES = {  # decoder layers (final + auxiliary), images, queries, classes, targets per image
    "r50": dict(layers=6, batch=2, queries=100, classes=91, boxes=6),
    "batch 64": dict(layers=6, batch=64, queries=100, classes=91, boxes=20),
}
QUICK_MATCHING = dict(layers=2, batch=2, queries=8, classes=3, boxes=2)


def matching_bench(shape: str, s: Settings) -> Bench:
    """Hungarian matching of one DETR training step, every decoder layer: ours (`match_layers`, all
    layers in one pass, each image's queries against its own targets) vs Hugging Face's matcher called
    once per layer, as its loss does (each call costs the whole batch's queries against the whole
    batch's targets), on the same random predictions."""
    from transformers.loss.loss_for_object_detection import HungarianMatcher as HFMatcher

    c = QUICK_MATCHING if s.quick else MATCHING_SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    b, q = c["batch"], c["queries"]
    layers = [
        {
            "pred_logits": torch.randn(b, q, c["classes"] + 1, generator=g).to(s.device),
            "pred_boxes": (torch.rand(b, q, 4, generator=g) * 0.5 + 0.1).to(s.device),
        }
        for _ in range(c["layers"])
    ]
    targets = [
        {
            "labels": torch.randint(0, c["classes"], (c["boxes"],), generator=g).to(s.device),
            "boxes": (torch.rand(c["boxes"], 4, generator=g) * 0.5 + 0.1).to(s.device),
        }
        for _ in range(b)
    ]
    hf_layers = [{"logits": o["pred_logits"], "pred_boxes": o["pred_boxes"]} for o in layers]
    hf_targets = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in targets]
    ours, theirs = HungarianMatcher(1, 5, 2), HFMatcher(class_cost=1, bbox_cost=5, giou_cost=2)
    steps = {
        "ours": lambda: ours.match_layers(layers, targets),
        "HF matcher": lambda: [theirs(o, hf_targets) for o in hf_layers],
    }
    same = sum(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
        for mine, hers in zip(steps["ours"](), steps["HF matcher"]())
        for x, y in zip(mine, hers)
    )
    check = (
        f"{c['layers']} decoder layers x {b} images x {q} queries, {c['boxes']} targets each; "
        f"same assignment for {same}/{c['layers'] * b} (layer, image) pairs"
    )
    return Bench(steps, items=b, unit="images", check=check, inference=True)


def parameter_counts(model: nn.Module) -> str:
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{sum(p.numel() for p in model.parameters()) / 1e6:.3f}M parameters ({trained / 1e6:.3f}M trained)"


def detr_bench(
    size: str, s: Settings, queries: int | None = None, boxes: int | None = None, with_peer: bool = True
) -> Bench:
    """DETR training step (set loss with aux losses, AdamW) on random images: ours vs Hugging Face's
    DetrForObjectDetection (skipped with a message when transformers is missing)."""
    from benchmarks.harness import clock

    c = dict(QUICK_DETR if s.quick else DETR_SHAPES[size])
    if queries:
        c["queries"] = queries
    boxes = boxes or (2 if s.quick else 6)
    images, mask, targets = detection_batch(c, boxes, torch.Generator().manual_seed(0), s.device)
    if s.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    model, criterion = ours_detr(c, s.device)
    if s.channels_last:
        model.backbone.to(memory_format=torch.channels_last)
    tick = clock(s.device)
    compiled = s.maybe_compile(model)

    def ours_loss(m: nn.Module) -> Tensor:
        return criterion.total(criterion(m(images, mask), targets))

    steps = {"ours": train_step(compiled, ours_loss, s)}
    extra = {
        "ours": lambda: matcher_share(
            steps["ours"], criterion.matcher, tick, 2 if s.quick else 4, s.device, "match_layers"
        )
    }
    check = f"ours {parameter_counts(model)}"
    if with_peer:
        try:
            theirs = hf_detr(c, s.device)
        except ImportError:
            print(
                "detr: transformers is not installed (pip install transformers): the Hugging Face DETR peer is skipped"
            )
        else:
            from transformers.loss import loss_for_object_detection as hf_loss

            if s.channels_last:
                theirs.model.backbone.to(memory_format=torch.channels_last)
            pixel_mask = (~mask).long()
            labels = [{"class_labels": t["labels"], "boxes": t["boxes"]} for t in targets]
            steps["HF DETR"] = train_step(
                s.maybe_compile(theirs), lambda m: m(pixel_values=images, pixel_mask=pixel_mask, labels=labels).loss, s
            )
            extra["HF DETR"] = lambda: matcher_share(
                steps["HF DETR"], hf_loss.HungarianMatcher, tick, 2 if s.quick else 4, s.device
            )
            check += f", HF {parameter_counts(theirs)}"
    return Bench(steps, items=c["batch"], unit="images", check=check, extra=extra)
