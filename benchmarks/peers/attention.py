"""Attention cases: our `MultiHeadAttention` vs the minimal SDPA layer and nn.MultiheadAttention, and the
core's attention function vs `F.scaled_dot_product_attention` on the same projected tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.harness import Step
from benchmarks.peers.bench import Bench, Settings, max_diff
from models.core.attend import attention_fast
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.masks import merge_masks


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
        check = ", ".join(f"max |Δ| vs {k} {max_diff(ref, f()):.1e}" for k, f in forwards.items() if k != "ours")

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
        check = f"max |Δ| {max_diff(ours(), sdpa()):.1e}"

    def step_of(forward: Callable[[], Tensor]) -> Step:
        def step() -> None:
            q.grad = k.grad = v.grad = None
            with s.autocast():
                out = forward()
            out.backward(grad.to(out.dtype))

        return step

    return Bench({"ours": step_of(ours), "sdpa": step_of(sdpa)}, items=batch * length, unit="tokens", check=check)


OPTIONS = {  # the attention block's options against plain softmax: the target ratio (None: reported only)
    "softmax1": ({"normalization": "softmax1"}, 1.10),
    "gate headwise": ({"gate": "headwise"}, 1.10),
    "gate elementwise": ({"gate": "elementwise"}, 1.10),
    "clipped": ({"normalization": "clipped"}, None),
    "sigmoid": ({"normalization": "sigmoid"}, None),
}


def option_bench(length: int, option: str, s: Settings) -> Bench:
    """Self-attention forward + backward of `MultiHeadAttention` with one option of the attention block vs the same
    layer with plain softmax (same weights; the option's own parameters aside); shapes as in `attention_bench`."""
    dim, heads, tokens = (32, 4, 64) if s.quick else (256, 8, 4096)
    batch = max(1, tokens // length)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ours = MultiHeadAttention(dim, heads, attention=AttentionConfig(**OPTIONS[option][0])).to(s.device)
    plain = MultiHeadAttention(dim, heads).to(s.device)
    plain.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("gate_proj")})
    x = torch.randn(batch, length, dim, generator=g).to(s.device).requires_grad_()
    grad = torch.randn(batch, length, dim, generator=g).to(s.device)

    def step_of(module: nn.Module) -> Step:
        def step() -> None:
            x.grad = None
            module.zero_grad(set_to_none=True)
            with s.autocast():
                out = module(x)[0]
            out.backward(grad.to(out.dtype))

        return step

    with torch.no_grad():
        path = "reference path" if not ours.fused else "SDPA"
        check = f"{path}; max |Δ| vs softmax {max_diff(ours(x)[0], plain(x)[0]):.1e} (the option changes the output)"
    return Bench({"ours": step_of(ours), "softmax": step_of(plain)}, items=batch * length, unit="tokens", check=check)
