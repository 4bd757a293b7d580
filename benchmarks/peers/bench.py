"""What every case of `benchmarks.peers` shares: the run `Settings`, the `Bench` a builder returns, the
AdamW training step both sides take, and the measures of how far two sides' outputs are apart."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from benchmarks.harness import Step


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


def max_diff(a: Tensor, b: Tensor) -> float:
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


def training_flops(model: nn.Module, loss_fn: Callable[[nn.Module], Tensor]) -> int:
    """FLOPs of one forward + backward (torch.utils.flop_counter; matmuls, convolutions, SDPA on every device)."""
    from torch.utils.flop_counter import FlopCounterMode

    import experiments.flops  # noqa: F401  (registers the SDPA formulas torch lacks on the CPU)

    with FlopCounterMode(display=False) as counter:
        loss_fn(model).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()
