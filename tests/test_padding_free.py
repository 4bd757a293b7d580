"""The padding-free path (models/core/padding_free.py) against the reference path, on the CPU: forced on with
``PADDING_FREE["cpu"]``. "nested" is torch's NJT SDPA (its CPU math kernel); "varlen" is torch's varlen_attn,
which has no CPU kernel, so `cpu_varlen_attn` below stands in for it with the same contract (packed rows,
cumulative lengths, flash's per-sequence causal window) to check the packing around it. With CUDA, the real
kernels run against the reference too (bf16), and the benchmark (`python -m benchmarks --only padding`) checks
them against the masked path before timing them."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_TRUNK

from models.core import attention, padding_free
from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.capture import capture_attention
from models.core.kv_cache import KVCache
from models.core.position import RotaryEmbedding
from models.detection.backbone import Backbone
from models.detection.criterion import SetCriterion
from models.detection.detr import DETR
from models.detection.matcher import HungarianMatcher
from models.text.seq2seq import Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")


def cpu_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size):
    """torch.nn.attention.varlen.varlen_attn's contract on the CPU, one sequence at a time: q (Tq, H, d),
    k/v (Tk, H, d) -> (Tq, H, d); window (-1, 0) is causal aligned to the end of each sequence's keys."""
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32 and window_size in ((-1, -1), (-1, 0))
    assert q.dtype == k.dtype == v.dtype, "flash takes one dtype (and varlen_attn does not autocast)"
    assert max_q == int(cu_seq_q.diff().max()) and max_k == int(cu_seq_k.diff().max())
    out = []
    for (q0, q1), (k0, k1) in zip(zip(cu_seq_q[:-1], cu_seq_q[1:]), zip(cu_seq_k[:-1], cu_seq_k[1:])):
        lq, lk = int(q1 - q0), int(k1 - k0)
        blocked = torch.ones(lq, lk, dtype=torch.bool).triu(lk - lq + 1) if window_size == (-1, 0) else None
        qs, ks, vs = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))  # (H, l, d)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=None if blocked is None else ~blocked, scale=scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


@pytest.fixture(params=["nested", "varlen"])
def forced(request, monkeypatch):
    """The padding-free path on the CPU with one kernel; returns the calls it served."""
    monkeypatch.setattr(padding_free, "varlen_attn", cpu_varlen_attn)
    calls = []
    original = attention.attention_padding_free

    def counted(*args, **kwargs):
        calls.append(args[7] if len(args) > 7 else kwargs.get("kernel"))
        return original(*args, **kwargs)

    monkeypatch.setattr(attention, "attention_padding_free", counted)
    monkeypatch.setitem(attention.PADDING_FREE, "cpu", (request.param,))
    return request.param, calls


def lengths_mask(lengths: list[int], length: int) -> torch.Tensor:
    """(B, L) True at padding: the rows hold lengths[i] valid positions first."""
    return torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]


def outputs_and_grads(layer, x, loss_rows, forward):
    """Output, and gradients of a loss over ``loss_rows`` (B, L) with respect to x and the parameters."""
    x = x.detach().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = forward(x)
    (out * loss_rows[..., None]).pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def assert_same(a, b, rows):
    (out_a, gx_a, gp_a), (out_b, gx_b, gp_b) = a, b
    torch.testing.assert_close(out_a[rows], out_b[rows], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(gx_a, gx_b, atol=1e-5, rtol=1e-4)
    for name in gp_a:
        torch.testing.assert_close(gp_a[name], gp_b[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("rope", [False, True])
def test_self_attention_with_key_padding_equals_the_reference(forced, rope):
    kernel, calls = forced
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, attention=AttentionConfig(qk_norm="rmsnorm"))
    kpm = lengths_mask([7, 3, 0, 5], 7)  # one full row, one sequence all padding
    x = torch.randn(4, 7, 32)
    rot = RotaryEmbedding(8)(7) if rope else None
    valid = ~kpm
    reference = outputs_and_grads(
        layer, x, valid, lambda x: layer(x, key_padding_mask=kpm, rope=rot, need_weights=True)[0]
    )
    ours = outputs_and_grads(layer, x, valid, lambda x: layer(x, key_padding_mask=kpm, rope=rot)[0])
    assert calls == [kernel]
    assert_same(ours, reference, valid)
    padded = ours[0][kpm]  # zero before out_proj: out_proj's bias
    torch.testing.assert_close(padded, layer.out_proj.bias.detach().expand_as(padded))


@pytest.mark.parametrize("kernel", padding_free.KERNELS)
def test_under_autocast_the_kernel_attends_in_autocast_dtype_as_sdpa(kernel, monkeypatch):
    """On a GPU, QK-norm's LayerNorm gives float32 queries and keys under autocast while the values stay
    bfloat16: the packed kernel gets all three in bfloat16, as SDPA would cast them (NJT SDPA casts them
    itself; varlen_attn does not)."""
    monkeypatch.setattr(padding_free, "varlen_attn", cpu_varlen_attn)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    pack = padding_free.packing(lengths_mask([6, 3], 6), 6, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = padding_free.attention_padding_free(q, k, v.bfloat16(), pack, 0.35, kernel=kernel)
    exact = padding_free.attention_padding_free(q, k, v, pack, 0.35, kernel=kernel)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), exact, atol=3e-2, rtol=3e-2)


def test_causal_self_attention_with_padding_equals_the_reference(forced):
    kernel, calls = forced
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4)
    kpm = lengths_mask([6, 2, 4], 6)
    kpm[1, 0] = False
    x = torch.randn(3, 6, 32)
    rot = RotaryEmbedding(8)(6)
    reference = outputs_and_grads(
        layer, x, ~kpm, lambda x: layer(x, key_padding_mask=kpm, is_causal=True, rope=rot, need_weights=True)[0]
    )
    ours = outputs_and_grads(layer, x, ~kpm, lambda x: layer(x, key_padding_mask=kpm, is_causal=True, rope=rot)[0])
    assert calls == ([kernel] if kernel == "varlen" else [])  # torch's CPU NJT SDPA has no is_causal: masked SDPA
    assert_same(ours, reference, ~kpm)


def test_cross_attention_with_memory_padding_equals_the_reference(forced):
    kernel, calls = forced
    torch.manual_seed(0)
    layer = MultiHeadAttention(32, 4, attention=AttentionConfig(similarity="general"))
    memory_mask = lengths_mask([9, 4, 0], 9)  # the last memory all padding: its queries get zeros
    query, memory = torch.randn(3, 5, 32), torch.randn(3, 9, 32, requires_grad=True)
    rows = torch.ones(3, 5, dtype=torch.bool)

    def run(need_weights):
        memory.grad = None
        result = outputs_and_grads(
            layer, query, rows, lambda q: layer(q, memory, key_padding_mask=memory_mask, need_weights=need_weights)[0]
        )
        return result, memory.grad

    (reference, memory_grad_ref), (ours, memory_grad) = run(True), run(False)
    assert calls == [kernel]
    assert_same(ours, reference, rows)
    torch.testing.assert_close(memory_grad, memory_grad_ref, atol=1e-5, rtol=1e-4)
    assert memory_grad[2].abs().sum() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn and NJT SDPA's flash kernel: CUDA")
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
@pytest.mark.parametrize("kernel", padding_free.KERNELS)
def test_cuda_kernels_equal_the_reference_in_bfloat16(kernel, kind, monkeypatch):
    """The real kernels (no stand-in), as a GPU session runs them: bf16 autocast, head size 16."""
    monkeypatch.setitem(attention.PADDING_FREE, "cuda", (kernel,))
    calls, original = [], attention.attention_padding_free
    monkeypatch.setattr(attention, "attention_padding_free", lambda *a, **k: calls.append(a[7]) or original(*a, **k))
    torch.manual_seed(0)
    layer = MultiHeadAttention(64, 4).cuda()
    x, memory = torch.randn(4, 40, 64, device="cuda"), torch.randn(4, 33, 64, device="cuda")
    kpm = lengths_mask([33, 20, 0, 7], 33 if kind == "cross" else 40).cuda()
    rows = torch.ones(4, 40, dtype=torch.bool, device="cuda") if kind == "cross" else ~kpm

    def run(need_weights):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            forward = (
                (lambda x: layer(x, memory, key_padding_mask=kpm, need_weights=need_weights)[0])
                if kind == "cross"
                else (
                    lambda x: layer(x, key_padding_mask=kpm, is_causal=kind == "causal", need_weights=need_weights)[0]
                )
            )
            return outputs_and_grads(layer, x, rows.float(), lambda x: forward(x).float())

    ours, reference = run(False), run(True)
    assert calls == [kernel]
    (out, gx, gp), (out_ref, gx_ref, gp_ref) = ours, reference
    pairs = {"output": (out[rows], out_ref[rows]), "x.grad": (gx, gx_ref), **{n: (gp[n], gp_ref[n]) for n in gp}}
    for name, (a, b) in pairs.items():  # bf16: ~3 significant digits, summed over many tokens in the gradients
        assert (a - b).norm() <= 2e-2 * b.norm(), name


def test_the_path_is_taken_for_a_key_padding_mask_alone(forced):
    kernel, calls = forced
    layer = MultiHeadAttention(16, 2)
    x, kpm = torch.randn(2, 4, 16), lengths_mask([4, 2], 4)
    layer(x, key_padding_mask=kpm)
    assert calls == [kernel]
    calls.clear()
    layer(x, key_padding_mask=kpm, attn_mask=torch.zeros(4, 4, dtype=torch.bool))
    layer(x, key_padding_mask=kpm, position_bias=torch.zeros(2, 4, 4))
    layer(x, key_padding_mask=kpm, need_weights=True)
    with capture_attention(layer):
        layer(x, key_padding_mask=kpm)
    layer(x)
    layer(x, is_causal=True)
    layer(x[:1].repeat(2, 1, 1), x[:1], key_padding_mask=kpm[:1])  # two queries sharing one memory (beams)
    layer(x[:1].repeat(2, 1, 1), x[:1], key_padding_mask=kpm[:1], cache=KVCache(static=True))  # decoding
    layer(x, key_padding_mask=torch.zeros(2, 4).masked_fill(kpm, float("-inf")))  # an additive padding mask
    layer(x[:, :2], x, key_padding_mask=kpm, is_causal=True)  # a causal step over longer keys
    assert calls == []


def test_under_torch_compile_the_masked_path_keeps_one_graph(forced):
    kernel, calls = forced
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2)
    x, kpm = torch.randn(2, 4, 16), lengths_mask([4, 2], 4)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # packing would break the graph: it waits
    valid = ~kpm
    torch.testing.assert_close(compiled(x, key_padding_mask=kpm)[0][valid], layer(x, key_padding_mask=kpm)[0][valid])
    assert calls == [kernel]  # the eager call only


def test_off_by_default_until_a_gpu_measures_it():
    assert attention.PADDING_FREE == {"cpu": (), "cuda": ()}
    q = torch.randn(2, 1, 4, 16)
    assert attention._padding_free_kernel(q, 4, lengths_mask([4, 2], 4), False, True, 0.0) is None


def test_dropout_takes_the_next_kernel_varlen_attn_has_none(monkeypatch):
    monkeypatch.setattr(padding_free, "varlen_attn", cpu_varlen_attn)
    q, kpm = torch.randn(2, 1, 4, 16), lengths_mask([4, 2], 4)
    for kernels, dropout, chosen in (
        (("varlen", "nested"), 0.0, "varlen"),
        (("varlen", "nested"), 0.1, "nested"),
        (("varlen",), 0.1, None),
        (("nested",), 0.1, "nested"),
    ):
        monkeypatch.setitem(attention.PADDING_FREE, "cpu", kernels)
        assert attention._padding_free_kernel(q, 4, kpm, False, True, dropout) == chosen


def test_all_padding_costs_no_kernel_and_stays_finite(monkeypatch):
    monkeypatch.setitem(attention.PADDING_FREE, "cpu", ("nested",))
    monkeypatch.setattr(F, "scaled_dot_product_attention", None)  # any attention kernel would fail
    layer = MultiHeadAttention(16, 2)
    x = torch.randn(2, 4, 16, requires_grad=True)
    out = layer(x, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))[0]
    out.sum().backward()
    torch.testing.assert_close(out, layer.out_proj.bias.detach().expand_as(out))
    assert x.grad is None  # nothing to attend to: no kernel, no gradient (the masked path's are zeros)


def test_packing_leaves_out_empty_sequences_and_is_reused_for_the_same_mask():
    kpm = lengths_mask([3, 0, 2], 3)
    pack = padding_free.packing(kpm, 3, True)
    assert pack.q_rows.tolist() == pack.k_rows.tolist() == [0, 1, 2, 6, 7]
    assert pack.cu_k.tolist() == [0, 3, 5] and (pack.max_q, pack.max_k) == (3, 3)
    cross = padding_free.packing(kpm, 2, False)  # two queries per sequence, the one without keys left out
    assert cross.q_rows.tolist() == [0, 1, 4, 5] and cross.cu_q.tolist() == [0, 2, 4] and cross.max_q == 2
    assert padding_free.packing(kpm, 3, True) is pack
    kpm[0, 2] = True  # in place: a new packing
    assert padding_free.packing(kpm, 3, True).cu_k.tolist() == [0, 2, 4]


def tiny_seq2seq() -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(30, 30, 32, 4, 2, 2, 64, 0.0, share_embeddings=True, pad_id=0)


def padded_sentences(lengths: list[int], g: torch.Generator) -> torch.Tensor:
    """BOS w.. EOS PAD.. (B, max + 2)."""
    tokens = torch.zeros(len(lengths), max(lengths) + 2, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, 0], tokens[i, 1 : n + 1], tokens[i, n + 1] = 1, torch.randint(4, 30, (n,), generator=g), 2
    return tokens


def loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_grads(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_seq2seq_on_padded_batches_same_loss_and_grads(forced, monkeypatch):
    kernel, calls = forced
    g = torch.Generator().manual_seed(0)
    src, tgt = padded_sentences([6, 2, 4, 1], g), padded_sentences([3, 5, 1, 2], g)
    tgt_in, labels = teacher_forcing(tgt)
    model = tiny_seq2seq()

    def loss(m):
        return label_smoothed_nll_loss(m(src, tgt_in), labels, 0.1, 0)[0]

    ours = loss_and_grads(model, loss)
    # encoder self-attention x2, decoder cross-attention x2, and decoder causal self-attention x2 with varlen
    assert len(calls) == (6 if kernel == "varlen" else 4)
    monkeypatch.setitem(attention.PADDING_FREE, "cpu", ())
    assert_same_loss_and_grads(ours, loss_and_grads(model, loss))


def test_detr_on_padded_images_same_loss_and_grads(forced, monkeypatch):
    kernel, calls = forced
    torch.manual_seed(0)
    model = DETR(Backbone(**TINY_TRUNK), 3, 5, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                 dim_feedforward=64, dropout=0.0)  # fmt: skip
    criterion = SetCriterion(3, HungarianMatcher(1, 5, 2), num_aux=1)
    images, mask = torch.randn(3, 3, 64, 48), torch.zeros(3, 64, 48, dtype=torch.bool)
    mask[1, :, 32:] = True  # padded on the right: valid cells are not a prefix of the flattened map
    mask[2, 48:, :] = True
    mask[2, :, 16:] = True
    g = torch.Generator().manual_seed(1)
    targets = [{"labels": torch.randint(0, 3, (2,), generator=g), "boxes": torch.rand(2, 4, generator=g) * 0.4 + 0.1}
               for _ in range(3)]  # fmt: skip

    def loss(m):
        return criterion.total(criterion(m(images, mask), targets))

    ours = loss_and_grads(model, loss)
    assert len(calls) == 4  # encoder self-attention x2, decoder cross-attention x2
    monkeypatch.setitem(attention.PADDING_FREE, "cpu", ())
    assert_same_loss_and_grads(ours, loss_and_grads(model, loss))


def test_padded_benchmarks_check_every_path_and_name_those_that_fail(monkeypatch):
    from benchmarks import peers

    quick = peers.Settings(quick=True)
    bench = peers.padded_attention_bench(16, quick)
    assert list(bench.steps) == ["no mask", "masked SDPA", "nested"]  # the CPU has no varlen_attn
    assert "varlen fails: Could not run 'aten::_flash_attention_forward'" in bench.check
    diff = float(bench.check.split("nested max |Δ| at valid rows vs masked SDPA ")[1])
    assert diff < 1e-5
    calls, original = [], attention.attention_padding_free
    monkeypatch.setattr(attention, "attention_padding_free", lambda *a, **k: calls.append(a[7]) or original(*a, **k))
    for step in bench.steps.values():
        step()
    assert calls == ["nested"] and attention.PADDING_FREE["cpu"] == ()  # each side on its path, then restored
    bench = peers.padded_seq2seq_bench(0.3, quick)
    assert list(bench.steps) == ["ours, masked SDPA", "ours, nested", "nn.Transformer"]
    assert "varlen" not in bench.check  # no dropout in varlen_attn: not a side


def test_padding_rows_skip_without_cuda_with_a_line(capsys):
    from benchmarks.run import main

    if torch.cuda.is_available():
        pytest.skip("with CUDA the rows run")
    main(["--only", "padding,gpu", "--no-memory", "--output", "-"])  # with --quick the gpu section rehearses
    err = capsys.readouterr().err
    assert "padding section skipped: no CUDA device" in err and "gpu section skipped: no CUDA device" in err


def test_padding_report_runs_every_row_on_the_smallest_shapes():
    """The report a GPU session reads (`python -m benchmarks --only padding`), here on the CPU's kernels."""
    from benchmarks import peers
    from benchmarks.run import parse_args
    from benchmarks.sections import padding_report

    report = padding_report(peers.Settings(quick=True), parse_args(["--quick"]))
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [(r[0].lstrip("| "), r[1]) for r in rows] == [
        *((f"self-attention, L={n}", side) for n in (16, 32) for side in ("no mask", "masked SDPA", "nested")),
        *(("Multi30k step, dropout 0.3", side) for side in ("ours, masked SDPA", "ours, nested", "nn.Transformer")),
        *(("Multi30k step, dropout 0.0", side) for side in ("ours, masked SDPA", "ours, nested", "nn.Transformer")),
    ]
    assert "varlen fails" in report and "PADDING_FREE['cuda'] = ()" in report
