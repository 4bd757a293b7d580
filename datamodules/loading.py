"""DataLoader settings that every DataModule takes: worker processes, pinned memory, persistent workers."""

from __future__ import annotations

import torch


def loader_settings(num_workers: int, pin_memory: bool | None, persistent_workers: bool) -> dict:
    """Keyword arguments for ``DataLoader``.

    ``num_workers``: loading processes (0: in the training process). ``pin_memory``: page-locked
    batches for faster host-to-GPU copies; None turns it on when CUDA is available.
    ``persistent_workers``: keep the workers alive between epochs (only meaningful with workers).
    """
    if num_workers < 0:
        raise ValueError(f"data.num_workers={num_workers} must be >= 0 (0 loads in the training process)")
    return dict(
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
    )
