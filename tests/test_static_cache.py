"""The static (fixed-size) key/value cache: the same tokens as the growing cache, buffers that keep their
shape and address (what a CUDA graph of a step needs), and the switch that selects it."""

import pytest
import torch
from builders import padded_batch, tiny_lm, tiny_seq2seq

from benchmarks import peers
from benchmarks.cases import GPU_DECODING, static_cache_case
from datamodules.text.tokenizers import BOS_ID, EOS_ID, PAD_ID
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.kv_cache import KVCache, StaticKVCache
from models.core.position import ALiBi, RotaryEmbedding, Rotation
from models.text import decoding
from models.text import lm as lm_network
from models.text.decoding import DecodingStep, beam_search, greedy_decode, seq2seq_step
from models.text.lm_module import LanguageModelModule
from models.text.seq2seq import Seq2SeqTransformer
from models.text.translation_module import TranslationModule

V = 30
IDS = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)
POSITIONS = ["sinusoidal", "learned", "rope", "alibi", "t5"]


def seq2seq(positions: str, eos_bias: float = 0.0, seed: int = 0, **kw) -> Seq2SeqTransformer:
    """A tiny random model; ``eos_bias`` on the EOS logit makes hypotheses end at different steps."""
    model = tiny_seq2seq(V, seed, positions=positions, output_bias=True, **kw)
    with torch.no_grad():
        model.generator.bias[EOS_ID] = eos_bias
    return model


def sentences_left_after_drops(model: Seq2SeqTransformer) -> list[int]:
    """Spy on the dynamic search: each time it drops done sentences from the batch, how many stay open."""
    left, init_cache = [], model.init_cache

    def spying_init_cache(*args):
        caches = init_cache(*args)
        reorder = caches[0].reorder

        def spy(index, static_index):
            if static_index is not None:
                left.append(static_index.numel())
            reorder(index, static_index)

        caches[0].reorder = spy
        return caches

    model.init_cache = spying_init_cache
    return left


@pytest.mark.parametrize("positions", POSITIONS)
def test_static_cache_decodes_step_by_step_as_the_whole_prefix(positions):
    model = seq2seq(positions, attention=AttentionConfig(qk_norm="rmsnorm") if positions == "alibi" else None)
    src = padded_batch(V, [5, 2, 7])
    memory, mask = model.encode(src), src.eq(PAD_ID)
    tgt = torch.cat([torch.full((3, 1), BOS_ID), padded_batch(V, [6, 6, 6], seed=3)], dim=1)  # (3, 7)
    full = model.decode(tgt, memory, mask)
    cache = model.init_cache(max_len=10)
    steps = [model.decode(tgt[:, t : t + 1], memory, mask, cache=cache, start_pos=t) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache[0].self_attn.k.shape == (3, 4, 10, 8) and int(cache[0].self_attn.length) == 7


@pytest.mark.parametrize("positions", POSITIONS)
def test_static_greedy_and_beam_equal_the_dynamic_cache_token_for_token(positions):
    model = seq2seq(positions, eos_bias=1.0)
    src = padded_batch(V, [7, 3, 5, 9, 2, 6])
    for search, kw in ((greedy_decode, {}), (beam_search, {"beam_size": 5})):
        dynamic, dynamic_scores = search(model, src, max_len=12, **IDS, **kw)
        static, static_scores = search(model, src, max_len=12, cache="static", **IDS, **kw)
        assert torch.equal(static, dynamic), search.__name__
        torch.testing.assert_close(static_scores, dynamic_scores, atol=1e-5, rtol=1e-5)


def test_static_beam_search_keeps_early_finished_sentences_and_their_results():
    # EOS likely enough that some sentences hold 5 finished hypotheses long before others
    model = seq2seq("sinusoidal", eos_bias=1.0, seed=3)
    # the sentence that runs longest comes last: the open sentences' rows are not the first rows of the batch
    src = padded_batch(V, [7, 3, 5, 9, 2, 6, 4, 8], seed=4).flip(0)
    left = sentences_left_after_drops(model)
    dynamic, dynamic_scores = beam_search(model, src, max_len=14, beam_size=5, **IDS)
    assert any(left)  # the dynamic search dropped done sentences while others went on
    static, static_scores = beam_search(model, src, max_len=14, beam_size=5, cache="static", **IDS)
    assert torch.equal(static, dynamic)
    torch.testing.assert_close(static_scores, dynamic_scores, atol=1e-5, rtol=1e-5)
    assert dynamic.ne(PAD_ID).sum(1).tolist() == [2, 1, 1, 3, 3, 1, 1, 10]


@pytest.mark.parametrize("positions", POSITIONS)
def test_lm_generates_the_same_with_the_static_cache_even_past_the_context(positions):
    lm = tiny_lm(V, positions, max_positions=8)
    prompt = padded_batch(V, [3, 3], seed=5)
    dynamic = lm.generate(prompt, 12, temperature=0)  # 15 tokens > 8 positions: the window slides
    assert torch.equal(lm.generate(prompt, 12, temperature=0, cache="static"), dynamic)
    assert torch.equal(lm.generate(prompt, 4, temperature=0, cache="static"), dynamic[:, :7])  # within the window


@pytest.mark.parametrize("kind", ["rope", "alibi"])
def test_static_kv_cache_attends_as_the_growing_cache_after_a_prompt(kind):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2, attention=AttentionConfig(qk_norm="layernorm")).eval()
    x = torch.randn(3, 6, 16)
    rope, alibi = RotaryEmbedding(8, 16), ALiBi(2)
    growing, static = KVCache(), StaticKVCache(max_len=9)
    for start, length in ((0, 4), (4, 1), (5, 1)):  # a prompt of 4 tokens, then one token a step
        step = x[:, start : start + length]
        kw = {"rope": rope(length, start)} if kind == "rope" else {"position_bias": alibi(length, start + length)}
        a = attn(step, is_causal=True, cache=growing, **kw)[0]
        b = attn(step, is_causal=True, cache=static, **kw)[0]
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
        assert int(static.length) == start + length
    torch.testing.assert_close(static.k[:, :, :6], growing.k)
    assert static.k[:, :, 6:].eq(0).all()


def test_static_kv_cache_keeps_its_buffers_in_place():
    """What a CUDA graph relies on: every step and every reorder writes into the same memory."""
    model = seq2seq("rope")
    src = padded_batch(V, [4, 6])
    memory, mask = model.encode(src), src.eq(PAD_ID)
    step = seq2seq_step(model, memory, mask, max_len=5)
    step(torch.full((2, 1), BOS_ID), 0)
    layer = step.cache[0].self_attn
    addresses = (layer.k.data_ptr(), layer.v.data_ptr(), layer.length.data_ptr())
    before = layer.k.clone()
    step(torch.tensor([[5], [6]]), 1)
    layer_reordered = torch.tensor([1, 0])
    for cache in step.cache:
        cache.reorder(layer_reordered, static_index=None)
    assert (layer.k.data_ptr(), layer.v.data_ptr(), layer.length.data_ptr()) == addresses
    torch.testing.assert_close(layer.k[:, :, :1], before[[1, 0], :, :1])
    with pytest.raises(ValueError, match="StaticKVCache keeps its 2 rows"):
        layer.reorder(torch.tensor([0]), static_index=torch.tensor([0]))


def test_static_cache_refuses_other_masks():
    attn = MultiHeadAttention(8, 2)
    cache = StaticKVCache(4)
    with pytest.raises(ValueError, match="StaticKVCache masks the positions it has not filled"):
        attn(torch.randn(1, 2, 8), key_padding_mask=torch.zeros(1, 2, dtype=torch.bool), cache=cache)


def test_no_cuda_graph_without_cuda():
    model = seq2seq("sinusoidal")
    src = padded_batch(V, [3])
    step = seq2seq_step(model, model.encode(src), src.eq(PAD_ID), max_len=4)
    assert isinstance(step, DecodingStep) and not step.use_graph
    for t in range(3):
        step(torch.full((1, 1), BOS_ID), t)
    assert step.graph is None


class ReplayOnCPU(DecodingStep):
    """A `DecodingStep` whose "graph" re-runs the captured call on its buffers: the replay path (inputs copied
    into buffers, the reorder staged into the graph's index, the output buffer) on a CPU. The body keeps no host
    state, so re-running it on the buffers is what replaying a CUDA graph of it does."""

    replays = 0

    def __init__(self, inputs, body, cache, max_len, graph):
        super().__init__(inputs, body, cache, max_len, graph=max_len is not None)

    def _capture(self, x, positions, pending):
        self.x, self.positions = (
            x.clone(),
            {
                k: Rotation(v.cos.clone(), v.sin.clone()) if isinstance(v, Rotation) else v.clone()
                for k, v in positions.items()
            },
        )
        self.index = None if pending is None else pending.clone()
        logits = self._run(self.x, self.positions)
        self.logits = torch.empty_like(logits)
        step = self

        class Graph:
            def replay(self) -> None:
                ReplayOnCPU.replays += 1
                step.logits.copy_(step._run(step.x, step.positions))

        self.graph = Graph()
        return logits


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi"])
def test_the_replay_path_reads_every_input_from_its_buffers(positions, monkeypatch):
    monkeypatch.setattr(decoding, "DecodingStep", ReplayOnCPU)
    monkeypatch.setattr(lm_network, "DecodingStep", ReplayOnCPU)
    model = seq2seq(positions, eos_bias=1.0, seed=3)
    src = padded_batch(V, [7, 3, 5, 9, 2, 6, 4, 8], seed=4).flip(0)  # sentences finish early (see above)
    for search, kw in ((greedy_decode, {}), (beam_search, {"beam_size": 5})):
        ReplayOnCPU.replays = 0
        dynamic, dynamic_scores = search(model, src, max_len=14, **IDS, **kw)
        static, static_scores = search(model, src, max_len=14, cache="static", **IDS, **kw)
        assert torch.equal(static, dynamic) and ReplayOnCPU.replays > 5, search.__name__
        torch.testing.assert_close(static_scores, dynamic_scores, atol=1e-5, rtol=1e-5)
    lm = tiny_lm(V, positions, max_positions=16)
    prompt = padded_batch(V, [3, 3], seed=5)
    assert torch.equal(lm.generate(prompt, 9, temperature=0, cache="static"), lm.generate(prompt, 9, temperature=0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi"])
def test_cuda_graph_steps_equal_the_dynamic_cache_on_the_gpu(positions):
    model = seq2seq(positions, eos_bias=1.0).cuda()
    src = padded_batch(V, [7, 3, 5, 9, 2, 6]).cuda().flip(0)
    for search, kw in ((greedy_decode, {}), (beam_search, {"beam_size": 5})):
        dynamic, _ = search(model, src, max_len=12, **IDS, **kw)
        static, _ = search(model, src, max_len=12, cache="static", **IDS, **kw)
        assert torch.equal(static, dynamic), search.__name__
        with torch.autocast("cuda", dtype=torch.bfloat16):  # as validation runs with bf16-mixed
            dynamic, _ = search(model, src, max_len=12, **IDS, **kw)
            static, scores = search(model, src, max_len=12, cache="static", **IDS, **kw)
        assert scores.isfinite().all() and (static == dynamic).all(1).sum() >= 5, search.__name__
    step = seq2seq_step(model, model.encode(src), src.eq(PAD_ID), max_len=4)
    for t in range(3):
        step(torch.full((6, 1), BOS_ID, device="cuda"), t)
    assert step.graph is not None
    lm, prompt = (
        tiny_lm(V, positions, max_positions=16, d_model=32, nhead=4).cuda(),
        padded_batch(V, [3, 3], seed=5).cuda(),
    )
    assert torch.equal(lm.generate(prompt, 10, temperature=0, cache="static"), lm.generate(prompt, 10, temperature=0))


def test_cache_is_a_config_key_of_both_text_modules_and_checked():
    module = TranslationModule(
        src_vocab_size=V, tgt_vocab_size=V, d_model=16, nhead=2, dim_feedforward=32, cache="static"
    )
    assert module.hparams.cache == "static"
    assert TranslationModule(src_vocab_size=V, tgt_vocab_size=V, d_model=16, nhead=2).hparams.cache == "auto"
    assert LanguageModelModule(vocab_size=V, d_model=16, nhead=2, cache="static").hparams.cache == "static"
    with pytest.raises(ValueError, match=r"model.cache='paged' is not known; choose one of auto, dynamic, static"):
        TranslationModule(src_vocab_size=V, tgt_vocab_size=V, d_model=16, nhead=2, cache="paged")
    src = padded_batch(V, [4, 2])
    static = module.eval().translate(src, beam_size=3)
    module.hparams.cache = "dynamic"
    assert torch.equal(module.translate(src, beam_size=3), static)


def test_benchmark_rows_decode_the_same_translations_on_both_caches():
    for search in ("beam", "greedy"):
        bench = peers.static_cache_bench(search, 64, peers.Settings(quick=True))
        assert list(bench.steps) == ["ours", "dynamic cache"] and bench.check.startswith(
            "identical translations for 4/4"
        )
    assert {static_cache_case(*shape, "gpu").key for shape in GPU_DECODING} == {
        "gpu/static_cache/beam/64",
        "gpu/static_cache/beam/1014",
        "gpu/static_cache/greedy/1014",
    }


def test_auto_decodes_on_the_static_cache_on_cuda_and_the_dynamic_one_elsewhere(monkeypatch):
    """The default follows the H100 rows: the static cache where a CUDA graph replays it, else the dynamic one."""
    assert decoding.cache_kind("auto", torch.device("cuda")) == "static"
    assert decoding.cache_kind("auto", torch.device("cpu")) == "dynamic"
    assert decoding.cache_kind("static", torch.device("cpu")) == "static"
    monkeypatch.setattr(decoding, "seq2seq_step", lambda *a: pytest.fail("auto took the static path on the CPU"))
    model, src = seq2seq("sinusoidal", eos_bias=1.0), padded_batch(V, [5, 3])
    for search, kw in ((greedy_decode, {}), (beam_search, {"beam_size": 3})):
        assert torch.equal(
            search(model, src, max_len=8, **IDS, **kw)[0],
            search(model, src, max_len=8, cache="dynamic", **IDS, **kw)[0],
        )
