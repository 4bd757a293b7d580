"""`TranslationModule`: the encoder-decoder trained with teacher forcing and label smoothing, scored by BLEU/chrF.

Vocabulary sizes and special-token ids are linked from the DataModule. Text comes back through the DataModule's
tokenizer (``trainer.datamodule.decode_target``), so BLEU and chrF are computed by sacreBLEU on detokenized text
against the raw reference sentences. Sample translations are shown by a callback (`experiments.callbacks.text`).
"""

from __future__ import annotations

import pytorch_lightning as pl
from sacrebleu.metrics import BLEU, CHRF
from torch import Tensor
from torchmetrics import MeanMetric

from models.distributed import clip_gradients, gather_objects
from models.text.decoding import CacheKind, beam_search, greedy_decode
from models.text.hf import marian_from_pretrained
from models.text.seq2seq import Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing
from models.text.training import Schedule, check_cache, check_vocabulary, configure_adamw


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
        cache: how decoding keeps keys and values (`models.text.decoding`): "dynamic" (a cache that grows by each step),
            "static" (fixed-size buffers, every step the same shapes, replayed as a CUDA graph on a GPU; the
            same translations) or "auto": static on a GPU, where it decoded in 0.30x the time on an H100
            (benchmarks/RESULTS.md, "GPU rows (H100)"), dynamic on the CPU.
        init_from: a Marian (opus-mt) folder written by ``save_pretrained``, or its hub name (resolved when
            online): its config.json sets the architecture (recorded in the hyper-parameters), its weights
            start the training, and the data must use its tokenizer (``data.tokenizer: pretrained``); see
            `models.text.hf`.
    Logged: ``train/loss`` (smoothed), ``val|test/loss`` (NLL per token), ``val|test/ppl``,
    ``val|test/bleu`` and ``val|test/chrf`` (sacreBLEU, detokenized).
    After each evaluation, ``translations`` holds its (source, reference, hypothesis) triples, every
    process's, in dataset order, and ``sacrebleu_signatures`` how the scores were made (for
    `experiments.callbacks.TranslationSamples`).
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
