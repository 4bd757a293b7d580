"""The Transformer encoder-decoder of Vaswani et al. (2017) for translation, on the shared core.

In the paper's vocabulary: token embeddings are scaled by √d_model and summed with positional
encodings; the encoder attends in both directions, with PAD keys blocked; the decoder attends
causally to its own prefix ("masked attention") and to the encoder memory ("encoder-decoder
attention": queries from the decoder, keys and values from the encoder). Training feeds the target
shifted right (`teacher_forcing`) and predicts the next token, up to EOS.

The decoder decodes incrementally: pass ``cache`` (one cache per layer, from ``init_cache()``) and
the position of the new tokens, and each step attends to the cached keys/values of the prefix.

``positions`` chooses how order enters: added to the embeddings ("sinusoidal", "sinusoidal_concat",
"learned") or inside each self-attention ("rope": queries and keys rotated, Su et al. 2021; "alibi":
linear biases, Press et al. 2022; "t5": T5's bucketed relative bias, one table per stack, Raffel et al.
2020). Cross-attention sees no positions in the last three, as in T5. ALiBi's bias in the encoder is
symmetric, -m·|i - j| (as MosaicBERT's): it tells near from far but not left from right.
"""

from __future__ import annotations

from torch import Tensor, nn

from models.core.attention import DEFAULT_ATTENTION, AttentionConfig
from models.core.kv_cache import StaticKVCache
from models.core.position import Positions, SelfAttentionPositions, positional_encoding
from models.core.registers import WithRegisters, insert_registers, learned_registers, pad_rows, unplaced
from models.core.transformer import Activation, DecoderLayerCache, TransformerDecoder, TransformerEncoder
from models.text.embedding import TokenEmbedding, check_heads


def teacher_forcing(tgt: Tensor) -> tuple[Tensor, Tensor]:
    """Split a target BOS y1 .. yn EOS (B, T) into the decoder input (the target shifted right:
    BOS y1 .. yn) and the labels (y1 .. yn EOS), both (B, T - 1)."""
    return tgt[:, :-1], tgt[:, 1:]


def label_smoothed_nll_loss(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> tuple[Tensor, Tensor]:
    """Cross-entropy against the smoothed distribution q = (1 - ε)·onehot(target) + ε·uniform, where the
    uniform part spreads over every class except PAD (Szegedy et al. 2016; the Annotated Transformer
    also gives PAD no mass). Positions whose target is ``ignore_index`` count for nothing.

    Shapes: logits (..., V), target (...) -> (loss, nll), each the mean over counted positions;
    ``nll`` is the unsmoothed negative log-likelihood (its exp is the perplexity).
    """
    logp = logits.float().log_softmax(-1)  # (..., V)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (...)
    uniform = -(logp.sum(-1) - logp[..., ignore_index]) / (logp.size(-1) - 1)  # mean -log p over non-PAD classes
    loss = (1 - epsilon) * nll + epsilon * uniform
    keep = target.ne(ignore_index)
    count = keep.sum().clamp(min=1)
    return loss.masked_fill(~keep, 0).sum() / count, nll.masked_fill(~keep, 0).sum() / count


class Seq2SeqTransformer(nn.Module, WithRegisters):
    """The Transformer encoder-decoder for translation.

    Args:
        src_vocab_size: source vocabulary.
        tgt_vocab_size: target vocabulary.
        d_model: width D (the paper's d_model); ``nhead`` must divide it.
        nhead: attention heads.
        num_encoder_layers: encoder layers.
        num_decoder_layers: decoder layers.
        dim_feedforward: hidden width of the MLPs.
        dropout: dropout on embeddings and after attention and MLP; also inside attention and the MLP unless
            the next two are given.
        attn_dropout: dropout on the attention weights (fairseq's ``attention_dropout``); None: ``dropout``.
        activation_dropout: dropout after the MLP's activation (fairseq's); None: ``dropout``.
        activation: MLP activation (the paper: relu; see `models.core.transformer`).
        norm_first: pre-norm layers with final norms; post-norm (the paper) when false.
        attention: the attention block (similarity, qk_norm, normalization, gate; see `models.core.attention`).
        positions: "sinusoidal" (the paper), "sinusoidal_concat" (sines, then cosines: Marian), "learned",
            "rope", "alibi" or "t5" (see the module docstring).
        max_positions: longest sequence the positions cover: the learned table's length (sines, RoPE, ALiBi and
            T5 have no bound).
        resample_positions: learned positions beyond ``max_positions`` interpolate the table (see
            `models.core.position.LearnedPositionalEncoding`) instead of raising a ValueError.
        rope_theta: RoPE's frequency base θ (positions=rope).
        share_embeddings: one embedding matrix for source and target (needs one shared vocabulary).
        tie_output: the output projection is the target embedding matrix (Press & Wolf 2017).
        pad_id: the PAD index, masked everywhere.
        scale_embeddings: token embeddings multiplied by √d_model (the paper).
        output_bias: a bias on the output projection (Marian's ``final_logits_bias``).
        register_tokens: N learned registers (`models.core.registers`, ``reg_token``) appended to the encoder's
            tokens: no position, never masked; they stay in the memory, where the decoder's cross-attention sees them.
        init_values: LayerScale on every residual branch (see `models.core.transformer`); None: none.
    Shapes: src (B, S), tgt (B, T) token ids -> logits (B, T, tgt_vocab_size).
    """

    def __init__(
        self,
        src_vocab_size: int,
        tgt_vocab_size: int,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        attention: AttentionConfig = DEFAULT_ATTENTION,
        positions: Positions = "sinusoidal",
        max_positions: int = 256,
        share_embeddings: bool = False,
        tie_output: bool = True,
        pad_id: int = 0,
        scale_embeddings: bool = True,
        output_bias: bool = False,
        attn_dropout: float | None = None,
        activation_dropout: float | None = None,
        rope_theta: float = 10000.0,
        resample_positions: bool = False,
        register_tokens: int = 0,
        init_values: float | None = None,
    ):
        super().__init__()
        check_heads(d_model, nhead)
        if share_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(
                f"model.share_embeddings=true needs one vocabulary for both languages, got src_vocab_size={src_vocab_size} "
                f"and tgt_vocab_size={tgt_vocab_size}; set data.shared_vocab=true"
            )
        self.pad_id, self.max_positions = pad_id, max_positions
        self.src_embed = TokenEmbedding(src_vocab_size, d_model, pad_id, scale_embeddings)
        self.tgt_embed = (
            self.src_embed if share_embeddings else TokenEmbedding(tgt_vocab_size, d_model, pad_id, scale_embeddings)
        )
        self.pos = positional_encoding(positions, d_model, max_positions, resample_positions)
        self.encoder_positions = SelfAttentionPositions(positions, d_model, nhead, False, rope_theta)
        self.decoder_positions = SelfAttentionPositions(positions, d_model, nhead, True, rope_theta)
        self.dropout = nn.Dropout(dropout)
        layer = dict(
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            attn_dropout=attn_dropout,
            activation_dropout=activation_dropout,
            activation=activation,
            norm_first=norm_first,
            attention=attention,
            init_values=init_values,
        )
        self.encoder = TransformerEncoder(num_encoder_layers, d_model, nhead, final_norm=norm_first, **layer)
        self.decoder = TransformerDecoder(num_decoder_layers, d_model, nhead, final_norm=norm_first, **layer)
        self.generator = nn.Linear(d_model, tgt_vocab_size, bias=output_bias)  # the pre-softmax projection
        self._init_weights()
        if tie_output:
            self.generator.weight = self.tgt_embed.weight
        self.reg_token = learned_registers(register_tokens, d_model)

    def _init_weights(self) -> None:
        """Xavier for the stacks' and the output projection's matrices, as in the Annotated Transformer (the core's
        `general` map keeps its identity start: it begins equal to `dot`); a zero output bias."""
        for name, p in self.named_parameters():
            if (
                p.dim() > 1
                and name.startswith(("encoder.", "decoder.", "generator."))
                and not name.endswith("general_weight")
            ):
                nn.init.xavier_uniform_(p)
        if self.generator.bias is not None:
            nn.init.zeros_(self.generator.bias)

    def no_weight_decay(self) -> set[str]:
        return {
            "src_embed.embedding.weight",
            "tgt_embed.embedding.weight",
            "pos.weight",
            "relative_attention_bias.weight",
            "reg_token",
        }

    def register_keys(self) -> dict[str, slice]:
        """The attention layers whose keys include the registers -> their key positions: the last N of the
        encoder's self-attention and of the decoder's cross-attention (the memory)."""
        if not self.num_registers:
            return {}
        names = [f"encoder.layers.{i}.self_attn" for i in range(len(self.encoder.layers))]
        names += [f"decoder.layers.{i}.multihead_attn" for i in range(len(self.decoder.layers))]
        return dict.fromkeys(names, slice(-self.num_registers, None))

    def init_cache(self, max_len: int | None = None) -> list[DecoderLayerCache]:
        """One cache per decoder layer; with ``max_len`` the self-attention's is a `StaticKVCache` of that many
        positions (static shapes: `models.text.decoding` can replay a step as a CUDA graph)."""
        if max_len is None:
            return [DecoderLayerCache() for _ in self.decoder.layers]
        return [DecoderLayerCache(self_attn=StaticKVCache(max_len)) for _ in self.decoder.layers]

    def _embed(self, embed: TokenEmbedding, tokens: Tensor, start_pos: int = 0) -> Tensor:
        x = embed(tokens)
        return self.dropout(x if self.pos is None else x + self.pos(tokens.size(1), start_pos))  # (B, L, D)

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """src (B, S) -> memory (B, S + N, D), the N registers last. PAD keys are blocked (mask from ``pad_id``
        when not given); `decode` takes the same (B, S) mask with this memory."""
        if src_key_padding_mask is None:
            src_key_padding_mask = src.eq(self.pad_id)
        x, length, n = self._embed(self.src_embed, src), src.size(1), self.num_registers
        positions = self.encoder_positions(length)
        if n:
            x = insert_registers(x, self.reg_token, length)  # (B, S + N, D)
            positions = unplaced(positions, length, n)
        return self.encoder(x, src_key_padding_mask=pad_rows(src_key_padding_mask, n, False), **positions)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None,
        tgt_key_padding_mask: Tensor | None = None,
        cache: list[DecoderLayerCache] | None = None,
        start_pos: int = 0,
    ) -> Tensor:
        """tgt (B, T) decoder input (BOS first), memory (B, S + N, D) from `encode`, its source's padding mask
        (B, S) -> logits (B, T, V).

        With ``cache``, ``tgt`` holds only the new tokens, at positions ``start_pos`` onwards, and
        attends to the cached prefix; the causal mask is aligned to the end of the keys.
        """
        x, positions = self.decode_inputs(tgt, start_pos)
        return self.decode_embedded(x, memory, memory_key_padding_mask, tgt_key_padding_mask, cache, positions)

    def decode_inputs(self, tgt: Tensor, start_pos: int = 0) -> tuple[Tensor, dict]:
        """What depends on the position (a host int): tgt (B, T) -> its embedding (B, T, D) and the
        self-attention's positions (`SelfAttentionPositions`). A CUDA graph of a step reads both from buffers."""
        return self._embed(self.tgt_embed, tgt, start_pos), self.decoder_positions(tgt.size(1), start_pos)

    def decode_embedded(
        self,
        x: Tensor,
        memory: Tensor,
        memory_key_padding_mask: Tensor | None,
        tgt_key_padding_mask: Tensor | None = None,
        cache: list[DecoderLayerCache] | None = None,
        positions: dict | None = None,
    ) -> Tensor:
        """The rest of `decode`: x (B, T, D) and positions from `decode_inputs` -> logits (B, T, V)."""
        h = self.decoder(
            x,
            memory,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=pad_rows(memory_key_padding_mask, self.num_registers, False),  # (B, S + N)
            tgt_is_causal=True,
            cache=cache,
            **(positions or {}),
        )  # (B, T, D)
        return self.generator(h)

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        """Teacher forcing: src (B, S), tgt (B, T) the shifted-right target -> logits (B, T, V).
        PAD keys of the target are blocked, except the first: it is the start token (Marian starts with PAD)."""
        src_mask, tgt_mask = src.eq(self.pad_id), tgt.eq(self.pad_id)
        tgt_mask[:, 0] = False
        return self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask)
