"""Differential attention (Ye et al. 2024, "Differential Transformer", arXiv 2410.05258) as an attnlab kernel of
one's own: a researcher's file outside the package, named in a config with this folder on ``PYTHONPATH``::

    model:
      init_args:
        attention:
          kernel: {class_path: diff_attention.DiffAttention, init_args: {lambda_init: 0.8}}

    PYTHONPATH=docs/examples attnlab fit --config configs/vision/digits.yaml --config that.yaml

Per head (size d), the queries and keys split into halves q1, q2 and k1, k2 of size d/2:

    A   = softmax(q1 k1ᵀ / √(d/2)) - λ · softmax(q2 k2ᵀ / √(d/2))        (B, H, Lq, Lk)
    out = (1 - λ_init) · RMSNorm(A v)                                     (B, H, Lq, d), over each head's d
    λ   = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init

λq1, λk1, λq2, λk2 are learned vectors of size d/2 shared by the heads of a layer, drawn from N(0, 0.1²) as in the
authors' code (microsoft/unilm, Diff-Transformer); the RMSNorm (their GroupNorm) has a learned scale of size d shared
by the heads. λ_init is a constructor argument: the paper sets it by depth, 0.8 - 0.6·exp(-0.3·(l - 1)) at layer l,
0.8 deep in the stack.

As attnlab runs it: each head of size d is one differential head (the authors' head_dim is d/2: their 2H sub-heads of
q and k are these H heads' halves, their value heads are these), so a model keeps its ``num_heads`` and parameter count
beside softmax attention. Rotary positions rotate the whole head before the kernel, the authors' each half. The
forward returns ``out`` alone: A is no distribution (negative where the second map outweighs the first), so
attention maps and statistics do not apply, and attnlab leaves them out with one warning. `maps` gives the two
softmax maps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DiffAttention(nn.Module):
    """Differential attention over q (B, H, Lq, d), k and v (B, H, Lk, d), True in ``blocked`` (B|1, H|1, Lq, Lk)
    where a query may not see a key.

    Args:
        num_heads: H (given by attnlab's attention layer).
        head_dim: d, even (given by the layer).
        lambda_init: λ_init, the start of λ and the output's scale 1 - λ_init.
        dropout: dropout on A during training (the layer's attention dropout).
    """

    def __init__(self, num_heads: int, head_dim: int, lambda_init: float = 0.8, dropout: float = 0.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"DiffAttention splits each head into two halves; head_dim={head_dim} is odd")
        half = head_dim // 2
        self.lambda_init, self.dropout = lambda_init, dropout
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(half) * 0.1) for _ in range(4)
        )
        self.norm = nn.RMSNorm(head_dim, eps=1e-5)

    def lambda_full(self) -> Tensor:
        """λ, a scalar."""
        return (
            torch.exp(self.lambda_q1 @ self.lambda_k1) - torch.exp(self.lambda_q2 @ self.lambda_k2) + self.lambda_init
        )

    def maps(self, q: Tensor, k: Tensor, blocked: Tensor | None) -> tuple[Tensor, Tensor]:
        """softmax(q1 k1ᵀ / √(d/2)) and softmax(q2 k2ᵀ / √(d/2)), each (B, H, Lq, Lk): zero at blocked keys, and in
        a row whose keys are all blocked."""
        half = q.size(-1) // 2
        logits = torch.stack(
            [q[..., :half] @ k[..., :half].transpose(-2, -1), q[..., half:] @ k[..., half:].transpose(-2, -1)]
        ) / math.sqrt(half)  # (2, B, H, Lq, Lk)
        if blocked is None:
            return tuple(logits.softmax(-1))
        empty = blocked.all(-1, keepdim=True)  # such a row softmaxes zeros (no NaN, even in between), then is zeroed
        logits = logits.masked_fill(blocked & ~empty, float("-inf")).masked_fill(empty, 0.0)
        return tuple(logits.softmax(-1).masked_fill(blocked, 0.0))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, blocked: Tensor | None) -> Tensor:
        first, second = self.maps(q, k, blocked)
        a = F.dropout(first - self.lambda_full() * second, self.dropout, self.training)  # (B, H, Lq, Lk)
        return self.norm(a @ v) * (1 - self.lambda_init)  # (B, H, Lq, d)
