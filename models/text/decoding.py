"""Decoding for encoder-decoder models: greedy search and batched beam search.

Both work with any model that has ``encode(src, src_key_padding_mask) -> memory``,
``decode(tgt, memory, memory_key_padding_mask, cache=, start_pos=) -> logits`` and
``init_cache()`` (see `models.text.Seq2SeqTransformer`): a list of per-layer caches, each with
``reorder(index, static_index)`` (see `models.core.kv_cache.KVCache`). The encoder runs once; the decoder
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
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.core.masks import LazyBias
from models.core.position import Rotation

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
    bias = bias.full() if isinstance(bias, LazyBias) else bias  # one step's rows (H, T, t + 1)
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
    src_mask = src.eq(pad_id)
    memory = model.encode(src, src_mask)  # (B, S, D): one row per sentence, which its k beams attend to together
    static = cache_kind(cache, src.device) == "static"
    if static:
        decoder = _StaticBeams(model, memory, src_mask, max_len, eos_id)
    else:
        decoder = _DynamicBeams(model, memory, src_mask)
    search = _BeamSearch.start(src.size(0), beam_size, bos_id, eos_id, pad_id, max_len, src.device)
    banned = torch.tensor([pad_id, bos_id], device=src.device)  # never generated
    for t in range(max_len):
        logits = decoder.logits(search, t)  # (n·k, V)
        # a sentence's 2k best candidates are among its beams' 2k best tokens each: rank those alone
        logp, tokens = _top_log_probs(logits, 2 * beam_size, eos_id, t == max_len - 1, banned)  # (n·k, 2k)
        scores, rows, token = search.candidates(logp, tokens)
        search.finish(scores, rows, token, length_penalty(t + 1, alpha))
        next_rows = search.live_on(scores, rows, token)  # (n·k,)
        open_ = ~search.done_scores[search.active].isfinite().all(1)  # (n,) fewer than k finished
        n_open = int(open_.sum())  # the step's one wait for the device
        if n_open == 0:
            break
        still = None if n_open == open_.numel() else open_.nonzero().squeeze(1)
        decoder.follow(search, next_rows, still)
        if still is not None:
            search.keep(still)
    tokens = search.done_tokens[:, 0]  # (B, max_len), best first
    length = int(tokens.ne(pad_id).sum(1).max())
    return tokens[:, :length], search.done_scores[:, 0]


@dataclass
class _BeamSearch:
    """The search's state: ``n`` open sentences of ``k`` live prefixes each (rows i·k .. i·k + k - 1 belong to
    sentence ``active[i]``), and every sentence's ``k`` best finished hypotheses."""

    k: int
    eos_id: int
    pad_id: int
    alive: Tensor  # (n·k, t + 1) live prefixes, BOS first
    scores: Tensor  # (n, k) their log-probabilities
    active: Tensor  # (n,) the sentence of each block of k rows
    done_scores: Tensor  # (B, k) finished hypotheses' normalised scores, best first (-inf: none yet)
    done_tokens: Tensor  # (B, k, max_len) their tokens, PAD after EOS
    first_k: Tensor  # (2k,) True for the k best of a sentence's 2k candidates

    @classmethod
    def start(
        cls, batch: int, k: int, bos_id: int, eos_id: int, pad_id: int, max_len: int, device: torch.device
    ) -> _BeamSearch:
        scores = torch.full((batch, k), float("-inf"), device=device)
        scores[:, 0] = 0.0  # all beams start equal: expand only the first at step 0
        return cls(
            k,
            eos_id,
            pad_id,
            alive=torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device),
            scores=scores,
            active=torch.arange(batch, device=device),
            done_scores=torch.full((batch, k), float("-inf"), device=device),
            done_tokens=torch.full((batch, k, max_len), pad_id, dtype=torch.long, device=device),
            first_k=torch.arange(2 * k, device=device) < k,
        )

    def rows(self, blocks: Tensor) -> Tensor:
        """The rows (n·k,) of the beams of ``blocks`` (n,): sentence i's beams are rows i·k .. i·k + k - 1."""
        return (blocks[:, None] * self.k + torch.arange(self.k, device=blocks.device)).view(-1)

    def candidates(self, logp: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each beam's 2k best tokens and their log-probabilities (n·k, 2k) -> each sentence's 2k best extensions
        (n, 2k), best first: their scores, the row of the prefix each extends, and the token it adds."""
        n, k = self.scores.size(0), self.k
        candidates = (self.scores.unsqueeze(-1) + logp.view(n, k, 2 * k)).view(n, 2 * k * k)
        scores, top = candidates.topk(2 * k, dim=1)  # (n, 2k)
        beam, token = top // (2 * k), tokens.view(n, 2 * k * k).gather(1, top)
        rows = torch.arange(n, device=top.device)[:, None] * k + beam  # (n, 2k) row of each candidate's prefix
        return scores, rows, token

    def finish(self, scores: Tensor, rows: Tensor, token: Tensor, penalty: float) -> None:
        """Candidates that end in EOS among the k best become finished hypotheses, scored by log-probability /
        ``penalty`` (`length_penalty`), and merged with the earlier ones: each sentence keeps its k best."""
        max_len = self.done_tokens.size(-1)
        finish = token.eq(self.eos_id) & self.first_k & scores.isfinite()
        normalised = (scores / penalty).masked_fill(~finish, float("-inf"))
        new_tokens = torch.cat([self.alive[rows][..., 1:], token[..., None]], dim=-1)  # (n, 2k, t + 1)
        new_tokens = F.pad(new_tokens, (0, max_len - new_tokens.size(-1)), value=self.pad_id)
        pool_scores = torch.cat([self.done_scores[self.active], normalised], dim=1)  # (n, 3k)
        pool_tokens = torch.cat([self.done_tokens[self.active], new_tokens], dim=1)  # (n, 3k, max_len)
        best, pick = pool_scores.topk(self.k, dim=1)
        self.done_scores[self.active] = best
        self.done_tokens[self.active] = pool_tokens.gather(1, pick[..., None].expand(-1, -1, max_len))

    def live_on(self, scores: Tensor, rows: Tensor, token: Tensor) -> Tensor:
        """The first k candidates that do not end in EOS (there are at least k: one EOS per beam) live on;
        -> the rows (n·k,) of the prefixes they extend, which the cache follows."""
        order = torch.arange(2 * self.k, device=token.device) + token.eq(self.eos_id) * 2 * self.k
        keep = order.topk(self.k, dim=1, largest=False).indices  # (n, k), best first
        self.scores = scores.gather(1, keep)
        next_rows = rows.gather(1, keep).view(-1)  # (n·k,)
        self.alive = torch.cat([self.alive[next_rows], token.gather(1, keep).view(-1, 1)], dim=1)
        return next_rows

    def keep(self, still: Tensor) -> None:
        """Keep the open sentences ``still`` (n',) (their indices among the n), drop the done ones."""
        self.alive, self.scores, self.active = self.alive[self.rows(still)], self.scores[still], self.active[still]


class _DynamicBeams:
    """Beam search's decoder on a `KVCache` that grows a step each call: done sentences leave the batch, their
    memory and cache rows too."""

    def __init__(self, model: nn.Module, memory: Tensor, src_mask: Tensor):
        self.model, self.memory, self.src_mask, self.layers = model, memory, src_mask, model.init_cache()

    def logits(self, search: _BeamSearch, t: int) -> Tensor:
        """The open sentences' next-token logits (n·k, V)."""
        last = search.alive[:, -1:]
        return self.model.decode(last, self.memory, self.src_mask, cache=self.layers, start_pos=t)[:, -1]

    def follow(self, search: _BeamSearch, next_rows: Tensor, still: Tensor | None) -> None:
        """The cache follows the chosen prefixes ``next_rows`` (n·k,) and keeps the open sentences ``still``
        (None: all); cross-attention keys are one per sentence."""
        if still is None:
            for layer in self.layers:
                layer.reorder(next_rows, static_index=None)
            return
        self.memory, self.src_mask = self.memory[still], self.src_mask[still]
        for layer in self.layers:
            layer.reorder(next_rows[search.rows(still)], static_index=still)


class _StaticBeams:
    """Beam search's decoder on a `StaticKVCache` (`seq2seq_step`): every sentence's k rows go through each step
    (done ones fed EOS, their logits unread), so the shapes stay fixed; the cache is reordered in place."""

    def __init__(self, model: nn.Module, memory: Tensor, src_mask: Tensor, max_len: int, eos_id: int):
        self.step, self.batch, self.eos_id = seq2seq_step(model, memory, src_mask, max_len), memory.size(0), eos_id

    def logits(self, search: _BeamSearch, t: int) -> Tensor:
        """The open sentences' next-token logits (n·k, V), read from the whole batch's (B·k, V)."""
        if search.active.numel() == self.batch:
            return self.step(search.alive[:, -1:], t)
        live = search.rows(search.active)  # (n·k,) the open sentences' rows in the full batch
        last = search.alive.new_full((self.batch * search.k, 1), self.eos_id)
        last.index_copy_(0, live, search.alive[:, -1:])  # (B·k, 1)
        return self.step(last, t).index_select(0, live)

    def follow(self, search: _BeamSearch, next_rows: Tensor, still: Tensor | None) -> None:
        """The cache follows the chosen prefixes ``next_rows`` (n·k,) in place; done sentences' rows stay."""
        if search.active.numel() == self.batch:
            self.step.reorder(next_rows)
            return
        live = search.rows(search.active)
        index = torch.arange(self.batch * search.k, device=live.device).index_copy_(0, live, live[next_rows])
        self.step.reorder(index)
