"""A decoder-only language model (GPT, Radford et al. 2018) on the shared core: causal self-attention blocks.

It decodes incrementally: pass ``cache`` (one cache per layer, from ``init_cache()``) and the position of the new
tokens, and each step attends to the cached keys/values of the prefix. ``positions`` as in `models.text.seq2seq`.

Packed documents (Llama 3's document masking; HF's padding-free collator): with ``document_ids`` (B, T) a token
attends only to the earlier tokens of its own document, and its position is its place in that document (from 0 at the
document's first token in the block), so a block of several documents computes what each document computes alone.
ALiBi's and T5's biases are relative and the pairs across documents are masked, so they need nothing more.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from models.core.attention import DEFAULT_ATTENTION, AttentionConfig
from models.core.kv_cache import KVCache, StaticKVCache
from models.core.masks import Documents
from models.core.position import Positions, SelfAttentionPositions, positional_encoding
from models.core.registers import WithRegisters, insert_registers, learned_registers
from models.core.transformer import Activation, Norm, TransformerEncoder
from models.text.decoding import CacheKind, DecodingStep, cache_kind
from models.text.embedding import TokenEmbedding, check_heads


class DecoderOnlyLM(nn.Module, WithRegisters):
    """A GPT-style language model: causal self-attention blocks only, tied input/output embeddings.

    Llama (Touvron et al. 2023) is ``positions="rope"``, ``norm="rmsnorm"``, ``activation="swiglu"``,
    ``bias=False`` and, from Llama 2 on, ``num_kv_heads`` < ``nhead`` (grouped-query attention).

    Args:
        vocab_size: tokens.
        d_model: width; ``nhead`` must divide it.
        nhead: attention heads.
        num_layers: blocks.
        dim_feedforward: MLP width (4·d_model when not given).
        dropout: dropout on embeddings and after attention and MLP; also inside attention and the MLP unless
            the next two are given.
        attn_dropout: dropout on the attention weights (fairseq's ``attention_dropout``); None: ``dropout``.
        activation_dropout: dropout after the MLP's activation (fairseq's); None: ``dropout``.
        activation: MLP activation (see `models.core.transformer`; "swiglu": Llama's gated MLP).
        norm_first: pre-norm blocks with a final norm (GPT-2); post-norm when false.
        attention: the attention block (similarity, qk_norm, normalization, gate; see `models.core.attention`).
        positions: "learned" (GPT), "sinusoidal", "sinusoidal_concat", "rope", "alibi" or "t5" (module docstring).
        max_positions: the longest training context (block size): the learned table's length (sines, RoPE, ALiBi
            and T5 have no bound; `generate` slides its window at this length).
        resample_positions: learned positions beyond ``max_positions`` interpolate the table (see
            `models.core.position.LearnedPositionalEncoding`) instead of raising a ValueError.
        rope_theta: RoPE's frequency base θ (positions=rope).
        tie_embeddings: the output projection is the token embedding matrix.
        norm: the blocks' and the final norm: "layernorm" (GPT) or "rmsnorm" (Llama).
        layer_norm_eps: the norms' ε.
        bias: biases on the attention's and the MLP's projections (GPT: true, Llama: false).
        num_kv_heads: key/value heads, a divisor of ``nhead`` (grouped-query attention); None: ``nhead``.
        scale_embeddings: token embeddings start at N(0, d_model^-1/2) and are multiplied by √d_model (fairseq's
            LM, as in Press et al. 2022), so they keep pace with unit-amplitude sines; false: GPT-2's N(0, 0.02).
        register_tokens: N learned sink tokens (StreamingLLM's dedicated attention sink, Xiao et al. 2023;
            `models.core.registers`, ``reg_token``) before the tokens, which keep a context of ``max_positions``: inside
            attention (RoPE, ALiBi, T5) the sinks take positions 0..N-1 and the tokens follow; added positions
            are the tokens' own (`inputs`). Every token attends to them; their logits are dropped, so no loss
            reads them.
        init_values: LayerScale on every residual branch (see `models.core.transformer`); None: none.
    Shapes: tokens (B, T) -> logits (B, T, vocab_size).
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 384,
        nhead: int = 6,
        num_layers: int = 6,
        dim_feedforward: int | None = None,
        dropout: float = 0.2,
        activation: Activation = "gelu",
        norm_first: bool = True,
        attention: AttentionConfig = DEFAULT_ATTENTION,
        positions: Positions = "learned",
        max_positions: int = 256,
        tie_embeddings: bool = True,
        attn_dropout: float | None = None,
        activation_dropout: float | None = None,
        rope_theta: float = 10000.0,
        norm: Norm = "layernorm",
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
        num_kv_heads: int | None = None,
        resample_positions: bool = False,
        scale_embeddings: bool = False,
        register_tokens: int = 0,
        init_values: float | None = None,
    ):
        super().__init__()
        check_heads(d_model, nhead)
        self.reg_token = learned_registers(register_tokens, d_model)
        if num_kv_heads is not None and (num_kv_heads < 1 or nhead % num_kv_heads):
            raise ValueError(
                f"model.num_kv_heads={num_kv_heads} does not divide model.nhead={nhead}; choose a divisor of {nhead}"
            )
        self.max_positions = max_positions
        self.tok_embed = TokenEmbedding(vocab_size, d_model, scale=scale_embeddings)
        self.pos = positional_encoding(positions, d_model, max_positions, resample_positions)
        self.attn_positions = SelfAttentionPositions(positions, d_model, nhead, True, rope_theta)
        self.dropout = nn.Dropout(dropout)
        self.blocks = TransformerEncoder(
            num_layers,
            d_model,
            nhead,
            final_norm=norm_first,
            dim_feedforward=dim_feedforward or 4 * d_model,
            dropout=dropout,
            attn_dropout=attn_dropout,
            activation_dropout=activation_dropout,
            activation=activation,
            norm_first=norm_first,
            attention=attention,
            norm=norm,
            layer_norm_eps=layer_norm_eps,
            bias=bias,
            num_kv_heads=num_kv_heads,
            init_values=init_values,
        )
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self._init_weights(num_layers)
        if tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def _init_weights(self, num_layers: int) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/√(2·layers)."""
        for name, p in self.blocks.named_parameters():
            if p.dim() > 1 and not name.endswith("general_weight"):  # `general` starts at the identity
                std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("linear2.weight", "out_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"tok_embed.embedding.weight", "pos.weight", "relative_attention_bias.weight", "reg_token"}

    def register_keys(self) -> dict[str, slice]:
        """The attention layers whose keys include the sinks -> their key positions: the first N of every block."""
        if not self.num_registers:
            return {}
        return {f"blocks.layers.{i}.self_attn": slice(0, self.num_registers) for i in range(len(self.blocks.layers))}

    def init_cache(self, max_len: int | None = None) -> list[KVCache] | list[StaticKVCache]:
        """One cache per block; with ``max_len`` a `StaticKVCache` of that many positions (static shapes)."""
        return [KVCache() if max_len is None else StaticKVCache(max_len) for _ in self.blocks.layers]

    def forward(
        self,
        tokens: Tensor,
        cache: list[KVCache] | list[StaticKVCache] | None = None,
        start_pos: int = 0,
        document_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """tokens (B, T) at positions ``start_pos``.. -> logits (B, T, V); with ``cache``, earlier tokens are cached.
        The sinks (``register_tokens``) come first in a call at ``start_pos`` 0 (a whole sequence, or the first
        call on a cache); later calls continue a cache that holds them. ``document_ids`` (B, T): packed documents
        (`packed_inputs`; ``position_ids`` (B, T), each token's place in its document, < T, else derived)."""
        if document_ids is not None:
            return self.forward_embedded(*self.packed_inputs(tokens, document_ids, position_ids, cache))
        return self.forward_embedded(*self.inputs(tokens, start_pos), cache=cache)[:, -tokens.size(1) :]

    def inputs(self, tokens: Tensor, start_pos: int = 0) -> tuple[Tensor, dict]:
        """What depends on the position (a host int): tokens (B, T) -> their embedding (B, T, D), after the N sinks
        at ``start_pos`` 0 (B, N + T, D), and the self-attention's positions (`SelfAttentionPositions`): there the
        sinks take positions 0..N-1 and token t position N + t. Added positions (learned, sines) are the tokens'
        own, t, as without sinks: a sink is a learned vector already. A CUDA graph of a step reads both from buffers."""
        x, n = self.tok_embed(tokens), self.num_registers  # (B, T, D)
        if self.pos is not None:
            x = x + self.pos(tokens.size(1), start_pos)
        if n and start_pos == 0:
            x = insert_registers(x, self.reg_token, 0)  # (B, N + T, D)
        return self.dropout(x), self.attn_positions(x.size(1), start_pos + n if start_pos else 0)

    def packed_inputs(
        self, tokens: Tensor, document_ids: Tensor, position_ids: Tensor | None, cache: list | None = None
    ) -> tuple[Tensor, dict]:
        """`inputs` of a block of packed documents: tokens and ``document_ids`` (B, T) -> their embedding (B, T, D)
        at ``position_ids`` (B, T) (`document_positions` when None), and the self-attention's positions with the
        document mask (`models.core.masks.Documents`)."""
        if self.num_registers:
            raise ValueError(
                f"model.register_tokens={self.num_registers}: the sinks belong to no document; packed documents "
                "(data.documents=true) take none"
            )
        if cache is not None:
            raise ValueError("document ids are for packed training blocks; decoding with a cache takes none")
        positions = document_positions(document_ids) if position_ids is None else position_ids  # (B, T)
        x = self.tok_embed(tokens)  # (B, T, D)
        if self.pos is not None:
            x = x + self.pos(tokens.size(1))[positions]  # a token's place in its document is < T
        attn = self.attn_positions(tokens.size(1))
        if "rope" in attn:  # cos/sin (B, 1, T, d): each token's own angles, for every head
            attn = {"rope": self.attn_positions.rope.at(positions[:, None])}
        return self.dropout(x), {**attn, "mask": Documents(document_ids)}

    def forward_embedded(
        self, x: Tensor, positions: dict, cache: list[KVCache] | list[StaticKVCache] | None = None
    ) -> Tensor:
        """The rest of `forward`: x (B, L, D) and positions from `inputs` -> logits (B, L, V), the sinks' rows
        included (`forward` drops them)."""
        return self.lm_head(self.blocks(x, is_causal=True, cache=cache, **positions))

    def _step(self, kind: CacheKind, window: int, cuda: bool) -> DecodingStep:
        """A new cache of ``window`` tokens (and the sinks) and the step that decodes on it: (tokens (B, T),
        start_pos) -> logits (B, L, V), L = T, or N + T with the sinks at the first call."""
        max_len = window + self.num_registers if kind == "static" else None
        layers = self.init_cache(max_len)

        def body(x: Tensor, positions: dict) -> Tensor:
            return self.forward_embedded(x, positions, layers)

        return DecodingStep(self.inputs, body, layers, max_len, graph=cuda and max_len is not None)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
        cache: CacheKind = "dynamic",
    ) -> Tensor:
        """Continue ``prompt`` (B, T0) by ``max_new_tokens`` sampled tokens -> (B, T0 + max_new_tokens).

        ``temperature`` 0 picks the most likely token (greedy); ``top_k`` samples among the k most
        likely. Each new token costs one cached step; once the context exceeds ``max_positions`` the window
        slides and is re-encoded (after the sinks, which stay), since absolute positions cannot shift inside a
        cache. ``use_cache=False`` re-runs the whole window at every step (the reference the cache is tested against). ``cache``:
        "auto" (static on CUDA, else dynamic), "dynamic" or "static" (a `StaticKVCache` as long as the window, each
        step a CUDA graph on CUDA: see `models.text.decoding`).
        """
        if prompt.size(1) == 0:
            raise ValueError("generate needs a prompt of at least one token")
        cache = cache_kind(cache, prompt.device)
        tokens, step = prompt, None
        window = min(self.max_positions, prompt.size(1) + max_new_tokens)
        for _ in range(max_new_tokens):
            if use_cache and step is not None and tokens.size(1) <= self.max_positions:
                logits = step(tokens[:, -1:], tokens.size(1) - 1)[:, -1]  # (B, V)
            else:
                step = self._step(cache, window, prompt.is_cuda) if use_cache else None
                context = tokens[:, -self.max_positions :]
                logits = (self(context) if step is None else step(context, 0))[:, -1]
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = logits.topk(min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens


def document_positions(document_ids: Tensor) -> Tensor:
    """(B, T) document ids -> (B, T) each token's place in its run of equal ids: 0 where the id changes."""
    index = torch.arange(document_ids.size(1), device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(1).values  # minus the index of the run's first token
