"""Decoding cases: beam search and greedy decoding with the key/value cache vs without it, and on the static
cache vs the dynamic one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from benchmarks.harness import Step
from benchmarks.peers.bench import Bench, Settings
from benchmarks.peers.text import random_sentences
from models.text.decoding import beam_search, greedy_decode
from models.text.seq2seq import Seq2SeqTransformer


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
