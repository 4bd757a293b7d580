"""Translation case: our encoder-decoder training step vs the same model on torch.nn.Transformer."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from benchmarks.peers.bench import Bench, Settings, max_diff, train_step
from models.core.position import sinusoidal_encoding
from models.text.seq2seq import Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing

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
        check = f"same weights, eval logits max |Δ| {max_diff(ours.eval()(src, tgt_in)[keep], theirs.eval()(src, tgt_in)[keep]):.1e}"
    ours.train(), theirs.train()

    def loss(m: nn.Module) -> Tensor:
        return label_smoothed_nll_loss(m(src, tgt_in), labels, 0.1, 0)[0]

    steps = {side: train_step(s.maybe_compile(m), loss, s) for side, m in (("ours", ours), ("nn.Transformer", theirs))}
    return Bench(steps, items=int(labels.ne(0).sum()), unit="tokens", check=check)
