"""The run summary's ``attention.png``: one heat map per layer."""

from __future__ import annotations

from pathlib import Path

import torch


def plot_attention_maps(maps: dict[str, torch.Tensor], path: Path, columns: int = 4) -> None:
    """One heat map per layer: ``maps`` name -> (Lq, Lk) weights (e.g. the head mean of one sample)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, nothing to close

    names = list(maps)
    cols = min(columns, len(names)) or 1
    rows = max(1, -(-len(names) // cols))
    fig = Figure(figsize=(3 * cols, 3 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, name in zip(axes.flat, names):
        ax.imshow(maps[name].float().numpy(), cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.axis("on")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
