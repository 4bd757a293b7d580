"""What both text models share: the token embedding and the check that the heads split the width."""

from __future__ import annotations

import math

from torch import Tensor, nn


class TokenEmbedding(nn.Module):
    """Token embedding, multiplied by √d_model (Vaswani et al. §3.4) when ``scale``.

    With scaling, weights start at N(0, d_model^-1/2) (fairseq), so scaled embeddings have unit
    size and the same matrix serves as output projection when tied. Shapes: (B, L) -> (B, L, D).
    """

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None, scale: bool = True):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        self.scale = math.sqrt(d_model) if scale else 1.0
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5 if scale else 0.02)
        if padding_idx is not None:
            nn.init.zeros_(self.embedding.weight[padding_idx])

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens) * self.scale


def check_heads(d_model: int, nhead: int) -> None:
    """The heads split the width evenly; refused with the option names, where the values enter."""
    if nhead < 1 or d_model % nhead:
        raise ValueError(f"model.nhead={nhead} does not divide model.d_model={d_model}; choose a divisor of {d_model}")
