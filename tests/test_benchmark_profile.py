"""The attention share of `python -m benchmarks` counts every path our attention takes: SDPA on dense
tensors and the padding-free kernels (varlen_attn's custom ops, NJT SDPA's kernels), each call once."""

from types import SimpleNamespace

from benchmarks import peers
from benchmarks.scaling import attention_share, profile_step


def event(key: str, total: float, self_time: float, parent=None) -> SimpleNamespace:
    return SimpleNamespace(key=key, cpu_time_total=total, self_cpu_time_total=self_time, cpu_parent=parent)


def test_the_padding_free_path_on_nested_tensors_counts_as_attention():
    bench = peers.padded_attention_bench(16, peers.Settings(quick=True))
    shares = {side: attention_share(profile_step(bench.steps[side])) for side in ("masked SDPA", "nested")}
    assert 0 < shares["masked SDPA"] < 1
    assert 0 < shares["nested"] < 1


def test_a_kernel_inside_sdpa_is_counted_once_and_varlen_ops_count():
    sdpa = event("aten::scaled_dot_product_attention", 10, 1)
    flash = event("aten::_flash_attention_forward", 9, 9, parent=sdpa)
    varlen = event("torch_attn::_varlen_attn", 6, 1)
    varlen_flash = event("aten::_flash_attention_forward", 5, 5, parent=varlen)
    varlen_backward = event("torch_attn::_varlen_attn_backward", 4, 4)
    other = event("aten::mm", 20, 20)
    events = [sdpa, flash, varlen, varlen_flash, varlen_backward, other]
    assert attention_share(events) == (10 + 6 + 4) / 40
