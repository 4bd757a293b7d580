"""Decoding for encoder-decoder models: greedy search and batched beam search.

Both work with any model that has ``encode(src, src_key_padding_mask) -> memory``,
``decode(tgt, memory, memory_key_padding_mask, cache=, start_pos=) -> logits`` and
``init_cache()`` (see `models.text.Seq2SeqTransformer`): a list of per-layer caches, each with
``reorder(index, static_index)`` (see `models.kv_cache.KVCache`). The encoder runs once; the decoder
runs one token per step on its cache of keys and values, so a step costs one position, not a re-run
of the whole prefix. ``max_len`` counts generated tokens, EOS included; the last step is forced to
EOS, so every hypothesis ends with EOS. Outputs exclude BOS and are padded with PAD after EOS.

``cache`` chooses how the keys and values are kept:
    "dynamic"  a `KVCache` that grows by a step each call; beam search drops finished sentences from the
               batch. Each step launches every kernel of the decoder from the host: on a GPU, at these sizes,
               the launches take longer than the kernels (beam 5 with the cache is no faster than without).
    "static"   a `StaticKVCache` of ``max_len`` positions per layer; every sentence stays in the batch to the
               end (finished ones are computed and ignored), so each step has the same shapes and addresses,
               and on CUDA `DecodingStep` replays the decoder as one CUDA graph (captured at the second step of
               each call). Same tokens as "dynamic" (tested on the CPU, where no graph is used).
    "auto"     (the default) "static" on a CUDA device, "dynamic" elsewhere. On an H100 the static cache decodes
               beam 5 over 64 sentences and greedy over 1,014 in 0.30-0.31x the dynamic cache's time with the same
               translations, and beam 5 over 1,014 at 1.03x (compute-bound there); on the CPU no graph is replayed
               and the static cache only decodes finished sentences too (benchmarks/RESULTS.md, "GPU rows (H100)").
The static path needs ``model.decode_inputs(tgt, start_pos) -> (x, positions)`` and
``model.decode_embedded(x, memory, memory_key_padding_mask, None, cache, positions)``, and
``init_cache(max_len)`` (see `models.text.Seq2SeqTransformer`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.position import Rotation

CacheKind = Literal["auto", "dynamic", "static"]
CACHE_KINDS = ("auto", "dynamic", "static")


def cache_kind(cache: str, device: torch.device) -> str:
    """The cache that decoding on ``device`` uses: ``cache``, with "auto" resolved (module docstring)."""
    if cache not in CACHE_KINDS:
        raise ValueError(f"cache={cache!r} is not known; choose one of {', '.join(CACHE_KINDS)}")
    return ("static" if device.type == "cuda" else "dynamic") if cache == "auto" else cache


def _static_positions(positions: dict, max_len: int) -> dict:
    """A step's positions with fixed shapes: a position bias over the filled keys (H, T, t + 1) padded to
    the cache's ``max_len`` keys (the padding is blocked by the cache's mask)."""
    if "position_bias" not in positions:
        return positions
    bias = positions["position_bias"]
    return {**positions, "position_bias": F.pad(bias, (0, max_len - bias.size(-1)))}


def _copy_positions(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, Rotation):
            dst[key].cos.copy_(value.cos)
            dst[key].sin.copy_(value.sin)
        else:
            dst[key].copy_(value)


def _clone_positions(positions: dict) -> dict:
    return {
        key: Rotation(v.cos.clone(), v.sin.clone(), v.interleaved) if isinstance(v, Rotation) else v.clone()
        for key, v in positions.items()
    }


class DecodingStep:
    """One decoding step on a cache: (tokens (N, T), position t) -> logits (N, T, V).

    ``cache``: the caches ``body`` writes (one per layer); ``max_len``: their length when static (None: they
    grow, and no graph is possible). ``inputs(tokens, t) -> (x, positions)`` holds what depends on the host's
    position (embeddings, RoPE angles, a position bias), run eagerly; ``body(x, positions) -> logits`` the rest
    (the stacks on their `StaticKVCache`, the output projection). With ``graph`` (CUDA), the second call runs
    ``body`` on a side stream (the warm-up torch.cuda.graphs asks for, and a real step) and captures it as a
    CUDA graph; later calls of the same shapes copy their inputs into the graph's buffers and replay it: one
    launch for the whole decoder. The first call (a prompt, the cross-attention's keys) always runs eagerly. `reorder` (beam
    search) takes effect at the next call, inside the graph when that call replays one. Autocast's cast cache
    is off inside the graph, so that the graph owns its casts of the weights.
    """

    def __init__(
        self,
        inputs: Callable[[Tensor, int], tuple[Tensor, dict]],
        body: Callable[[Tensor, dict], Tensor],
        cache: list,
        max_len: int | None,
        graph: bool,
    ):
        self.inputs, self.body, self.cache, self.max_len, self.use_graph = inputs, body, cache, max_len, graph
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.x: Tensor | None = None
        self.positions: dict = {}
        self.logits: Tensor | None = None
        self.pending: Tensor | None = None  # rows to keep, in order, before the next step (dim 0 of the cache)
        self.index: Tensor | None = None  # the graph's copy of it, when the graph reorders

    def reorder(self, index: Tensor) -> None:
        """Keep cache rows ``index`` (every row, in a new order) from the next step on."""
        self.pending = index

    def _reorder(self, index: Tensor) -> None:
        for layer in self.cache:
            layer.reorder(index, static_index=None)

    def _run(self, x: Tensor, positions: dict) -> Tensor:
        if self.index is not None:
            self._reorder(self.index)
        return self.body(x, positions)

    def __call__(self, tokens: Tensor, t: int) -> Tensor:
        x, positions = self.inputs(tokens, t)
        if self.max_len is not None:
            positions = _static_positions(positions, self.max_len)
        self.calls += 1
        pending, self.pending = self.pending, None
        if self.graph is not None and x.shape == self.x.shape:
            if self.index is not None:  # a graph that reorders first: by the pending rows, or all in place
                self.index.copy_(torch.arange(self.index.numel(), device=x.device) if pending is None else pending)
            elif pending is not None:
                self._reorder(pending)
            self.x.copy_(x)
            _copy_positions(self.positions, positions)
            self.graph.replay()
            return self.logits
        if not self.use_graph or self.calls == 1 or self.graph is not None:
            if pending is not None:
                self._reorder(pending)
            return self.body(x, positions)
        return self._capture(x, positions, pending)

    def _capture(self, x: Tensor, positions: dict, pending: Tensor | None) -> Tensor:
        self.x, self.positions = x.clone(), _clone_positions(positions)
        self.index = None if pending is None else pending.clone()
        autocast = (
            torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else nullcontext()
        )
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), autocast:
            logits = self._run(self.x, self.positions)  # this step, and the warm-up
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # recorded, not run: the cache does not advance; thread_local: other threads (a loader pinning memory)
        # may use CUDA meanwhile
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), autocast:
            self.logits = self._run(self.x, self.positions)
        return logits


def seq2seq_step(model: nn.Module, memory: Tensor, memory_key_padding_mask: Tensor, max_len: int) -> DecodingStep:
    """A `DecodingStep` of an encoder-decoder on a new static cache: (tokens (N, 1), t) -> logits (N, V).
    ``memory`` (B, S, D) holds one row per sentence (N a multiple of B: beams attend to it together)."""
    cache = model.init_cache(max_len)

    def body(x: Tensor, positions: dict) -> Tensor:
        return model.decode_embedded(x, memory, memory_key_padding_mask, None, cache, positions)[:, -1]

    return DecodingStep(model.decode_inputs, body, cache, max_len, graph=memory.is_cuda)


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
    model: nn.Module,
    src: Tensor,
    *,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    max_len: int,
    use_cache: bool = True,
    cache: CacheKind = "auto",
) -> tuple[Tensor, Tensor]:
    """Pick the most likely token at each step.

    src (B, S) -> (tokens (B, L) with L <= max_len, log-probability of each sequence (B,)).
    ``use_cache=False`` re-runs the decoder on the whole prefix at every step (the reference);
    ``cache``: "auto", "dynamic" or "static" (module docstring).
    """
    cache = cache_kind(cache, src.device)
    src_mask = src.eq(pad_id)
    memory = model.encode(src, src_mask)  # (B, S, D)
    batch = src.size(0)
    ys = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
    scores = torch.zeros(batch, device=src.device)
    static = use_cache and cache == "static"
    step = seq2seq_step(model, memory, src_mask, max_len) if static else None
    layers = model.init_cache() if use_cache and not static else None
    banned = torch.tensor([pad_id, bos_id], device=src.device)  # never generated
    for t in range(max_len):
        if static:
            logits = step(ys[:, -1:], t)  # (B, V)
        elif use_cache:
            logits = model.decode(ys[:, -1:], memory, src_mask, cache=layers, start_pos=t)[:, -1]  # (B, V)
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
    cache: CacheKind = "auto",
) -> tuple[Tensor, Tensor]:
    """Keep the ``beam_size`` best prefixes of every sentence, all sentences in one batch.

    Each step extends every live prefix by every token and keeps, per sentence, the 2k best
    candidates: those ending in EOS within the top k become finished hypotheses, scored by
    log-probability / `length_penalty`; the first k others live on. A sentence is done when it
    holds k finished hypotheses (fairseq's rule); done sentences leave the batch, and the cache is
    reordered (dim 0 of every tensor) to follow the surviving prefixes. The encoder memory and the
    cross-attention keys/values are held once per sentence, not once per beam (`MultiHeadAttention`
    lets the k beam rows of a sentence attend to its one memory row).

    ``cache="static"`` keeps done sentences in the model's batch (static shapes, module docstring): each step
    decodes every sentence's k rows and the search reads the open ones; the cache is reordered in place.

    src (B, S) -> (best hypothesis per sentence (B, L), its normalised score (B,)).
    With ``beam_size=1`` this is `greedy_decode`.
    """
    cache = cache_kind(cache, src.device)
    k = beam_size
    src_mask = src.eq(pad_id)
    memory = model.encode(src, src_mask)  # (B, S, D): one row per sentence, which its k beams attend to together
    batch, device = src.size(0), src.device
    static = cache == "static"
    step = seq2seq_step(model, memory, src_mask, max_len) if static else None
    layers = None if static else model.init_cache()
    beam_offsets = torch.arange(k, device=device)
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
        if static:  # every sentence's rows go through the step; the open ones' rows are read
            live = (active[:, None] * k + beam_offsets).view(-1)  # (n·k,) their rows in the full batch
            last = (
                alive[:, -1:]
                if n == batch
                else alive.new_full((batch * k, 1), eos_id).index_copy_(0, live, alive[:, -1:])
            )
            logits = step(last, t)  # (B·k, V)
            logits = logits if n == batch else logits.index_select(0, live)  # (n·k, V)
        else:
            logits = model.decode(alive[:, -1:], memory, src_mask, cache=layers, start_pos=t)[:, -1]  # (n·k, V)
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
        if static:  # follow the chosen prefixes in place; done sentences' rows stay where they are
            index = (
                next_rows
                if n == batch
                else torch.arange(batch * k, device=device).index_copy_(0, live, live[next_rows])
            )
            step.reorder(index)
        elif n_open == n:  # follow the chosen prefixes; cross-attention keys are one per sentence
            for layer in layers:
                layer.reorder(next_rows, static_index=None)
        if n_open == n:
            continue
        still = open_.nonzero().squeeze(1)
        rows_kept = (still[:, None] * k + beam_offsets).view(-1)  # rows of open sentences
        alive, scores, active = alive[rows_kept], scores[still], active[still]
        if not static:  # and drop done sentences
            memory, src_mask = memory[still], src_mask[still]
            for layer in layers:
                layer.reorder(next_rows[rows_kept], static_index=still)

    tokens = done_tokens[:, 0]  # (B, max_len), best first
    length = int(tokens.ne(pad_id).sum(1).max())
    return tokens[:, :length], done_scores[:, 0]
