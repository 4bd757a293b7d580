"""LightningModules for text: `TranslationModule` (encoder-decoder) and `LanguageModelModule` (decoder-only).

Vocabulary sizes and special-token ids are linked from the DataModule. Text comes back through
the DataModule's tokenizer (``trainer.datamodule.decode_target`` / ``decode``), so BLEU and chrF
are computed by sacreBLEU on detokenized text against the raw reference sentences. Sample
translations and generated text are shown by callbacks (`experiments.text_callbacks`).
"""

from __future__ import annotations

from typing import Literal

import pytorch_lightning as pl
import torch.nn.functional as F
from sacrebleu.metrics import BLEU, CHRF
from torch import Tensor, nn
from torchmetrics import MeanMetric

from models import optim
from models.decoding import CACHE_KINDS, CacheKind, beam_search, greedy_decode
from models.distributed import clip_gradients, gather_objects
from models.hf_text import lm_from_pretrained, marian_from_pretrained
from models.text import DecoderOnlyLM, Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing

Schedule = Literal["inverse_sqrt", "cosine"]


def check_vocabulary(checkpoint: dict, current: dict, names: tuple[str, ...]) -> None:
    """Refuse a checkpoint whose vocabulary facts differ from the data's, before torch meets a shape mismatch.
    A fact missing on either side (a network default never written into the hyper-parameters) is not compared."""
    saved = checkpoint.get("hyper_parameters", {})
    diffs = [
        f"{n}={saved[n]} in the checkpoint but {current[n]} from the data"
        for n in names
        if n in saved and n in current and saved[n] != current[n]
    ]
    if diffs:
        raise ValueError(
            f"the checkpoint's vocabulary does not match the data's tokenizer ({'; '.join(diffs)}): use the tokenizer settings "
            "of the run that made the checkpoint, or set data.tokenizer_dir to that run's folder"
        )


def check_cache(cache: str) -> None:
    if cache not in CACHE_KINDS:
        raise ValueError(f"model.cache={cache!r} is not known; choose one of {', '.join(CACHE_KINDS)}")


def configure_adamw(module: pl.LightningModule, model: nn.Module) -> dict:
    """AdamW with weight decay on matrices only, and the chosen schedule stepped per optimizer step."""
    hp = module.hparams
    optimizer = optim.adamw(model, hp.lr, hp.weight_decay, tuple(hp.betas), hp.eps)
    return {
        "optimizer": optimizer,
        "lr_scheduler": optim.schedule(
            optimizer, module.trainer, hp.schedule, hp.warmup_steps, min_ratio=hp.min_lr_ratio
        ),
    }


class TranslationModule(pl.LightningModule):
    """`Seq2SeqTransformer` trained with teacher forcing and label smoothing; BLEU/chrF by decoding.

    Args:
        **network: the arguments of `Seq2SeqTransformer` (its docstring holds them, its signature their
            defaults); ``src_vocab_size``, ``tgt_vocab_size`` and ``pad_id`` are linked from the DataModule.
        bos_id: the token decoding starts with, linked from the DataModule.
        eos_id: the token that ends a translation, linked from the DataModule.
        label_smoothing: ε of the training loss.
        lr: AdamW's peak learning rate.
        betas: AdamW's betas.
        eps: AdamW's epsilon.
        weight_decay: AdamW's decay, on matrices only.
        schedule: "inverse_sqrt" (the paper: linear warmup, then ∝ 1/√step) or "cosine" (warmup, then
            cosine decay to ``min_lr_ratio``·lr).
        warmup_steps: optimizer steps of linear warmup.
        min_lr_ratio: the cosine schedule's final learning rate, as a fraction of ``lr``.
        val_beam_size: beam for validation (1 = greedy).
        beam_size: beam for test and predict.
        length_penalty: α of the beam search's length normalisation.
        max_len_a: translations stop after ``max_len_a``·|source| + ``max_len_b`` tokens.
        max_len_b: see ``max_len_a``.
        cache: how decoding keeps keys and values (`models.decoding`): "dynamic" (a cache that grows by each step),
            "static" (fixed-size buffers, every step the same shapes, replayed as a CUDA graph on a GPU; the
            same translations) or "auto": static on a GPU, where it decoded in 0.30x the time on an H100
            (benchmarks/RESULTS.md, "GPU rows (H100)"), dynamic on the CPU.
        init_from: a Marian (opus-mt) folder written by ``save_pretrained``, or its hub name (resolved when
            online): its config.json sets the architecture (recorded in the hyper-parameters), its weights
            start the training, and the data must use its tokenizer (``data.tokenizer: pretrained``); see
            `models.hf_text`.
    Logged: ``train/loss`` (smoothed), ``val|test/loss`` (NLL per token), ``val|test/ppl``,
    ``val|test/bleu`` and ``val|test/chrf`` (sacreBLEU, detokenized).
    After each evaluation, ``translations`` holds its (source, reference, hypothesis) triples, every
    process's, in dataset order, and ``sacrebleu_signatures`` how the scores were made (for
    `experiments.text_callbacks.TranslationSamples`).
    """

    def __init__(
        self,
        bos_id: int = 1,
        eos_id: int = 2,
        label_smoothing: float = 0.1,
        lr: float = 7e-4,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-9,
        weight_decay: float = 0.0,
        schedule: Schedule = "inverse_sqrt",
        warmup_steps: int = 4000,
        min_lr_ratio: float = 0.0,
        val_beam_size: int = 1,
        beam_size: int = 4,
        length_penalty: float = 0.6,
        max_len_a: float = 1.5,
        max_len_b: int = 10,
        cache: CacheKind = "auto",
        init_from: str | None = None,
        **network,
    ):
        super().__init__()
        self.save_hyperparameters()
        check_cache(cache)
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"model.label_smoothing={label_smoothing} must be in [0, 1)")
        for key, value in (("val_beam_size", val_beam_size), ("beam_size", beam_size)):
            if value < 1:
                raise ValueError(f"model.{key}={value} must be >= 1")
        if init_from:
            self.model, architecture = marian_from_pretrained(init_from, network, bos_id, eos_id)
            self.hparams.update(architecture)  # the folder's architecture, recorded as this run's
        else:
            self.model = Seq2SeqTransformer(**network)
        self.val_nll, self.test_nll = MeanMetric(), MeanMetric()
        self._outputs: list[tuple[int, str, str, str]] = []  # (index, source, reference, hypothesis)
        self.translations: list[tuple[str, str, str]] = []
        self.sacrebleu_signatures: dict[str, str] = {}

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        return self.model(src, tgt)

    def translate(self, src: Tensor, beam_size: int) -> Tensor:
        """src (B, S) -> token ids (B, L), EOS-terminated, PAD after."""
        hp, pad_id = self.hparams, self.model.pad_id
        src_len = int(src.ne(pad_id).sum(1).max())
        max_len = max(1, min(self.model.max_positions, int(hp.max_len_a * src_len + hp.max_len_b)))
        ids = dict(bos_id=hp.bos_id, eos_id=hp.eos_id, pad_id=pad_id, max_len=max_len, cache=hp.cache)
        if beam_size == 1:
            return greedy_decode(self.model, src, **ids)[0]
        return beam_search(self.model, src, beam_size=beam_size, alpha=hp.length_penalty, **ids)[0]

    def _detokenize(self, ids: Tensor) -> list[str]:
        datamodule = self.trainer.datamodule
        if not hasattr(datamodule, "decode_target"):
            raise ValueError(
                "TranslationModule needs a DataModule with decode_target() (e.g. datamodules.text.ParallelTextDataModule)"
            )
        return datamodule.decode_target(ids.tolist())

    def _losses(self, batch: dict) -> tuple[Tensor, Tensor, int]:
        decoder_input, labels = teacher_forcing(batch["tgt"])  # (B, T-1) each
        logits = self(batch["src"], decoder_input)  # (B, T-1, V)
        loss, nll = label_smoothed_nll_loss(logits, labels, self.hparams.label_smoothing, self.model.pad_id)
        return loss, nll, batch["tgt_tokens"]

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss, _, _ = self._losses(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def _eval_step(self, batch: dict, metric: MeanMetric, beam_size: int) -> None:
        _, nll, tokens = self._losses(batch)
        metric.update(nll, weight=tokens)
        hyps = self._detokenize(self.translate(batch["src"], beam_size))
        self._outputs += zip(batch["index"].tolist(), batch["src_text"], batch["tgt_text"], hyps)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, self.val_nll, self.hparams.val_beam_size)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, self.test_nll, self.hparams.beam_size)

    def on_validation_epoch_start(self) -> None:
        self._outputs = []

    on_test_epoch_start = on_validation_epoch_start

    def _eval_epoch_end(self, stage: str, metric: MeanMetric) -> None:
        nll = metric.compute()
        metric.reset()
        rows = sorted(
            {r[0]: r for part in gather_objects(self._outputs) for r in part}.values()
        )  # DDP may repeat samples to even out ranks
        self._outputs = []
        self.translations = [(src, ref, hyp) for _, src, ref, hyp in rows]
        hyps, refs = [r[3] for r in rows], [r[2] for r in rows]
        bleu, chrf = BLEU(), CHRF()
        self.log_dict(
            {
                f"{stage}/loss": nll,
                f"{stage}/ppl": nll.exp(),
                f"{stage}/bleu": bleu.corpus_score(hyps, [refs]).score,
                f"{stage}/chrf": chrf.corpus_score(hyps, [refs]).score,
            },
            prog_bar=True,
            sync_dist=True,  # equal on every rank already (a synced metric, gathered rows): a mean that changes nothing
        )
        self.sacrebleu_signatures = {"BLEU": str(bleu.get_signature()), "chrF": str(chrf.get_signature())}

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val", self.val_nll)

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test", self.test_nll)

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, list[str]]:
        """Translations of the input lines, in order; each is also printed on standard output."""
        hyps = self._detokenize(self.translate(batch["src"], self.hparams.beam_size))
        hyps = [hyp if src.strip() else "" for src, hyp in zip(batch["src_text"], hyps)]  # an empty line stays empty
        print("\n".join(hyps), flush=True)
        return {"source": batch["src_text"], "translation": hyps}

    def configure_optimizers(self) -> dict:
        return configure_adamw(self, self.model)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_vocabulary(checkpoint, self.hparams, ("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"))


class LanguageModelModule(pl.LightningModule):
    """`DecoderOnlyLM` trained to predict the next token (nanoGPT's recipe by default).

    Args:
        **network: the arguments of `DecoderOnlyLM` (its docstring holds them, its signature their
            defaults); ``vocab_size`` is linked from the DataModule.
        lr: AdamW's peak learning rate.
        betas: AdamW's betas.
        eps: AdamW's epsilon.
        weight_decay: AdamW's decay, on matrices only.
        schedule: "cosine" (linear warmup, then cosine decay to ``min_lr_ratio``·lr) or "inverse_sqrt".
        warmup_steps: optimizer steps of linear warmup.
        min_lr_ratio: the cosine schedule's final learning rate, as a fraction of ``lr``.
        max_new_tokens: tokens generated by `attnlab predict` (and `experiments.text_callbacks.LanguageModelSamples`).
        temperature: sampling temperature (0: always the most likely token).
        top_k: sample among the k most likely tokens (null: among all).
        cache: how generation keeps keys and values: "dynamic", "static" (a CUDA graph per step on a GPU) or
            "auto": static on a GPU, dynamic on the CPU (see `models.decoding`).
        init_from: a GPT-2 or Llama-architecture (Llama, SmolLM, Mistral) folder written by ``save_pretrained``,
            or its hub name (resolved when online): its config.json sets the architecture (recorded in the
            hyper-parameters), its weights start the training, and the data must use its tokenizer.json
            (``data.tokenizer: pretrained``); see `models.hf_text`.
        eval_context: evaluate at these multiples of the training context ``max_positions`` (train short, test
            long: Press et al. 2022), e.g. [1, 2, 4]; it must hold 1. Each validation window (``data.val_block_size``
            tokens, a multiple of every length) is cut into non-overlapping chunks of each length, so that every
            length is scored on the same tokens. None: the windows as they come.
    Logged: ``train/loss``, ``val/loss`` (nats per token), ``val/ppl``; with ``eval_context``, also
    ``val/loss@2x``, ``val/ppl@2x`` ... per multiple (``val/loss`` is ``val/loss@1x``); ``test/`` alike.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        schedule: Schedule = "cosine",
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 200,
        cache: CacheKind = "auto",
        init_from: str | None = None,
        eval_context: list[int] | None = None,
        **network,
    ):
        super().__init__()
        self.save_hyperparameters()
        check_cache(cache)
        if eval_context is not None and (1 not in eval_context or min(eval_context) < 1):
            raise ValueError(
                f"model.eval_context={eval_context}: give positive multiples of the training context, 1 among them "
                "(val/loss is measured at 1x)"
            )
        if temperature < 0:
            raise ValueError(f"model.temperature={temperature} must be >= 0 (0: always the most likely token)")
        if init_from:
            self.model, architecture = lm_from_pretrained(init_from, network)
            self.hparams.update(architecture)  # the folder's architecture, recorded as this run's
        else:
            self.model = DecoderOnlyLM(**network)
        self.val_nll = MeanMetric()
        self.context_nll = nn.ModuleDict({f"{m}x": MeanMetric() for m in eval_context or ()})

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def _chunks(self, batch: dict, multiple: int) -> dict:
        """Validation windows (B, W) -> non-overlapping chunks (B·W/L, L) of L = multiple·max_positions tokens."""
        length, window = multiple * self.model.max_positions, batch["input"].size(1)
        if window % length:
            raise ValueError(
                f"model.eval_context: validation windows of {window} tokens (data.val_block_size) do not split into "
                f"chunks of {multiple} x model.max_positions = {length}; make data.val_block_size a multiple of {length}"
            )
        return {k: batch[k].reshape(-1, length) for k in ("input", "target")}

    def _loss(self, batch: dict) -> Tensor:
        logits = self(batch["input"])  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        if not self.context_nll:
            self.val_nll.update(self._loss(batch), weight=batch["target"].numel())
        for name, metric in self.context_nll.items():
            metric.update(self._loss(self._chunks(batch, int(name[:-1]))), weight=batch["target"].numel())

    test_step = validation_step

    def _epoch_end(self, stage: str) -> None:
        metrics = {"": self.val_nll} if not self.context_nll else {f"@{k}": m for k, m in self.context_nll.items()}
        for suffix, metric in metrics.items():
            nll = metric.compute()
            metric.reset()
            # compute() is already the mean over every rank: sync_dist averages equal values and changes nothing
            if suffix in ("", "@1x"):
                self.log_dict({f"{stage}/loss": nll, f"{stage}/ppl": nll.exp()}, prog_bar=True, sync_dist=True)
            if suffix:
                self.log_dict({f"{stage}/loss{suffix}": nll, f"{stage}/ppl{suffix}": nll.exp()}, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        self._epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._epoch_end("test")

    def complete(self, prompt: Tensor, max_new_tokens: int) -> str:
        """The text of ``prompt`` (1, T) continued by ``max_new_tokens`` tokens (``temperature``, ``top_k``)."""
        hp = self.hparams
        out = self.model.generate(prompt, max_new_tokens, temperature=hp.temperature, top_k=hp.top_k, cache=hp.cache)
        return self.trainer.datamodule.decode(out.tolist())[0]

    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, list[str]]:
        """The prompt and its continuation, printed on standard output."""
        if batch["prompt"].size(1) == 0:
            raise ValueError(f"prompt {batch['prompt_text'][0]!r} has no tokens; give at least one character")
        text = self.complete(batch["prompt"], self.hparams.max_new_tokens)
        print(text, flush=True)
        return {"prompt": batch["prompt_text"], "completion": [text]}

    def configure_optimizers(self) -> dict:
        return configure_adamw(self, self.model)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_vocabulary(checkpoint, self.hparams, ("vocab_size",))
