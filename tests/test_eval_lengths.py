"""Evaluation beyond the training context and size in a tiny fit, and the largest attention logit in training."""

import pytest
import pytorch_lightning as pl
import torch

from benchmarks.harness import quiet_trainer
from datamodules.text.corpus import TextCorpusDataModule
from datamodules.vision.classification import DigitsDataModule
from experiments.callbacks import MaxAttentionLogit
from models.text.lm_module import LanguageModelModule
from models.vision.module import ImageClassifier


def _trainer(tmp_path, max_steps=2, **kw) -> pl.Trainer:
    return quiet_trainer(
        max_steps=max_steps, limit_train_batches=2, limit_val_batches=2, default_root_dir=tmp_path, **kw
    )


def _corpus(tmp_path, val_block_size=32) -> TextCorpusDataModule:
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i} of the generated text, {i * 7 % 13} words\n" for i in range(120)))
    data = TextCorpusDataModule(str(text), block_size=8, val_block_size=val_block_size, batch_size=4)
    data.prepare_data()
    data.setup("fit")
    return data


def _lm(data, **kw) -> LanguageModelModule:
    network = dict(d_model=16, nhead=2, num_layers=1, dropout=0.0, max_positions=8, warmup_steps=1)
    return LanguageModelModule(vocab_size=data.vocab_size, **{**network, **kw})


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "alibi"])
def test_language_model_is_scored_at_1_2_and_4_times_its_context(tmp_path, positions):
    torch.manual_seed(0)
    data = _corpus(tmp_path)
    trainer = _trainer(tmp_path)
    trainer.fit(_lm(data, positions=positions, eval_context=[1, 2, 4]), data)
    metrics = trainer.callback_metrics
    assert {"val/loss@1x", "val/loss@2x", "val/loss@4x", "val/ppl@4x", "val/loss", "val/ppl"} <= set(metrics)
    assert metrics["val/loss"] == metrics["val/loss@1x"] and torch.isfinite(metrics["val/loss@4x"])


def test_learned_positions_score_longer_contexts_only_resampled(tmp_path):
    data = _corpus(tmp_path)
    with pytest.raises(ValueError, match="exceeds max_positions=8 .*model.resample_positions"):
        _trainer(tmp_path).fit(_lm(data, positions="learned", eval_context=[1, 2]), data)
    trainer = _trainer(tmp_path)
    trainer.fit(_lm(data, positions="learned", eval_context=[1, 2], resample_positions=True), data)
    assert "val/loss@2x" in trainer.callback_metrics


def test_eval_context_needs_1_and_windows_that_split_into_every_length(tmp_path):
    data = _corpus(tmp_path, val_block_size=24)
    with pytest.raises(ValueError, match=r"model.eval_context=\[2, 4\]: .*1 among them"):
        _lm(data, eval_context=[2, 4])
    with pytest.raises(ValueError, match="windows of 24 tokens .* chunks of 4 x model.max_positions = 32"):
        _trainer(tmp_path).fit(_lm(data, positions="rope", eval_context=[1, 4]), data)


@pytest.mark.parametrize("positions", ["learned", "sincos2d", "rope_axial", "rope_mixed", "relpos"])
def test_vit_trained_at_8px_is_scored_at_8_12_and_16px(tmp_path, positions):
    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=32)
    model = ImageClassifier(
        img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=1, num_heads=2,
        positions=positions, eval_sizes=[8, 12, 16], warmup_epochs=0.1,
    )  # fmt: skip
    trainer = _trainer(tmp_path)
    trainer.fit(model, data)
    assert {"val/acc@8px", "val/acc@12px", "val/acc@16px", "val/loss@16px"} <= set(trainer.callback_metrics)
    assert trainer.callback_metrics["val/acc@8px"] == trainer.callback_metrics["val/acc"]


def test_eval_sizes_the_patches_do_not_tile_are_refused():
    net = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=16, depth=1, num_heads=2)
    with pytest.raises(ValueError, match=r"model.eval_sizes=\[8, 9\]: model.patch_size=2 does not divide"):
        ImageClassifier(eval_sizes=[8, 9], **net)


def test_max_attention_logit_is_logged_at_logging_steps_only(tmp_path):
    torch.manual_seed(0)
    data = _corpus(tmp_path)
    model = _lm(data, positions="rope")
    trainer = _trainer(tmp_path, max_steps=1, log_every_n_steps=2, callbacks=[MaxAttentionLogit()])
    trainer.fit(model, data)
    assert "train/max_attn_logit" not in trainer.callback_metrics  # step 1 is not a logging step
    trainer = _trainer(tmp_path, max_steps=2, log_every_n_steps=2, callbacks=[MaxAttentionLogit()])
    trainer.fit(model, data)
    logit = trainer.callback_metrics["train/max_attn_logit"]
    assert torch.isfinite(logit) and logit.ndim == 0
    assert all(m._captured is None for m in model.modules() if hasattr(m, "_captured"))  # released


def test_max_attention_logit_is_the_largest_unblocked_logit():
    from models.core.capture import capture_attention

    # a model whose largest logit is a blocked (future) one, on torch 2.11 and 2.14 alike (nn.init.trunc_normal_,
    # which the learned positions use, draws other numbers from the same seed since torch 2.13)
    torch.manual_seed(7)
    data_free = LanguageModelModule(vocab_size=11, d_model=16, nhead=2, num_layers=2, max_positions=8).eval()
    tokens = torch.randint(11, (2, 8))
    with capture_attention(data_free, scores=True) as maps:
        data_free(tokens)
    causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    expected = max(call.logits.masked_fill(causal, float("-inf")).max() for calls in maps.values() for call in calls)
    assert expected < max(call.logits.max() for calls in maps.values() for call in calls)  # a blocked logit is larger
    callback, logged = MaxAttentionLogit(), {}
    data_free.log = lambda name, value, **kw: logged.update({name: value})
    trainer = type("T", (), {"log_every_n_steps": 1, "global_step": 0})()
    callback.on_train_batch_start(trainer, data_free, None, 0)
    data_free(tokens)
    callback.on_train_batch_end(trainer, data_free, None, None, 0)
    torch.testing.assert_close(logged["train/max_attn_logit"], expected)
