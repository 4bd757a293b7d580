"""The side-by-side cases of `python -m benchmarks`: each of our models against its peer, with the
same shapes, weights where the layouts allow it, precision, optimiser and loss.

A case builder takes the `Settings` and returns a `Bench`: one callable per side that runs one step
(forward + backward, or a training step with AdamW, or one beam search), ``"ours"`` first. Where the
peer can hold our weights (nn.MultiheadAttention, timm's ViT, torch.nn.Transformer), the builder
loads them and records in ``Bench.check`` how far the two outputs are apart, so a ratio is never
a comparison of two different computations.

One module per subject: ``bench`` (what every case shares), ``attention`` (the core and the layer),
``padding`` (padded batches by each padding path), ``vit``, ``text``, ``decoding`` and ``detr``; the
builders are imported here, the names `benchmarks.cases` and the tests use.
"""

from benchmarks.peers.attention import OPTIONS, SDPAAttention, attention_bench, core_bench, option_bench, padding_mask
from benchmarks.peers.bench import Bench, Settings
from benchmarks.peers.decoding import WithoutCache, decoding_bench, static_cache_bench
from benchmarks.peers.detr import MATCHING_SHAPES, detr_bench, matching_bench
from benchmarks.peers.padding import padded_attention_bench, padded_seq2seq_bench
from benchmarks.peers.text import random_sentences, seq2seq_bench, seq2seq_models
from benchmarks.peers.vit import QUICK_VIT, vit_bench, vit_pair

__all__ = [
    "MATCHING_SHAPES",
    "QUICK_VIT",
    "Bench",
    "SDPAAttention",
    "Settings",
    "WithoutCache",
    "attention_bench",
    "OPTIONS",
    "option_bench",
    "core_bench",
    "decoding_bench",
    "detr_bench",
    "matching_bench",
    "padded_attention_bench",
    "padded_seq2seq_bench",
    "padding_mask",
    "random_sentences",
    "seq2seq_bench",
    "seq2seq_models",
    "static_cache_bench",
    "vit_bench",
    "vit_pair",
]
