"""Token-budget batches (`data.max_tokens`, fairseq's --max-tokens): the cut against a hand computation and fairseq's
loop, the budget, each pair once an epoch, less padding than batch_size batches of as many tokens, the order as a
function of (seed, epoch), DDP shares, an exact resume, the loss of a budget batch, and the refusals."""

import json
import math
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from builders import tiny_seq2seq
from processes import torchrun, wait_all
from torch.utils.data import DataLoader

from datamodules.text.batching import LengthBucketSampler, collate_pairs
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.text.token_budget import MaxTokensSampler, batch_by_size, batches_in_order
from experiments.callbacks.interrupts import SIGTERM_STATUS, ResumableSampler
from experiments.cli import main
from models.text.seq2seq import label_smoothed_nll_loss, teacher_forcing

ROOT = Path(__file__).resolve().parents[1]
# the DDP processes: the probes below are test_max_tokens.StepLog, one thread each on CI's 2 cores
ENV = {
    "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
    "WANDB_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
}


def fairseq_batch_by_size(lengths, max_tokens, max_sentences=None) -> list[int]:
    """fairseq's data_utils_fast.batch_by_size_vec as a plain loop (bsz_mult 1): the batches' sizes in pairs."""
    sizes, batch, longest = [], 0, 0
    for n in lengths:
        grown = max(longest, n)
        if batch and ((max_sentences and batch + 1 > max_sentences) or (batch + 1) * grown > max_tokens):
            sizes.append(batch)
            batch, grown = 0, n
        batch, longest = batch + 1, grown
    return sizes + [batch] if batch else sizes


def test_the_cut_against_a_hand_computation_and_fairseqs_loop():
    # 3+3+4 -> 3 × 4 = 12 fits, a 5 would make 4 × 5; 5+5 -> 10, a third 5 makes 15; 5 then 9 -> 18; 9 alone
    assert batch_by_size([3, 3, 4, 5, 5, 5, 9], max_tokens=12).tolist() == [0, 3, 5, 6, 7]
    assert batch_by_size([3, 3, 4, 5, 5, 5, 9], 12, max_sentences=2).tolist() == [0, 2, 4, 6, 7]
    assert batch_by_size([2, 6, 1, 1], 12).tolist() == [0, 2, 4]  # unsorted: the longest so far counts, 6 then 6
    # in the order 3, 0, 1, 2 (lengths 2, 5, 1, 9): 2 × 5 fits 10, a third would make 15; then 1, and 9 alone
    assert batches_in_order([3, 0, 1, 2], np.array([5, 1, 9, 2]), 10) == [[3, 0], [1], [2]]
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = rng.integers(1, 40, rng.integers(1, 300))
        budget, cap = int(rng.integers(40, 400)), [None, 7][int(rng.integers(2))]
        for order in (lengths, np.sort(lengths)):
            assert np.diff(batch_by_size(order, budget, cap)).tolist() == fairseq_batch_by_size(order, budget, cap)
    with pytest.raises(ValueError, match="max_tokens=8: a pair of 9 tokens does not fit"):
        batch_by_size([3, 9], 8)


def pair_lengths(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(src, tgt) lengths as batched of ``n`` made-up pairs, spread like Multi30k's (5-60 tokens, the target a bit
    longer and correlated with the source)."""
    rng = np.random.default_rng(seed)
    src = np.clip(rng.lognormal(2.6, 0.4, n).astype(int), 5, 60)
    tgt = np.clip((src * rng.normal(1.1, 0.15, n)).astype(int) + 1, 5, 60)
    return src, tgt


def epoch(sampler, epoch: int, seed: int = 0, replicas: int = 1, rank: int = 0) -> list[list[int]]:
    """One process's batches of one epoch, as `ExactResume` makes every training loader draw them."""
    resumable = ResumableSampler(sampler, num_replicas=replicas, rank=rank, seed=seed)
    resumable.set_epoch(epoch)
    return list(resumable)


def padding(batches: list[list[int]], src: np.ndarray, tgt: np.ndarray) -> tuple[float, float]:
    """(share of padding over both sides, mean padded tokens per step: pairs × the longer side's width)."""
    real = sum(int(src[b].sum() + tgt[b].sum()) for b in batches)
    padded = sum(len(b) * int(src[b].max() + tgt[b].max()) for b in batches)
    steps = [len(b) * int(max(src[b].max(), tgt[b].max())) for b in batches]
    return 1 - real / padded, sum(steps) / len(steps)


def test_every_batch_within_budget_every_pair_once_and_the_same_sizes_each_epoch():
    src, tgt = pair_lengths(2000)
    lengths = np.maximum(src, tgt)
    sampler = MaxTokensSampler(lengths, src, max_tokens=600)
    sizes = sorted(sampler.sizes.tolist())
    for e in range(3):
        batches = epoch(sampler, e)
        assert all(len(b) * lengths[b].max() <= 600 for b in batches)
        assert sorted(i for b in batches for i in b) == list(range(2000))
        assert len(batches) == len(sampler) and sorted(map(len, batches)) == sizes
    capped = MaxTokensSampler(lengths, src, max_tokens=600, max_sentences=20)
    assert max(capped.sizes) == 20 and all(len(b) <= 20 for b in epoch(capped, 0))


def test_less_padding_than_batch_size_batches_of_as_many_tokens_a_step():
    src, tgt = pair_lengths(5000, seed=1)
    lengths = np.maximum(src, tgt)
    torch.manual_seed(0)
    flat = list(LengthBucketSampler(lengths, batch_size=64))
    by_size = [flat[s : s + 64] for s in range(0, len(flat), 64)]
    share, tokens = padding(by_size, src, tgt)
    budget = round(tokens)  # the batch_size recipe's mean tokens a step
    by_tokens = epoch(MaxTokensSampler(lengths, src, budget), 0)
    share_tokens, tokens_tokens = padding(by_tokens, src, tgt)
    assert share_tokens < share / 2  # here 0.054 against 0.143
    assert 0.9 * budget < tokens_tokens <= budget  # about the same tokens a step (the greedy cut leaves some room)


def test_the_order_is_a_function_of_seed_and_epoch_alone():
    src, tgt = pair_lengths(500)
    sampler = MaxTokensSampler(np.maximum(src, tgt), src, max_tokens=300)
    first = epoch(sampler, 1, seed=3)
    torch.rand(5)  # what else drew from the global RNG does not matter
    assert epoch(sampler, 1, seed=3) == first
    assert epoch(sampler, 2, seed=3) != first and epoch(sampler, 1, seed=4) != first
    before = torch.get_rng_state()
    epoch(sampler, 1, seed=3)
    assert torch.equal(torch.get_rng_state(), before)  # dropout's RNG is left as it was


@pytest.mark.parametrize("replicas", [2, 3])
def test_ddp_shares_are_whole_batches_disjoint_and_equal_in_number(replicas):
    src, tgt = pair_lengths(700)
    sampler = MaxTokensSampler(np.maximum(src, tgt), src, max_tokens=400)
    everyone = epoch(sampler, 2, seed=5)  # the epoch's list of batches, which the processes share
    shares = [epoch(sampler, 2, seed=5, replicas=replicas, rank=r) for r in range(replicas)]
    per_rank = math.ceil(len(everyone) / replicas)
    assert [len(s) for s in shares] == [per_rank] * replicas
    padded = everyone + everyone[: per_rank * replicas - len(everyone)]  # DistributedSampler's padding
    assert shares == [padded[r::replicas] for r in range(replicas)]
    dealt = sorted(tuple(b) for s in shares for b in s)
    assert sorted(set(dealt)) == sorted(tuple(b) for b in everyone)  # whole batches, none split or lost
    assert len(dealt) - len(set(dealt)) == len(padded) - len(everyone)  # repeated: the padding only


def test_a_resumed_epoch_continues_with_the_batches_it_had_left():
    src, tgt = pair_lengths(600)
    sampler = MaxTokensSampler(np.maximum(src, tgt), src, max_tokens=400)
    for replicas in (1, 2):
        whole = epoch(sampler, 1, seed=2, replicas=replicas, rank=replicas - 1)
        resumed = ResumableSampler(sampler, num_replicas=replicas, rank=replicas - 1, seed=2)
        resumed.resume(1, skip=4)
        resumed.set_epoch(1)  # Lightning sets the epoch again before iterating
        assert list(resumed) == whole[4:]
        resumed.set_epoch(2)
        assert list(resumed) == epoch(sampler, 2, seed=2, replicas=replicas, rank=replicas - 1)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The embedded toy corpus by word as configs/text/toy_en_de.yaml reads it, in batches of at most 200 tokens."""
    cache = tmp_path_factory.mktemp("data")
    words = dict(tokenizer="word", vocab_size=1000, min_frequency=1, max_len=64)
    dm = ParallelTextDataModule(cache_dir=str(cache), **words, batch_size=None, max_tokens=200)
    dm.setup("fit")
    return dm


def test_the_loaders_batches_hold_at_most_max_tokens_as_collated(toy):
    for loader in (toy.train_dataloader(), toy.val_dataloader()):
        seen = []
        for batch in loader:
            assert len(batch["index"]) * max(batch["src"].shape[1], batch["tgt"].shape[1]) <= 200
            seen += batch["index"].tolist()
        assert sorted(seen) == list(range(len(loader.dataset)))
    val = [b["src"].ne(0).sum(1) for b in toy.val_dataloader()]
    assert torch.cat(val).diff().ge(0).all()  # evaluation batches keep their order: sorted by source length


def test_a_budget_batch_has_the_loss_and_gradients_of_the_same_pairs_as_a_plain_batch_and_alone(toy):
    """The pairs of one budget batch: through the max_tokens loader, collated as a plain batch_size batch, and each
    pair alone (no padding) weighted by its target tokens give one loss and one gradient (fp32, 1e-5)."""
    vocab = toy.src_vocab_size
    model = tiny_seq2seq(vocab, max_positions=64)
    packed = max(toy.train_dataloader(), key=lambda b: len(b["index"]))  # the most pairs, so the most padding
    pairs = [toy.train_set[i] for i in packed["index"].tolist()]
    plain = next(iter(DataLoader(pairs, batch_size=len(pairs), collate_fn=collate_pairs)))

    def loss_and_grads(batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        decoder_input, labels = teacher_forcing(batch["tgt"])  # (B, T-1) each
        loss, _ = label_smoothed_nll_loss(model(batch["src"], decoder_input), labels, 0.1, 0)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads(packed)
    plain_loss, plain_grads = loss_and_grads(plain)
    assert torch.equal(packed["src"], plain["src"]) and torch.equal(packed["tgt"], plain["tgt"])
    assert torch.allclose(loss, plain_loss, atol=1e-5)
    assert all(torch.allclose(g, h, atol=1e-5) for g, h in zip(grads, plain_grads))
    weights = [len(p["tgt"]) - 1 for p in pairs]  # the tokens each pair predicts
    alone = [loss_and_grads(collate_pairs([p])) for p in pairs]
    assert torch.allclose(loss, sum(w * a[0] for w, a in zip(weights, alone)) / sum(weights), atol=1e-5)
    for k, g in enumerate(grads):
        assert torch.allclose(g, sum(w * a[1][k] for w, a in zip(weights, alone)) / sum(weights), atol=1e-5)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_tokens": 0}, "data.max_tokens=0 must be >= 1 (padded tokens a batch holds), or null"),
        ({"batch_size": None}, "data.batch_size=null needs data.max_tokens"),
        ({"max_tokens": 200, "bucket": False}, "data.bucket=false contradicts data.max_tokens"),
        (
            {"max_tokens": 4096, "batch_size": 32, "max_len": 128},
            "data.max_tokens=4096 never bounds a batch: data.batch_size=32 pairs of at most data.max_len=128 tokens "
            "hold 4096; set data.batch_size: null",
        ),
    ],
)
def test_contradicting_batch_bounds_are_one_line_before_any_work(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelTextDataModule(cache_dir=str(tmp_path), **settings)
    assert not (tmp_path / "tokens").exists()


def test_a_pair_longer_than_the_budget_is_one_line_naming_its_length(toy):
    longest = int(toy.train_set.lengths().max())
    toy.hparams.max_tokens = longest - 1
    try:
        with pytest.raises(ValueError) as error:
            toy.train_dataloader()
    finally:
        toy.hparams.max_tokens = 200
    assert str(error.value) == (
        f"data.max_tokens={longest - 1} is less than the {longest} tokens of the longest training pair (BOS/EOS "
        f"included, as batched); set data.max_tokens >= {longest}, or data.max_len <= {longest - 1} to cut longer "
        "sentences"
    )


def test_a_batch_size_that_closes_most_batches_warns(toy):
    toy.hparams.batch_size = 5
    try:
        with pytest.warns(UserWarning, match=r"data.batch_size=5 closes 100% of the training batches before "):
            batches = list(toy.train_dataloader())
    finally:
        toy.hparams.batch_size = None
    assert max(len(b["index"]) for b in batches) == 5


def test_prediction_batches_keep_the_input_order(tmp_path, toy):
    lines = tmp_path / "in.en"
    lines.write_text("A dog sleeps.\n" * 30 + "Two red cats see a ball in the park.\n" * 30)
    toy.hparams.predict_file = str(lines)
    toy.setup("predict")
    texts = [t for b in toy.predict_dataloader() for t in b["src_text"]]
    assert texts == lines.read_text().splitlines()
    assert all(len(b["index"]) * b["src"].shape[1] <= 200 for b in toy.predict_dataloader())


class StepLog(pl.Callback):
    """Append each training step's epoch, pairs (their indices) and loss to ``folder``/steps{rank}.jsonl."""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = {"step": trainer.global_step, "epoch": trainer.current_epoch, "index": batch["index"].tolist()}
        with open(Path(self.folder) / f"steps{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(step | {"loss": float(outputs["loss"])}) + "\n")


def steps(root: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (root / f"steps{rank}.jsonl").read_text().splitlines()]


class SigtermAtBatch(pl.Callback):
    """Send this process a SIGTERM at the start of training batch ``batch`` of the fit (counted across epochs)."""

    def __init__(self, batch: int):
        self.batch = batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.batch:
            signal.raise_signal(signal.SIGTERM)


def probe(cls: type, **init_args) -> str:
    return f"--trainer.callbacks+={json.dumps({'class_path': f'{__name__}.{cls.__name__}', 'init_args': init_args})}"


def budget_fit(root: Path, cache: Path, *args: str) -> list[str]:
    """A tiny translation fit on the toy corpus in budget batches of 200 tokens: 2 epochs of 6 steps, dropout on,
    no validation."""
    root.mkdir(parents=True, exist_ok=True)
    return [
        "fit",
        "--config",
        "configs/text/toy_en_de.yaml",
        f"--trainer.default_root_dir={root}",
        f"--data.init_args.cache_dir={cache}",
        "--data.init_args.batch_size=null",
        "--data.init_args.max_tokens=200",
        "--trainer.max_epochs=2",
        "--trainer.limit_train_batches=6",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
        "--trainer.accelerator=cpu",
        "--model.init_args.d_model=16",
        "--model.init_args.dim_feedforward=32",
        "--model.init_args.nhead=2",
        probe(StepLog, folder=str(root)),
        *args,
    ]


@pytest.mark.slow
def test_a_budget_fit_stopped_mid_epoch_resumes_to_the_batches_and_losses_of_an_uninterrupted_one(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(ROOT)
    cache = tmp_path / "data"
    main(budget_fit(tmp_path / "reference", cache))
    run = tmp_path / "run"
    argv = budget_fit(run, cache, probe(SigtermAtBatch, batch=8))  # the third batch of the second epoch
    monkeypatch.setattr(sys, "argv", ["attnlab", *argv])
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == SIGTERM_STATUS, capsys.readouterr().err[-3000:]
    main(budget_fit(run, cache, "--ckpt_path", "last"))
    ours, theirs = steps(run), steps(tmp_path / "reference")
    assert [s["step"] for s in ours] == [s["step"] for s in theirs] == list(range(1, 13))  # resumed at step 9
    assert [s["index"] for s in ours] == [s["index"] for s in theirs]  # the rest of epoch 2, not a new shuffle
    # the same weights and dropout masks: the same losses (bitwise on this CPU; 1e-6 leaves a BLAS some room)
    assert [s["loss"] for s in ours] == pytest.approx([s["loss"] for s in theirs], abs=1e-6)
    assert len({tuple(s["index"]) for s in theirs}) == 12  # distinct batches: epoch 2 is not epoch 1 again


@pytest.mark.slow
def test_two_ddp_processes_train_disjoint_budget_batches_as_many_each(tmp_path, toy):
    """Two CPU processes (gloo) over one epoch of the toy corpus in batches of 1,000 tokens: each trains as many
    steps, their batches are whole batches of one list, every pair trained once but for the padding batch, each
    batch within the budget; validation (Lightning shares its list of batches out) runs too."""
    root, env = tmp_path / "run", {**os.environ, **ENV}
    ddp = ("--trainer.strategy=ddp", "--trainer.devices=2", "--data.init_args.max_tokens=1000")
    whole_epoch = ("--trainer.max_epochs=1", "--trainer.limit_train_batches=1.0", "--trainer.limit_val_batches=2")
    ranks = torchrun(budget_fit(root, tmp_path / "data", *ddp, *whole_epoch), env, tmp_path / "logs")
    assert wait_all(ranks, timeout=300) == [0, 0], "".join(r.stderr()[-3000:] for r in ranks)
    shares = [[s["index"] for s in steps(root, rank)] for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1])
    batches = [tuple(b) for share in shares for b in share]
    pairs = [i for b in set(batches) for i in b]
    assert sorted(pairs) == list(range(3000))  # every pair once over the distinct batches, none split
    assert len(batches) == 2 * math.ceil(len(set(batches)) / 2)  # repeated: the padding batch alone, if any
    lengths = toy.train_set.lengths()  # the pairs as the run batched them
    assert all(len(b) * lengths[list(b)].max() <= 1000 for b in batches)
