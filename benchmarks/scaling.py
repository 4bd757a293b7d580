"""Scaling and GPU-only figures for `python -m benchmarks`.

Scaling: how our training step's time and memory grow with the sequence length (text), the image
size (ViT) and the number of queries / targets (DETR), and which share of the step the attention
kernels take (from the profiler: SDPA and the padding-free kernels, forward and backward), so the
point where quadratic attention starts to dominate is visible.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.harness import Step
from benchmarks.peers.bench import Bench, Settings, train_step, training_flops
from benchmarks.peers.detr import detr_bench
from benchmarks.peers.vit import QUICK_VIT, VIT_SHAPES, vit_pair
from models.text.seq2seq import Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing

# ----------------------------------------------------------------------------- attention kernels

# SDPA's implementations as the profiler names them -> short names
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused (other)",
}


# Where attention runs, as the profiler names the ops: SDPA on dense tensors (forward; its backward is the
# autograd nodes below), varlen_attn's custom ops (torch.nn.attention.varlen), and the kernels that SDPA on
# nested jagged tensors calls without `aten::scaled_dot_product_attention` (torch.nested._internal.sdpa: flash,
# memory-efficient, cuDNN on CUDA, the math kernel on the CPU): the padding-free path of `models.core.padding_free`.
ATTENTION_OPS = frozenset(
    {
        "aten::scaled_dot_product_attention",
        "torch_attn::_varlen_attn",
        "torch_attn::_varlen_attn_backward",
        "aten::_flash_attention_forward",
        "aten::_flash_attention_backward",
        "aten::_efficient_attention_forward",
        "aten::_efficient_attention_backward",
        "aten::_cudnn_attention_forward",
        "aten::_cudnn_attention_backward",
        "aten::_scaled_dot_product_attention_math",
    }
)
SDPA_BACKWARD = "autograd::engine::evaluate_function: ScaledDotProduct"


def profile_step(step: Step) -> list[Any]:
    """One step under the PyTorch profiler -> its events, each call one event that knows its caller
    (``cpu_parent``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        step()
    return list(prof.events())


def top_ops(events: list[Any], n: int = 5) -> str:
    """The ``n`` operators with the most self time on the step's device (CUDA's where it ran, else the CPU's),
    as "name ms (share)": where the time of a row that misses its target goes."""
    on_device = any(e.self_device_time_total > 0 for e in events)
    totals: dict[str, float] = {}
    for e in events:
        totals[e.key] = totals.get(e.key, 0.0) + (e.self_device_time_total if on_device else e.self_cpu_time_total)
    whole = sum(totals.values()) or 1.0
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name} {us / 1e3:.2f} ms ({100 * us / whole:.0f}%)" for name, us in top)


def sdpa_kernels(events: list[Any]) -> str:
    """Which SDPA implementations ran (", "-joined short names), or "none" (e.g. the math fallback
    written out op by op)."""
    seen = [name for key, name in SDPA_KERNELS.items() if any(e.key == key for e in events)]
    return ", ".join(seen) or "none"


def _is_attention(event: Any) -> bool:
    return event.key in ATTENTION_OPS or event.key.startswith(SDPA_BACKWARD)


def attention_share(events: list[Any]) -> float:
    """Share of the step's CPU time inside attention: the outermost calls of `ATTENTION_OPS` (those inside
    another, as SDPA's flash kernel inside ``aten::scaled_dot_product_attention``, are counted once) and
    SDPA's backward (autograd nodes ``ScaledDotProduct*Backward``). Exact for the fused kernels; the math
    fallback's backward is spread over generic ops and is not counted."""

    def outermost(event: Any) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if _is_attention(parent):
                return False
            parent = parent.cpu_parent
        return True

    total = sum(e.self_cpu_time_total for e in events)
    inside = sum(e.cpu_time_total for e in events if _is_attention(e) and outermost(e))
    return inside / total if total else 0.0


def verify_gpu_kernels(step: Step) -> str:
    """On CUDA: does the step run with only the flash kernel allowed, and with only the memory-efficient
    one? (`torch.nn.attention.sdpa_kernel` raises when the allowed kernel cannot take the inputs.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    verdicts = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([backend]):
                step()
            verdicts.append(f"{name}: runs")
        except RuntimeError as err:
            verdicts.append(f"{name}: refused ({str(err).splitlines()[0][:80]})")
    return "; ".join(verdicts)


# ----------------------------------------------------------------------------- scaling cases

TEXT_LENGTHS, QUICK_TEXT_LENGTHS = (64, 128, 256, 512, 1024), (8, 16)
VIT_IMAGE_SIZES, QUICK_VIT_IMAGE_SIZES = (64, 128, 224, 384), (16, 32)
DETR_POINTS = ((20, 10), (100, 10), (300, 10), (100, 5), (100, 50))  # (queries, targets per image)
QUICK_DETR_POINTS = ((8, 2), (16, 4))


def text_scaling_bench(s: Settings) -> Bench:
    """Seq2seq training step (the "small" shape, dropout 0 so SDPA takes its fused kernel) on
    sentences of exactly L tokens, 4096 tokens per batch on each side (32 when quick): one side per L."""
    d, h, n, ffn, vocab = (32, 2, 1, 64, 100) if s.quick else (256, 4, 3, 1024, 8000)
    tokens = 32 if s.quick else 4096
    steps, info = {}, {}
    for length in QUICK_TEXT_LENGTHS if s.quick else TEXT_LENGTHS:
        batch = max(1, tokens // length)
        torch.manual_seed(0)
        model = Seq2SeqTransformer(
            vocab, vocab, d, h, n, n, ffn, 0.0, share_embeddings=True, pad_id=0, max_positions=length + 2
        ).to(s.device)
        g = torch.Generator().manual_seed(0)
        src = torch.randint(4, vocab, (batch, length), generator=g).to(s.device)
        tgt_in, labels = teacher_forcing(torch.randint(4, vocab, (batch, length + 1), generator=g).to(s.device))

        def loss(m, src=src, tgt_in=tgt_in, labels=labels):
            return label_smoothed_nll_loss(m(src, tgt_in), labels, 0.1, 0)[0]

        steps[f"L={length}"] = train_step(s.maybe_compile(model), loss, s)
        info[f"L={length}"] = f"batch {batch} x {length} tokens"
    return Bench(steps, items=tokens, unit="tokens", side_info=info)


def vit_scaling_bench(s: Settings) -> Bench:
    """vit_tiny training step (patch 16; patch 8 when quick), batch 8 (2 when quick): one side per image size."""
    batch = 2 if s.quick else 8
    steps, info = {}, {}
    for size in QUICK_VIT_IMAGE_SIZES if s.quick else VIT_IMAGE_SIZES:
        shape = dict(QUICK_VIT if s.quick else VIT_SHAPES["vit_tiny"], img_size=size)
        model, _ = vit_pair(shape, s.device)
        g = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, size, size, generator=g).to(s.device)
        labels = torch.randint(0, 1000, (batch,), generator=g).to(s.device)
        loss = lambda m, images=images, labels=labels: F.cross_entropy(m(images), labels)  # noqa: E731
        steps[f"{size}px"] = train_step(s.maybe_compile(model), loss, s)
        info[f"{size}px"] = f"{1 + (size // shape['patch_size']) ** 2} tokens"
    return Bench(steps, items=batch, unit="images", side_info=info)


def detr_scaling_bench(s: Settings) -> Bench:
    """The small DETR's training step: one side per (object queries, target boxes per image)."""
    steps, info, extra = {}, {}, {}
    for queries, targets in QUICK_DETR_POINTS if s.quick else DETR_POINTS:
        point = detr_bench("small", s, queries=queries, boxes=targets, with_peer=False)
        name = f"{queries} queries, {targets} targets"
        steps[name], info[name], extra[name] = (
            point.steps["ours"],
            point.check.removeprefix("ours "),
            point.extra["ours"],
        )
        items = point.items
    return Bench(steps, items=items, unit="images", side_info=info, extra=extra)


# ----------------------------------------------------------------------------- GPU: MFU

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets; the first match
# of the device name wins.
GPU_BF16_PEAK = (
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
)


def gpu_peak(name: str) -> float | None:
    return next((peak for key, peak in GPU_BF16_PEAK if key in name), None)


def vit_b16_mfu(
    s: Settings, compile_model: bool, batch: int = 64, side: str = "ours", precision: str = "bf16 autocast"
) -> dict[str, str]:
    """Model FLOPs utilisation of a ViT-B/16 training step (fused AdamW): FLOPs of forward + backward from
    torch.utils.flop_counter, divided by the step time and the GPU's dense bf16 peak. ``side``: "ours" or
    "timm" (the same weights); ``precision``: "bf16 autocast" (fp32 weights, Lightning's bf16-mixed), "bf16
    weights" (weights, gradients and optimiser state in bf16, Lightning's bf16-true) or "float8 + bf16 autocast"
    (bf16 autocast, our linear layers' matmuls in float8 by `Float8Training`, emulated off CUDA; the FLOPs
    counted before the conversion). With ``s.quick`` a toy ViT (`QUICK_VIT`), as a rehearsal on the CPU runs it."""
    from benchmarks.harness import interleaved

    shape = QUICK_VIT if s.quick else VIT_SHAPES["vit_base"]
    ours, theirs = vit_pair(shape, s.device)
    model = ours if side == "ours" else theirs
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    size = shape["img_size"]
    images = torch.randn(batch, 3, size, size, device=s.device, dtype=next(model.parameters()).dtype)
    labels = torch.randint(0, 1000, (batch,), device=s.device)

    def loss(m: nn.Module) -> Tensor:
        with torch.autocast(s.device.type, dtype=torch.bfloat16):
            return F.cross_entropy(m(images), labels)

    flops = training_flops(model, loss)
    if precision == FLOAT8:
        to_float8(model, s.device)
    step = train_step(torch.compile(model) if compile_model else model, loss, s, fused=True)
    repeats, warmup, sample = (2, 1, 0.01) if s.quick else (10, 3, 0.5)
    seconds = interleaved({side: step}, s.device, repeats=repeats, warmup=warmup, min_sample_s=sample)[side].median
    peak = gpu_peak(torch.cuda.get_device_name(s.device)) if s.device.type == "cuda" else None
    return {
        "model": side,
        "precision": precision,
        "torch.compile": "on" if compile_model else "off",
        "batch": str(batch),
        "TFLOP per step": f"{flops / 1e12:.2f}",
        "step ms": f"{seconds * 1e3:.1f}",
        "achieved TFLOP/s": f"{flops / seconds / 1e12:.1f}",
        "MFU": f"{100 * flops / seconds / peak:.1f}% of {peak / 1e12:.0f} TFLOP/s" if peak else "no known peak",
    }


FLOAT8 = "float8 + bf16 autocast"


def to_float8(model: nn.Module, device: torch.device) -> None:
    """Our ViT's linear layers to float8 training, as `Float8Training` converts a fit's network (its output layer
    kept); emulated (fp32 matmuls) off CUDA. The callback reads the device from a Trainer and the network from a
    LightningModule's ``model``: both stand-ins here."""
    from types import SimpleNamespace

    from experiments.callbacks.float8 import Float8Training

    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=device))
    Float8Training(emulate=device.type != "cuda").setup(trainer, SimpleNamespace(model=model), "fit")


def vit_b16_float8_mfu(s: Settings, compile_model: bool, batch: int) -> dict[str, str]:
    """`vit_b16_mfu` of ours in float8; where torchao is absent or fails, a row that says so, so that the other
    rows of the step still come."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        outcome = "torchao absent (the GPU machine's image lacks it: carry its wheel, `make gpu-wheels`)"
    else:
        try:
            return vit_b16_mfu(s, compile_model, batch, precision=FLOAT8)
        except Exception as err:  # noqa: BLE001 - reported in the row, the eager and compiled rows kept
            outcome = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    row = dict.fromkeys(("model", "precision", "torch.compile", "batch", "TFLOP per step", "step ms"), "-")
    row |= {"model": "ours", "precision": FLOAT8, "torch.compile": "on" if compile_model else "off"}
    return row | {"batch": str(batch), "achieved TFLOP/s": "-", "MFU": outcome}


def empty_row_rows(device: torch.device) -> list[list[str]]:
    """What each SDPA backend gives for a query row whose keys are all blocked (boolean key padding
    mask, one sequence all padding), forward and backward: the reason the core zeroes such rows itself
    on a GPU instead of trusting the kernel (see `models.core.attention.attention_fast`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, backend in (
            ("math", SDPBackend.MATH),
            ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("cuDNN", SDPBackend.CUDNN_ATTENTION),
        ):
            for length in (64, 100):
                g = torch.Generator(device).manual_seed(0)
                q, k, v = (
                    torch.randn(2, 4, length, 64, device=device, dtype=dtype, generator=g).requires_grad_()
                    for _ in range(3)
                )
                attend = torch.ones(2, 1, 1, length, dtype=torch.bool, device=device)
                attend[1] = False  # the second sequence: every key blocked
                try:
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)
                        out.float().square().sum().backward()
                except RuntimeError as err:
                    rows.append(
                        [
                            name,
                            str(dtype).removeprefix("torch."),
                            str(length),
                            f"refused ({str(err).splitlines()[0][:60]})",
                            "-",
                        ]
                    )
                    continue
                empty = out[1]
                verdict = "NaN" if empty.isnan().any() else ("zeros" if (empty == 0).all() else "finite, not zero")
                grads = "finite" if all(torch.isfinite(t.grad).all() for t in (q, k, v)) else "NaN/inf"
                rows.append([name, str(dtype).removeprefix("torch."), str(length), verdict, grads])
    return rows
