"""experiments.callbacks.sinks and the AttentionSinks callback: sink mass, Sink^ε_1 and register mass on tensors built so that
their values are known, the outputs' max |x| and kurtosis against numpy and scipy, and the register protocol on a
tiny model whose attention is uniform by construction."""

import csv
import re

import numpy as np
import pytest
import pytorch_lightning as pl
import scipy.stats
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.harness import quiet_trainer
from experiments.callbacks import AttentionSinks, MaxAttentionLogit
from experiments.callbacks.attention_stats import attention_statistics
from experiments.callbacks.sinks import model_summary, output_outliers, register_keys, sink_stats
from models.core.attention import MultiHeadAttention


def test_sink_and_register_mass_of_a_hand_made_attention():
    """Three heads, four keys (1 and 2 are registers). Queries 0 and 1 count (key 3 is blocked to query 1), query 2
    is padding and query 3 sees no key. Head 0 puts 0.31 on the first key, head 1 0.29, head 2 0.9: Sink^ε_1 = 2/3
    (Gu et al., ε = 0.3)."""
    rows = {  # head -> the weights of queries 0 and 1
        0: [[0.31, 0.2, 0.3, 0.19], [0.31, 0.39, 0.3, 0.0]],
        1: [[0.29, 0.5, 0.1, 0.11], [0.29, 0.5, 0.21, 0.0]],
        2: [[0.9, 0.05, 0.05, 0.0], [0.9, 0.05, 0.05, 0.0]],
    }
    weights = torch.zeros(1, 3, 4, 4)  # (B, H, Lq, Lk)
    for h, row in rows.items():
        weights[0, h, :2] = torch.tensor(row)
        weights[0, h, 2, 0] = 1.0  # the padded query: all on the first key, which would lift heads 0 and 1 above ε
    blocked = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    blocked[..., 1, 3] = True
    blocked[..., 3, :] = True  # query 3 sees no key (its weights stay 0)
    valid_q = torch.tensor([[True, True, False, True]])
    stats = sink_stats(weights, blocked, valid_q, registers=slice(1, 3))
    assert stats["sink_mass"] == pytest.approx([0.31, 0.29, 0.9])
    assert stats["sink_heads"] == pytest.approx(2 / 3)
    assert stats["register_mass"] == pytest.approx([(0.5 + 0.69) / 2, (0.6 + 0.71) / 2, 0.1])
    assert sink_stats(weights, blocked, valid_q, registers=None)["register_mass"] is None


def test_max_and_kurtosis_of_the_output_equal_numpy_and_scipy_without_the_padded_rows():
    torch.manual_seed(0)
    out = torch.distributions.StudentT(3.0).sample((3, 4, 5))  # (B, Lq, D), heavy tails
    valid_q = torch.tensor([[True] * 4, [True, True, False, False], [False] * 4])
    out[1, 2:] = 50.0  # padded rows: they would set both the max and the kurtosis
    out[2] = 1000.0  # a sequence with no valid row counts for nothing
    samples = [out[0].numpy().ravel(), out[1, :2].numpy().ravel()]  # per sequence, its valid rows flattened
    got = output_outliers(out, valid_q)
    assert got["out_max"] == pytest.approx(np.mean([np.abs(s).max() for s in samples]), rel=1e-6)
    kurtosis = np.mean([scipy.stats.kurtosis(s, fisher=False) for s in samples])  # Pearson's: 3 for a normal
    assert got["out_kurtosis"] == pytest.approx(kurtosis, rel=1e-5)
    assert output_outliers(torch.zeros(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)) == {
        "out_max": 0.0,
        "out_kurtosis": None,  # a constant output has none
    }


def test_the_model_summary_reduces_layers_as_the_papers_do():
    layers = [
        {"sink_mass": [0.31, 0.29], "register_mass": [0.5, 0.7], "out_max": 2.0, "out_kurtosis": 3.0},
        {"sink_mass": [0.9, 0.05, 0.31, 0.34], "register_mass": None, "out_max": 5.0, "out_kurtosis": 9.0},
        {},  # a layer measured before these statistics
    ]
    assert model_summary(layers) == pytest.approx(
        {
            "sink_mass": (0.3 + 0.4) / 2,  # the mean over layers of each layer's head mean
            "sink_heads": 4 / 6,  # Sink^ε_1 over every head of every layer
            "register_mass": 0.6,  # over the layers that have registers
            "out_max": 5.0,  # the largest over layers
            "out_kurtosis": 6.0,  # the mean over layers
        }
    )


class RegisterNet(nn.Module):
    """Token embeddings, then two self-attention layers, the second on the residual stream. The first's logits are 0
    (query and key projections zeroed), so that each query spreads its weight evenly over the keys it sees; its key
    positions 1 and 2 are registers."""

    def __init__(self, keys: dict | None = None):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.attn, self.other = MultiHeadAttention(4, 2), MultiHeadAttention(4, 2)
        with torch.no_grad():
            self.attn.in_proj_weight[:8].zero_()  # W_q and W_k
            self.attn.in_proj_bias.zero_()
        self.keys = {"attn": slice(1, 3)} if keys is None else keys

    def register_keys(self) -> dict:
        return self.keys

    def forward(self, tokens: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)  # (B, L, D)
        y = x + self.attn(x, x, x, key_padding_mask=key_padding_mask)[0]
        return self.other(y, y, y, key_padding_mask=key_padding_mask)[0]


# five tokens; the second sequence's last one is padding: 5 queries see 5 keys, 4 queries see 4
TOKENS, PADDING = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]), torch.tensor([[False] * 5, [False] * 4 + [True]])
SINK, REGISTERS = (5 * 1 / 5 + 4 * 1 / 4) / 9, (5 * 2 / 5 + 4 * 2 / 4) / 9


def test_registers_a_model_declares_are_measured_in_their_layer_only():
    stats = attention_statistics(RegisterNet(), (TOKENS,), {"key_padding_mask": PADDING})
    attn, other = stats["layers"]
    assert attn["register_mass"] == pytest.approx([REGISTERS] * 2) and other["register_mass"] is None
    assert attn["sink_mass"] == pytest.approx([SINK] * 2) and attn["sink_heads"] == 0.0
    assert stats["summary"]["register_mass"] == pytest.approx(REGISTERS)
    assert attention_statistics(RegisterNet(keys={}), (TOKENS,))["summary"]["register_mass"] is None


@pytest.mark.parametrize(
    "keys,named", [({"nope": slice(0, 1)}, "'nope': slice(0, 1, None)"), ({"attn": 1}, "'attn': 1")]
)
def test_register_keys_naming_no_attention_layer_or_no_slice_are_refused(keys, named):
    message = f"RegisterNet.register_keys(): {named}: expected the name of one of its attention layers (attn, other)"
    with pytest.raises(ValueError, match=re.escape(message)):
        register_keys(RegisterNet(keys=keys))


class Frozen(pl.LightningModule):
    """`RegisterNet` trained at learning rate 0: every step sees the same weights."""

    def __init__(self):
        super().__init__()
        self.model = RegisterNet()

    def training_step(self, batch, batch_idx):
        return self.model(*batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _logged_rows(tmp_path, callbacks, max_steps=4) -> tuple[Frozen, list[dict]]:
    """The module after ``max_steps`` steps with ``callbacks``, and the rows of its metrics.csv. The epoch's first
    batch has no padding, its second (the one of the logging steps, 2 and 4) is TOKENS with PADDING."""
    torch.manual_seed(0)
    module = Frozen()
    data = DataLoader(TensorDataset(TOKENS.repeat(2, 1), torch.cat([torch.zeros_like(PADDING), PADDING])), batch_size=2)
    trainer = quiet_trainer(
        max_steps=max_steps,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path),
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    assert all(m._captured is None for m in module.modules() if hasattr(m, "_captured"))  # released
    return module, list(csv.DictReader(open(trainer.logger.log_dir + "/metrics.csv")))


def test_the_callback_logs_at_lightnings_logging_steps_beside_the_largest_logit(tmp_path):
    module, rows = _logged_rows(tmp_path, [MaxAttentionLogit(), AttentionSinks()])
    logged = [r for r in rows if r.get("train/sink_mass")]
    assert [int(r["step"]) for r in logged] == [1, 3]  # steps 2 and 4 of 4, every log_every_n_steps=2
    assert all(r["train/max_attn_logit"] for r in logged)  # the capture is shared, not taken from the other
    net = module.model
    with torch.no_grad():  # by hand on the padded batch: the weights never change
        x = net.embed(TOKENS)
        y = net.attn(x, x, x, key_padding_mask=PADDING)[0]
        z, weights = net.other(x + y, x + y, x + y, key_padding_mask=PADDING, need_weights=True)  # (B, H, Lq, Lk)
    other_sinks = [weights[:, h][~PADDING][:, 0].mean().item() for h in range(2)]  # over the 9 valid queries
    samples = [[out[b][~PADDING[b]].numpy().ravel() for b in range(2)] for out in (y, z)]
    out_max = max(np.mean([np.abs(s).max() for s in layer]) for layer in samples)
    kurtosis = np.mean([np.mean([scipy.stats.kurtosis(s, fisher=False) for s in layer]) for layer in samples])
    for row in logged:
        assert float(row["train/sink_mass"]) == pytest.approx((SINK + sum(other_sinks) / 2) / 2, rel=1e-5)
        assert float(row["train/sink_heads"]) == pytest.approx(sum(s > 0.3 for s in other_sinks) / 4)
        assert float(row["train/register_mass"]) == pytest.approx(REGISTERS)  # `model.attn` in the LightningModule
        assert float(row["train/attn_out_max"]) == pytest.approx(out_max, rel=1e-5)
        assert float(row["train/attn_out_kurtosis"]) == pytest.approx(kurtosis, rel=1e-5)


def test_a_model_without_registers_logs_no_register_mass(tmp_path, monkeypatch):
    monkeypatch.setattr(RegisterNet, "register_keys", lambda self: {})
    _, rows = _logged_rows(tmp_path, [AttentionSinks()], max_steps=2)
    assert rows and not any(r.get("train/register_mass") for r in rows) and any(r.get("train/sink_mass") for r in rows)


def test_a_fit_with_the_callback_stops_at_its_start_on_register_keys_naming_no_layer(tmp_path, monkeypatch):
    monkeypatch.setattr(RegisterNet, "register_keys", lambda self: {"model.attn": slice(1, 3)})  # the module's name
    with pytest.raises(ValueError, match=re.escape("RegisterNet.register_keys(): 'model.attn': slice(1, 3, None)")):
        _logged_rows(tmp_path, [AttentionSinks()], max_steps=1)
