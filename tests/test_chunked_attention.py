"""The chunked path (`models.core.chunked`): a block of query rows at a time, recomputed in the backward, equals the
full path in output and gradients for every normalisation, similarity, mask and position bias; sliding windows and
documents equal masks built here by hand; and no operation of a chunked call, forward or backward, makes a tensor
near the size of the (Lq, Lk) weights."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.core.attention import AttentionConfig, MultiHeadAttention
from models.core.masks import Documents
from models.core.position import ALiBi, RelativePositionBias2D, T5RelativePositionBias

D, H, B = 16, 2, 2
WHOLE = 1e6  # MiB: never chunked
TINY = 1e-4  # MiB: blocks of one query row


class Relu(nn.Module):
    """A normalisation of one's own: relu(s) / n over the n visible keys (row-wise)."""

    def forward(self, scores, blocked):
        n = scores.size(-1) if blocked is None else (~blocked).sum(-1, keepdim=True).clamp(min=1)
        return scores.clamp(min=0) / n


class Cosine(nn.Module):
    """A similarity of one's own: cosine of q and k, times a learned scale (its gradient flows through the blocks)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(4.0))

    def forward(self, q, k):
        return self.scale * nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).transpose(-2, -1)


class LearnedSigmoid(nn.Module):
    """A normalisation of one's own with a parameter: sigmoid at a learned bias, σ(s + b)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.tensor(-1.3))

    def forward(self, scores, blocked):
        return torch.sigmoid(scores + self.bias)


def layer(budget: float, seed: int = 0, **block) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(D, H, attention=AttentionConfig(memory_budget_mib=budget, **block))


def run(budget: float, call: dict, **block) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and the gradients of the input and of every parameter, for a fixed input and upstream gradient."""
    mha = layer(budget, **block)
    torch.manual_seed(1)
    x = torch.randn(B, call.pop("length", 11), D, requires_grad=True)
    bias_module = call.pop("bias_module", None)
    if bias_module is not None:  # ALiBi and T5 take the lengths, a Swin table its own grid
        grid = isinstance(bias_module, RelativePositionBias2D)
        call["position_bias"] = bias_module.lazy() if grid else bias_module.lazy(x.size(1), x.size(1))
    out, _ = mha(x, **call)
    out.backward(torch.randn_like(out, generator=torch.Generator().manual_seed(2)))
    grads = {"x": x.grad, **{n: p.grad for n, p in mha.named_parameters()}}
    if bias_module is not None:
        grads |= {f"bias.{n}": p.grad for n, p in bias_module.named_parameters()}
    return out, grads


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    for name in a[1]:
        if a[1][name] is None:
            assert b[1][name] is None, name
            continue
        torch.testing.assert_close(a[1][name], b[1][name], atol=1e-5, rtol=1e-5, msg=name)


def lengths_mask(lengths, length):
    return torch.arange(length)[None, :] >= torch.tensor(lengths)[:, None]


def _fresh(factory):
    def make():
        torch.manual_seed(5)
        return factory()

    return make


CALLS = {
    "causal": lambda: dict(is_causal=True),
    "causal + padding": lambda: dict(is_causal=True, key_padding_mask=lengths_mask([11, 6], 11)),
    "bidirectional + padding": lambda: dict(key_padding_mask=lengths_mask([9, 11], 11)),
    "float mask": lambda: dict(
        attn_mask=torch.randn(11, 11, generator=torch.Generator().manual_seed(7)).clamp(max=0.5)
    ),
    "documents": lambda: dict(attn_mask=Documents(torch.tensor([[0] * 4 + [1] * 7, [0] * 2 + [1] * 5 + [2] * 4]))),
    "alibi": lambda: dict(is_causal=True, bias_module=ALiBi(H)),
    "t5": lambda: dict(is_causal=True, bias_module=_fresh(lambda: T5RelativePositionBias(H, bidirectional=False))()),
}
BLOCKS = {
    "softmax": {},
    "softmax1": dict(normalization="softmax1"),
    "clipped": dict(normalization={"class_path": "models.core.attend.ClippedSoftmax", "init_args": {"alpha": 4.0}}),
    "sigmoid": dict(normalization="sigmoid"),
    "own normalization": dict(normalization=f"{__name__}.Relu"),
    "own normalization with a parameter": dict(normalization=f"{__name__}.LearnedSigmoid"),
    "own similarity": dict(similarity=f"{__name__}.Cosine"),
    "window": dict(window=4),
    "window + sigmoid": dict(window=3, normalization="sigmoid"),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("block", BLOCKS)
def test_the_chunked_path_equals_the_full_one_in_output_and_gradients(block, call):
    full = run(WHOLE, CALLS[call](), **BLOCKS[block])
    chunked = run(TINY, CALLS[call](), **BLOCKS[block])
    assert_same(full, chunked)


def test_a_swin_bias_in_chunks_equals_the_whole_table_with_its_class_token():
    def table() -> RelativePositionBias2D:
        torch.manual_seed(3)
        return RelativePositionBias2D((3, 4), H, prefix_tokens=1)

    assert_same(run(WHOLE, dict(length=13, bias_module=table())), run(TINY, dict(length=13, bias_module=table())))
    # the rows of the lazy bias are the rows of the full one, BEiT's three class entries included
    swin = table()
    lazy, whole, t = swin.lazy(), swin(), swin.relative_position_bias_table
    for start, stop in ((0, 1), (0, 5), (4, 13), (12, 13)):
        torch.testing.assert_close(lazy.rows(start, stop, (0, 13)), whole[:, start:stop])
    n_offsets = (2 * 3 - 1) * (2 * 4 - 1)
    assert torch.equal(whole[:, 0, 1], t[n_offsets]) and torch.equal(whole[:, 1, 0], t[n_offsets + 1])
    assert torch.equal(whole[:, 0, 0], t[n_offsets + 2])


def _window_mask(length: int, window: int, causal: bool) -> torch.Tensor:
    blocked = torch.zeros(length, length, dtype=torch.bool)
    for i in range(length):
        for j in range(length):
            blocked[i, j] = (j > i or i - j >= window) if causal else abs(i - j) >= window
    return blocked


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("budget", [WHOLE, TINY])
def test_a_sliding_window_is_the_band_mask_built_by_hand(causal, budget):
    windowed = run(budget, dict(is_causal=causal), window=3)
    banded = run(WHOLE, dict(attn_mask=_window_mask(11, 3, causal)))
    assert_same(windowed, banded)


@pytest.mark.parametrize("budget", [WHOLE, TINY])
def test_documents_attend_within_themselves_as_each_document_alone(budget):
    """Two documents packed in one row give, per document, what each gives on its own (bidirectional and causal)."""
    mha = layer(budget)
    torch.manual_seed(4)
    x = torch.randn(1, 9, D)
    ids = torch.tensor([[0] * 4 + [1] * 5])
    for causal in (False, True):
        packed, _ = mha(x, attn_mask=Documents(ids), is_causal=causal)
        alone = torch.cat([mha(x[:, :4], is_causal=causal)[0], mha(x[:, 4:], is_causal=causal)[0]], 1)
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_dropout_in_the_backward_draws_the_masks_of_the_forward():
    """With attention dropout, the chunked backward is the gradient of what its forward computed: its blocks draw the
    forward's dropout masks again. The oracle is torch's finite differences (float64, the same seed on every call)."""
    torch.manual_seed(0)
    config = AttentionConfig(memory_budget_mib=TINY, normalization="sigmoid")
    mha = MultiHeadAttention(D, H, dropout=0.5, attention=config).double()
    x = torch.randn(1, 7, D, dtype=torch.float64, requires_grad=True)

    def seeded(x):
        torch.manual_seed(11)
        return mha(x, is_causal=True)[0]

    assert not torch.equal(seeded(x), mha.eval()(x, is_causal=True)[0])  # dropout acts
    mha.train()
    torch.autograd.gradcheck(seeded, (x,), eps=1e-6, atol=1e-5)


def test_a_bias_that_hides_a_learned_tensor_is_one_line():
    """A `LazyBias` whose rows read a tensor that takes a gradient without naming it in ``tensors`` would lose that
    gradient on the chunked path: refused in one line."""
    from models.core.masks import LazyBias

    mha, table = layer(TINY), nn.Parameter(torch.randn(H, 11, 11))
    hidden = LazyBias(lambda start, stop, keys: table[:, start:stop, keys[0] : keys[1]], (H, 11, 11))
    out, _ = mha(torch.randn(1, 11, D), position_bias=hidden)
    with pytest.raises(ValueError, match=r"reads a tensor of shape \(2, 11, 11\) that takes a gradient"):
        out.sum().backward()
    named = LazyBias(hidden.rows, hidden.shape, (table,))
    mha(torch.randn(1, 11, D), position_bias=named)[0].sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_the_chunked_path_under_autocast_follows_the_full_path():
    """bfloat16 autocast on the CPU: the blocks of the backward run under the forward's autocast, so the chunked
    gradients are the full path's within bfloat16's precision."""
    results = []
    for budget in (WHOLE, TINY):
        mha = layer(budget, normalization="sigmoid")
        torch.manual_seed(1)
        x = torch.randn(B, 11, D, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = mha(x, is_causal=True)
        out.float().sum().backward()
        results.append((out.float(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0][1], results[1][1], atol=2e-2, rtol=2e-2)


class LargestOutput(TorchDispatchMode):
    """The most elements any operation made while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("block", ["sigmoid", "clipped", "own normalization", "window"])
def test_a_long_call_never_makes_a_tensor_of_the_weights_size(block):
    """At L = 1,024 with 2 heads the weights are 2·1024² elements; with a budget of 1 MiB the blocks hold 128 rows."""
    length = 1024
    mha = layer(1.0, **BLOCKS[block])
    x = torch.randn(1, length, D, requires_grad=True)
    bias = ALiBi(H).lazy(length, length)
    with LargestOutput() as seen:
        out, _ = mha(x, is_causal=True, position_bias=bias)
        out.sum().backward()
    assert seen.largest <= H * 128 * length
    assert torch.isfinite(x.grad).all()


def test_a_long_layers_backward_holds_one_block_not_every_block():
    """Peak resident memory of forward + backward of a causal sigmoid layer at L = 4,096 (D = 256, 8 heads), in a fresh
    process (`benchmarks.long_context`: glibc's mmap threshold at 64 KiB, VmHWM over the step): the full path holds
    2,097 MB of scores and weights; the chunked path at the default 4 MiB keeps only its inputs for the backward and
    recomputes one block at a time: 62 MB measured. Without the recomputation every block's tensors would stay. A
    test worker's own heap, used by other tests, does not measure this reliably."""
    from benchmarks.long_context import in_fresh_process

    result = in_fresh_process("benchmarks.long_context", "sigmoid", "4096", "4.0", "cpu")
    assert result is not None and result["peak_mib"] < 250, result


def test_the_default_budget_chunks_a_long_layer_and_leaves_a_short_one_whole():
    mha = layer(16.0, normalization="sigmoid")
    for length, whole in ((256, True), (2048, False)):  # scores of 2 heads: 0.5 MiB, 32 MiB
        x = torch.randn(1, length, D)
        with torch.no_grad(), LargestOutput() as seen:
            mha(x, is_causal=True)
        assert (seen.largest >= H * length * length) == whole, length


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("window", 0, r"attention.window=0: give the keys a query sees \(>= 1\), or null for all"),
        ("memory_budget_mib", 0.0, r"attention.memory_budget_mib=0.0 must be > 0"),
    ],
)
def test_a_bad_window_or_budget_is_one_line(field, value, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**{field: value})
