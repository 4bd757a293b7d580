"""Simulated W8A8 (`experiments.callbacks.w8a8`, the `W8A8` callback) against torch's own per-tensor quantisation, the
outlier mechanism of Bondarenko et al. 2023, a hand count of the linear layers, and the run's own metrics."""

import csv
import json

import pytest
import torch
import torch.nn.functional as F
from builders import tiny_seq2seq
from conftest import config_args
from torch import nn

from experiments.callbacks.w8a8 import freeze, w8a8
from models.core.attention import AttentionConfig, MultiHeadAttention


def _distinct(x: torch.Tensor) -> int:
    return x.detach().unique().numel()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # the oracle: deprecated, still torch's
def test_a_linear_layer_computes_with_its_weight_and_input_rounded_by_torchs_per_tensor_quantisation():
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    calibration = [torch.randn(4, 5) + 0.5, 3 * torch.randn(4, 5)]
    x = 4 * torch.randn(6, 5)  # beyond the calibrated range too: clamped
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    with w8a8(layer) as layers:
        for batch in calibration:
            assert torch.equal(layer(batch), F.linear(batch, w, b))  # calibrating: fp32
        freeze(layer)
        out = layer(x)
    assert layers == 1
    # the ranges by hand, from min-max: inputs quint8 affine over both batches, the weight qint8 symmetric
    seen = torch.cat(calibration)
    low, high = min(seen.min(), 0.0), max(seen.max(), 0.0)
    x_scale = float((high - low) / 255)
    x_zero = int(torch.clamp(-torch.round(low / x_scale), 0, 255))
    w_scale = float(w.abs().max() / 127.5)
    x_q = torch.quantize_per_tensor(x, x_scale, x_zero, torch.quint8).dequantize()
    w_q = torch.quantize_per_tensor(w, w_scale, 0, torch.qint8).dequantize()
    torch.testing.assert_close(x_q, torch.fake_quantize_per_tensor_affine(x, x_scale, x_zero, 0, 255))
    torch.testing.assert_close(w_q, torch.fake_quantize_per_tensor_affine(w, w_scale, 0, -128, 127))
    torch.testing.assert_close(out, F.linear(x_q, w_q, b), rtol=0, atol=1e-6)
    assert torch.equal(layer(x), F.linear(x, w, b))  # and as it was after the block


def _mlp(outlier: float) -> nn.Sequential:
    """x (B, 16) -> 32 ReLU units -> 10 logits. Unit 0 carries a constant ``outlier`` (its bias) that the second layer
    never reads (its weights to it are 0): the function does not depend on it, the second layer's input range does."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10))
    with torch.no_grad():
        net[0].weight[0] = 0.0
        net[0].bias[0] = outlier
        net[2].weight[:, 0] = 0.0
    return net


def _w8a8_error(net: nn.Sequential, calibration: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """Relative error of the W8A8 output against fp32, and the share of inputs whose top class changes."""
    with torch.no_grad():
        reference = net(x)
        with w8a8(net):
            net(calibration)
            freeze(net)
            out = net(x)
    error = float((out - reference).norm() / reference.norm())
    return error, float((out.argmax(-1) != reference.argmax(-1)).float().mean())


def test_an_activation_outlier_costs_w8a8_the_fidelity_that_the_same_function_keeps_without_it():
    """Bondarenko et al.'s mechanism: one outlier sets a per-tensor range so wide that the other values round away."""
    torch.manual_seed(1)
    calibration, x = torch.randn(256, 16), torch.randn(512, 16)
    clean, outlier = _mlp(0.0), _mlp(1000.0)
    with torch.no_grad():
        torch.testing.assert_close(clean(x), outlier(x))  # one function in fp32
    clean_error, clean_flips = _w8a8_error(clean, calibration, x)
    outlier_error, outlier_flips = _w8a8_error(outlier, calibration, x)
    assert clean_error < 0.02 and clean_flips < 0.02
    assert outlier_error > 20 * clean_error and outlier_flips > 10 * max(clean_flips, 0.01)


def test_every_linear_layer_of_a_gated_encoder_decoder_is_quantised_and_given_back():
    """Each linear layer of a Transformer with gates computes with a weight and inputs on an 8-bit grid (at most 256
    values; the packed in_proj's query, key and value, the memory in cross-attention included), counted by hand:
    2 encoder layers x (in_proj, out_proj, gate_proj, linear1, linear2) + 2 decoder layers x (2 x (in_proj, out_proj,
    gate_proj), linear1, linear2) + the generator = 27."""
    model = tiny_seq2seq(50, attention=AttentionConfig(gate="elementwise"))
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        reference = model(src, tgt)
        grid: dict[str, bool] = {}

        def probe(name: str, weight: str):
            def hook(module, args, kwargs):  # registered after the quantizers: it sees what the layer computes with
                inputs = [
                    t for t in (*args, *kwargs.values())[:3] if isinstance(t, torch.Tensor) and t.is_floating_point()
                ]
                grid[name] = all(_distinct(t) <= 256 for t in [*inputs, getattr(module, weight)])

            return hook

        with w8a8(model) as layers:
            model(src, tgt)
            freeze(model)
            handles = [
                m.register_forward_pre_hook(
                    probe(name, "weight" if isinstance(m, nn.Linear) else "in_proj_weight"), with_kwargs=True
                )
                for name, m in model.named_modules()
                if isinstance(m, (nn.Linear, MultiHeadAttention))
            ]
            quantized = model(src, tgt)
            for h in handles:
                h.remove()
        after = model(src, tgt)
    assert layers == 27 and len(grid) == 27 and all(grid.values()), grid
    assert not torch.equal(quantized, reference)
    assert torch.equal(after, reference)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_the_callback_scores_a_run_in_fp32_and_w8a8_on_its_own_batches(attnlab, tmp_path):
    """A digits fit with the callback: its fp32 numbers are the run's own final validation (the same batches and
    weights), W8A8 differs from them, and summary.json carries the marker; then `attnlab test` on its checkpoint adds
    the test split, whose fp32 numbers are the test loop's own."""
    callback = ("--trainer.callbacks+=experiments.callbacks.W8A8", "--trainer.callbacks.calibration_batches=4")
    args = config_args("configs/vision/digits.yaml", tmp_path, "--trainer.max_epochs=1", *callback)
    code, out, err = attnlab("fit", *args)
    assert code == 0, err
    assert "attnlab: W8A8 (17 linear layers; ranges from 4 training batches)" in out
    run = tmp_path / "lightning_logs" / "version_0"
    summary = json.loads((run / "summary.json").read_text())
    marker = summary["quantization"]
    # 4 blocks x (in_proj, out_proj, fc1, fc2) + the head
    assert {k: marker[k] for k in ("scheme", "calibration_batches", "layers")} == {
        "scheme": "w8a8",
        "calibration_batches": 4,
        "layers": 17,
    }
    fp32, quantized = marker["val"]["fp32"], marker["val"]["w8a8"]
    assert fp32 == {k: summary["metrics"][k] for k in ("val/loss", "val/acc")}
    assert quantized.keys() == fp32.keys() and quantized["val/loss"] != fp32["val/loss"]
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/acc@fp32", "val/acc@w8a8", "val/loss@fp32", "val/loss@w8a8"} <= set(header)

    code, out, err = attnlab(
        "test", *config_args("configs/vision/digits.yaml", tmp_path, "--ckpt_path=best", *callback)
    )
    assert code == 0, err
    marker = json.loads((run / "summary.json").read_text())["quantization"]
    assert marker["val"]["fp32"] == fp32  # kept
    with (tmp_path / "lightning_logs" / "version_1" / "metrics.csv").open() as f:
        tested = next(float(row["test/loss"]) for row in csv.DictReader(f) if row["test/loss"])
    assert marker["test"]["fp32"]["test/loss"] == pytest.approx(tested, abs=1e-6)
    assert marker["test"]["w8a8"]["test/loss"] != marker["test"]["fp32"]["test/loss"]


def test_a_calibration_of_no_batches_is_one_line(attnlab, tmp_path):
    code, _, err = attnlab(
        "fit",
        *config_args("configs/vision/digits.yaml", tmp_path, "--trainer.fast_dev_run=true"),
        "--trainer.callbacks+=experiments.callbacks.W8A8",
        "--trainer.callbacks.calibration_batches=0",
    )
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "attnlab: error: trainer.callbacks: W8A8.calibration_batches=0: expected a positive number of training batches"
    )
