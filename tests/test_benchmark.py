"""The benchmark's fast paths and peers compute what they claim, its measuring is sound, and the script
runs end to end on the smallest shapes. No timed assertions: speed is the benchmark's job."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import peers
from benchmarks.cases import cases
from benchmarks.data_pipeline import batch_size_of
from benchmarks.harness import Ratio, Timing, interleaved, quantile
from benchmarks.report import verdict
from benchmarks.run import main
from benchmarks.scaling import attention_share, profile_step, sdpa_kernels
from models.core.attention import MultiHeadAttention
from models.text.decoding import beam_search
from models.text.seq2seq import Seq2SeqTransformer

QUICK = peers.Settings(quick=True)
ROOT = Path(__file__).resolve().parents[1]


def test_attention_peers_match_ours_in_outputs_and_gradients():
    torch.manual_seed(0)
    ours, sdpa, mha = (
        MultiHeadAttention(32, 4),
        peers.SDPAAttention(32, 4),
        nn.MultiheadAttention(32, 4, batch_first=True),
    )
    sdpa.load_state_dict(ours.state_dict())
    mha.load_state_dict(ours.state_dict())
    kpm = peers.padding_mask(3, 10, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert kpm[0].sum() == 0 and kpm.any()
    grads = []
    for forward in (
        lambda x: ours(x, key_padding_mask=kpm)[0],
        lambda x: sdpa(x, key_padding_mask=kpm),
        lambda x: mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0],
    ):
        x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = forward(x)
        out.pow(2).sum().backward()
        grads.append((out.detach(), x.grad))
    for out, grad in grads[1:]:
        torch.testing.assert_close(out, grads[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, grads[0][1], atol=1e-5, rtol=1e-5)


def test_vit_and_seq2seq_peers_hold_our_weights():
    ours, theirs = peers.vit_pair(peers.QUICK_VIT, torch.device("cpu"), num_classes=10)
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(ours.eval()(images), theirs.eval()(images), atol=1e-5, rtol=1e-5)

    ours, theirs, (*_, vocab, _) = peers.seq2seq_models("small", QUICK, dropout=0.0)
    g = torch.Generator().manual_seed(0)
    src, tgt = peers.random_sentences(3, 2, 6, vocab, g), peers.random_sentences(3, 2, 6, vocab, g)
    keep = tgt.ne(0)
    torch.testing.assert_close(ours.eval()(src, tgt)[keep], theirs.eval()(src, tgt)[keep], atol=1e-5, rtol=1e-5)


def test_beam_search_on_the_cache_equals_re_running_the_prefix():
    torch.manual_seed(0)
    model = Seq2SeqTransformer(40, 40, 32, 2, 2, 2, 64, 0.0, share_embeddings=True).eval()
    with torch.no_grad():
        model.generator.weight[2] *= 3  # EOS likelier: sentences finish at different steps and leave the batch
    src = peers.random_sentences(8, 2, 7, 40, torch.Generator().manual_seed(0))
    ids = dict(bos_id=1, eos_id=2, pad_id=0, max_len=9, beam_size=3)
    cached_tokens, cached_scores = beam_search(model, src, **ids)
    plain_tokens, plain_scores = beam_search(peers.WithoutCache(model), src, **ids)
    assert len(set(cached_tokens.ne(0).sum(1).tolist())) > 2
    assert torch.equal(cached_tokens, plain_tokens)
    torch.testing.assert_close(cached_scores, plain_scores, atol=1e-4, rtol=1e-4)


def test_hf_detr_peer_is_our_detr_size_and_trains():
    pytest.importorskip("transformers")
    bench = peers.detr_bench("small", QUICK)
    assert set(bench.steps) == {"ours", "HF DETR"}
    ours, theirs = bench.check.removeprefix("ours ").split(", HF ")
    assert ours == theirs and "trained" in ours  # same parameters, same ones trained
    for side in bench.steps:
        share = bench.extra[side]()["matching"]
        assert (
            share.endswith("% of the step") and 0 < float(share.split("%")[0]) <= 100
        )  # 0: the timer missed the matcher


def test_matching_peer_is_hugging_faces_matcher_with_the_same_assignments():
    pytest.importorskip("transformers")
    bench = peers.matching_bench("r50", QUICK)
    assert set(bench.steps) == {"ours", "HF matcher"}
    assert bench.check.endswith("same assignment for 4/4 (layer, image) pairs")  # 2 layers x 2 images
    assert len(bench.steps["ours"]()) == len(bench.steps["HF matcher"]()) == 2  # per layer


def test_profiler_sees_the_fused_cpu_kernel_and_its_share():
    bench = peers.attention_bench(16, False, QUICK)
    events = profile_step(bench.steps["ours"])
    assert sdpa_kernels(events) == "flash (CPU)"
    assert 0 < attention_share(events) < 1


@pytest.mark.slow
def test_peak_memory_sees_a_64_mib_tensor_that_the_step_frees():
    # in a fresh process with the allocator settings of the benchmark's probes: this one's heap holds
    # whatever earlier tests freed, which a step may reuse without the resident set growing
    code = (
        "import torch; from benchmarks.harness import step_peak_mib; "
        "print(step_peak_mib(lambda: torch.ones(64, 2**20 // 4).sum(), torch.device('cpu')))"
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT
    ).stdout
    assert 60 < float(out.strip().splitlines()[-1]) < 200


def test_interleaved_timing_and_ratios():
    calls = []
    timings = interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        torch.device("cpu"),
        repeats=4,
        warmup=1,
        min_sample_s=0,
    )
    assert calls[:2] == ["a", "b"] and len(timings["a"].cpu) == len(timings["b"].wall) == 4
    ratio = Ratio.of(Timing([2.0, 2.0, 4.0], [2.0] * 3), Timing([1.0, 2.0, 2.0], [1.0] * 3))
    assert ratio.median == 1.0 and ratio.wall == 2.0 and (ratio.p25, ratio.p75) == (1.5, 2.0)
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert verdict(Ratio(1.0, 0.9, 1.1, 1.0), 1.0) == "yes"
    assert verdict(Ratio(1.1, 0.95, 1.2, 1.0), 1.0) == "within noise"
    assert verdict(Ratio(1.3, 1.2, 1.4, 1.0), 1.0) == "no"
    assert batch_size_of({"index": torch.zeros(5), "src": torch.zeros(5, 3)}) == 5
    assert batch_size_of((torch.zeros(4, 1, 8, 8), torch.zeros(4))) == 4


def test_case_keys_are_unique_and_every_section_has_cases():
    all_cases = cases(quick=True)
    assert len({c.key for c in all_cases}) == len(all_cases)
    assert {c.section for c in all_cases} == {
        "core",
        "attention",
        "options",
        "vit",
        "text",
        "decoding",
        "detr",
        "scaling",
    }


def test_memory_probe_prints_json(capsys):
    main(["--memory-probe", "attention/L=16/padded", "sdpa", "--quick"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["key"] == "attention/L=16/padded" and result["peak_mib"] >= 0


@pytest.mark.slow
def test_quick_run_prints_the_tables_and_appends_only_to_its_output(tmp_path):
    output = tmp_path / "results.md"
    output.write_text("# someone else's section\n")
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "--quick",
        "--only",
        "attention",
        "--no-memory",
        "--output",
        str(output),
    ]
    printed = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout  # as a user runs it
    written = output.read_text()
    assert written.startswith("# someone else's section\n") and printed.strip() in written
    assert "Command: `python -m benchmarks --quick" in written and f"--output {output}" in written and "CPU" in written
    for row in (
        "| L=16 | sdpa |",
        "| L=16 | nn.MHA |",
        "| L=32, key padding | sdpa |",
        "| L=32, key padding | nn.MHA |",
    ):
        assert row in written
    assert str(output) not in (ROOT / "benchmarks" / "RESULTS.md").read_text()


def test_unknown_section_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "attention,speed"])
    assert exit_.value.code == 2 and "--only: unknown name(s) speed" in capsys.readouterr().err
