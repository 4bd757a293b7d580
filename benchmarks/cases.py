"""The cases of `python -m benchmarks`, in report order: what each section measures, with which builder of
`benchmarks.peers` or `benchmarks.scaling`, against which targets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from benchmarks import peers, scaling

# `--only gpu`: the CUDA-graph rows, at the sizes of Multi30k's validation (64 sentences, the whole val set)
GPU_DECODING = (("beam", 64), ("beam", 1014), ("greedy", 1014))


@dataclass(frozen=True)
class Case:
    """One benchmark row group. ``targets``: peer side -> the largest acceptable ratio ours/peer of
    step time (None: no target, reported only). A case without targets measures ours alone."""

    key: str
    section: str
    label: str
    build: Callable[[peers.Settings], peers.Bench]
    targets: dict[str, float | None] = field(default_factory=dict)


def cases(quick: bool) -> list[Case]:
    """Every case, in report order; keys are stable so a memory probe in a fresh process finds its case."""
    out = []
    attention_levels = (
        ("core", peers.core_bench, {"sdpa": 1.05}),
        ("attention", peers.attention_bench, {"sdpa": 1.05, "nn.MHA": 1.0}),
    )
    for length in (16, 32) if quick else (64, 256, 1024):
        for masked in (False, True):
            for section, build, targets in attention_levels:
                label = f"L={length}" + (", key padding" if masked else "")
                key = f"{section}/L={length}/{'padded' if masked else 'full'}"
                out.append(Case(key, section, label, partial(build, length, masked), targets))
    for length in (16, 32) if quick else (64, 256, 1024):
        for option, (_, target) in peers.OPTIONS.items():
            build = partial(peers.option_bench, length, option)
            out.append(
                Case(f"options/L={length}/{option}", "options", f"{option}, L={length}", build, {"softmax": target})
            )
    for name in ("vit_tiny", "vit_small"):
        out.append(Case(f"vit/{name}", "vit", name, partial(peers.vit_bench, name), {"timm": 1.0}))
    out.append(
        Case(
            "vit/vit_dispatch",
            "vit",
            "vit_dispatch (tiny tensors)",
            partial(peers.vit_bench, "vit_dispatch", batch=2),
            {"timm": 1.0},
        )
    )
    for size in ("small", "base"):
        out.append(
            Case(f"text/{size}", "text", f"seq2seq {size}", partial(peers.seq2seq_bench, size), {"nn.Transformer": 1.0})
        )
    out.append(
        Case(
            "decoding/beam", "decoding", "beam search, beam 5", partial(peers.decoding_bench, "beam"), {"no cache": 0.2}
        )
    )
    out.append(
        Case("decoding/greedy", "decoding", "greedy", partial(peers.decoding_bench, "greedy"), {"no cache": None})
    )
    out.append(static_cache_case("beam", 64))
    for size in ("small", "r50"):
        out.append(Case(f"detr/{size}", "detr", f"DETR {size}", partial(peers.detr_bench, size), {"HF DETR": 1.0}))
    for shape in peers.MATCHING_SHAPES:
        out.append(
            Case(
                f"detr/matching/{shape}",
                "detr",
                f"matching, {shape}",
                partial(peers.matching_bench, shape),
                {"HF matcher": 1.0},
            )
        )
    out.append(Case("scaling/text", "scaling", "text", scaling.text_scaling_bench))
    out.append(Case("scaling/vit", "scaling", "ViT tiny", scaling.vit_scaling_bench))
    out.append(Case("scaling/detr", "scaling", "DETR small", scaling.detr_scaling_bench))
    return out


def static_cache_case(search: str, sentences: int, prefix: str = "decoding") -> Case:
    """Decoding on the static cache (a CUDA graph per step on CUDA) vs the dynamic cache, Multi30k-shaped; a
    decoding case (timed without profiling) also where the gpu section runs it."""
    label = f"{'beam 5' if search == 'beam' else 'greedy'}, {sentences} sentences, static cache"
    return Case(
        f"{prefix}/static_cache/{search}/{sentences}",
        "decoding",
        label,
        partial(peers.static_cache_bench, search, sentences),
        {"dynamic cache": None},
    )
