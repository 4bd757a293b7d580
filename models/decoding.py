"""Decoding for encoder-decoder models: greedy search and batched beam search.

Both work with any model that has ``encode(src, src_key_padding_mask) -> memory``,
``decode(tgt, memory, memory_key_padding_mask, cache=, start_pos=) -> logits`` and
``init_cache()`` (see `models.text.Seq2SeqTransformer`): a list of per-layer caches, each with
``reorder(index, static_index)`` (see `models.attention.KVCache`). The encoder runs once; the decoder
runs one token per step on its cache of keys and values, so a step costs one position, not a re-run
of the whole prefix. ``max_len`` counts generated tokens, EOS included; the last step is forced to
EOS, so every hypothesis ends with EOS. Outputs exclude BOS and are padded with PAD after EOS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT's length normalisation ((5 + |Y|) / 6)^α (Wu et al. 2016), used by Vaswani et al. with α = 0.6."""
    return ((5 + length) / 6) ** alpha


def _top_log_probs(logits: Tensor, n: int, eos_id: int, force_eos: bool, banned: Tensor) -> tuple[Tensor, Tensor]:
    """The ``n`` most likely next tokens of each row and their log-probabilities, (N, n) each.

    log p = logit - logsumexp(logits), taken for the ``n`` chosen tokens only: the (N, V)
    log-probabilities are never written out, which is most of a cached decoding step's time besides
    the output projection. ``banned`` token ids (PAD, BOS; a tensor on the logits' device) are never
    chosen; at the length limit (``force_eos``) only EOS is, the other columns holding -inf, as do the
    columns past the vocabulary when ``n`` exceeds it.
    """
    logits = logits.float()
    lse = logits.logsumexp(-1, keepdim=True)  # (N, 1)
    if force_eos:
        chosen = logits[:, eos_id : eos_id + 1] - lse  # (N, 1)
        rest = torch.full((logits.size(0), n - 1), float("-inf"), device=logits.device)
        tokens = torch.full((logits.size(0), n), eos_id, dtype=torch.long, device=logits.device)
        return torch.cat([chosen, rest], dim=1), tokens
    logits = logits.index_fill(-1, banned, float("-inf"))
    values, tokens = logits.topk(min(n, logits.size(-1)), dim=-1)
    if tokens.size(1) < n:  # a beam wider than the vocabulary: the missing candidates can never win
        values, tokens = (
            F.pad(values, (0, n - values.size(1)), value=float("-inf")),
            F.pad(tokens, (0, n - tokens.size(1)), value=eos_id),
        )
    return values - lse, tokens


@torch.no_grad()
def greedy_decode(
    model: nn.Module, src: Tensor, *, bos_id: int, eos_id: int, pad_id: int, max_len: int, use_cache: bool = True
) -> tuple[Tensor, Tensor]:
    """Pick the most likely token at each step.

    src (B, S) -> (tokens (B, L) with L <= max_len, log-probability of each sequence (B,)).
    ``use_cache=False`` re-runs the decoder on the whole prefix at every step (the reference).
    """
    src_mask = src.eq(pad_id)
    memory = model.encode(src, src_mask)  # (B, S, D)
    batch = src.size(0)
    ys = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    cache = model.init_cache() if use_cache else None
    banned = torch.tensor([pad_id, bos_id], device=src.device)  # never generated
    for t in range(max_len):
        if use_cache:
            logits = model.decode(ys[:, -1:], memory, src_mask, cache=cache, start_pos=t)[:, -1]  # (B, V)
        else:
            logits = model.decode(ys, memory, src_mask)[:, -1]
        logp, next_token = _top_log_probs(logits, 1, eos_id, t == max_len - 1, banned)  # (B, 1) each
        scores += logp.squeeze(1).masked_fill(finished, 0.0)
        next_token = next_token.squeeze(1).masked_fill(finished, pad_id)  # (B,)
        ys = torch.cat([ys, next_token[:, None]], dim=1)
        finished |= next_token.eq(eos_id)
        if finished.all():
            break
    return ys[:, 1:], scores


@torch.no_grad()
def beam_search(
    model: nn.Module,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> tuple[Tensor, Tensor]:
    """Keep the ``beam_size`` best prefixes of every sentence, all sentences in one batch.

    Each step extends every live prefix by every token and keeps, per sentence, the 2k best
    candidates: those ending in EOS within the top k become finished hypotheses, scored by
    log-probability / `length_penalty`; the first k others live on. A sentence is done when it
    holds k finished hypotheses (fairseq's rule); done sentences leave the batch, and the cache is
    reordered (dim 0 of every tensor) to follow the surviving prefixes. The encoder memory and the
    cross-attention keys/values are held once per sentence, not once per beam (`MultiHeadAttention`
    lets the k beam rows of a sentence attend to its one memory row).

    src (B, S) -> (best hypothesis per sentence (B, L), its normalised score (B,)).
    With ``beam_size=1`` this is `greedy_decode`.
    """
    k = beam_size
    src_mask = src.eq(pad_id)
    memory = model.encode(src, src_mask)  # (B, S, D): one row per sentence, which its k beams attend to together
    batch, device = src.size(0), src.device
    cache = model.init_cache()
    banned = torch.tensor([pad_id, bos_id], device=device)  # never generated
    alive = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)  # live prefixes, BOS first
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # all beams start equal: expand only the first at step 0
    done_scores = torch.full((batch, k), float("-inf"), device=device)  # finished hypotheses per sentence
    done_tokens = torch.full((batch, k, max_len), pad_id, dtype=torch.long, device=device)
    active = torch.arange(batch, device=device)  # sentence index of each block of k rows
    first_k = torch.arange(2 * k, device=device) < k
    for t in range(max_len):
        n = active.numel()
        logits = model.decode(alive[:, -1:], memory, src_mask, cache=cache, start_pos=t)[:, -1]  # (n·k, V)
        # a sentence's 2k best candidates are among its beams' 2k best tokens each: rank those alone
        logp, tokens = _top_log_probs(logits, 2 * k, eos_id, t == max_len - 1, banned)  # (n·k, 2k)
        candidates = (scores.unsqueeze(-1) + logp.view(n, k, 2 * k)).view(n, 2 * k * k)
        top_scores, top = candidates.topk(2 * k, dim=1)  # (n, 2k)
        beam, token = top // (2 * k), tokens.view(n, 2 * k * k).gather(1, top)
        rows = torch.arange(n, device=device)[:, None] * k + beam  # (n, 2k) row of each candidate's prefix
        is_eos = token.eq(eos_id)

        # finished: EOS among the k best candidates, merged with earlier finished hypotheses
        finish = is_eos & first_k & top_scores.isfinite()
        normalised = (top_scores / length_penalty(t + 1, alpha)).masked_fill(~finish, float("-inf"))
        new_tokens = torch.cat([alive[rows][..., 1:], token[..., None]], dim=-1)  # (n, 2k, t + 1)
        new_tokens = F.pad(new_tokens, (0, max_len - t - 1), value=pad_id)
        pool_scores = torch.cat([done_scores[active], normalised], dim=1)  # (n, 3k)
        pool_tokens = torch.cat([done_tokens[active], new_tokens], dim=1)  # (n, 3k, max_len)
        best, pick = pool_scores.topk(k, dim=1)
        done_scores[active] = best
        done_tokens[active] = pool_tokens.gather(1, pick[..., None].expand(-1, -1, max_len))

        # live on: the first k candidates that do not end in EOS (there are at least k: one EOS per beam)
        order = torch.arange(2 * k, device=device) + is_eos * 2 * k
        keep = order.topk(k, dim=1, largest=False).indices  # (n, k), best first
        scores = top_scores.gather(1, keep)
        next_rows = rows.gather(1, keep).view(-1)  # (n·k,)
        alive = torch.cat([alive[next_rows], token.gather(1, keep).view(-1, 1)], dim=1)

        open_ = ~done_scores[active].isfinite().all(1)  # (n,) fewer than k finished
        n_open = int(open_.sum())  # the step's one wait for the device
        if n_open == 0:
            break
        if n_open == n:  # follow the chosen prefixes; cross-attention keys are one per sentence
            for layer in cache:
                layer.reorder(next_rows, static_index=None)
            continue
        still = open_.nonzero().squeeze(1)
        rows_kept = (still[:, None] * k + torch.arange(k, device=device)).view(-1)  # rows of open sentences
        alive, scores, active = alive[rows_kept], scores[still], active[still]
        memory, src_mask = memory[still], src_mask[still]
        for layer in cache:  # and drop done sentences
            layer.reorder(next_rows[rows_kept], static_index=still)

    tokens = done_tokens[:, 0]  # (B, max_len), best first
    length = int(tokens.ne(pad_id).sum(1).max())
    return tokens[:, :length], done_scores[:, 0]
