"""The token store in real runs of the CLI (a language model on a JSON-lines corpus, BPE): two DDP processes
prepare it once and each reads its share; a fit killed mid-epoch (SIGKILL) and resumed with ``--ckpt_path last``
trains the batches, and reaches the weights, of a fit that never stopped (`experiments.callbacks.ExactResume`
over the store's map-style datasets)."""

import json
import os
import re
import signal
import uuid
from pathlib import Path

import pytest
import pytorch_lightning as pl
from processes import CLIProcess, torchrun, wait_all
from test_interrupts import ENV, EVERY_3_STEPS, KillAt, load, probe

from datamodules.text.toy import toy_translation_pairs
from experiments.cli import main

pytestmark = pytest.mark.slow  # CLI runs, in processes of their own
STEPS = 15  # 3 epochs of 5 batches
LM = (
    "--config",
    "configs/text/shakespeare_char_cpu.yaml",
    "--trainer.max_time=null",  # its schedule would follow the clock
    f"--trainer.max_steps={STEPS}",
    "--trainer.max_epochs=3",
    "--trainer.limit_train_batches=5",
    "--trainer.limit_val_batches=2",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.check_val_every_n_epoch=1",
    "--trainer.logger=false",
    "--trainer.accelerator=cpu",
    "--trainer.precision=32-true",
    "--trainer.callbacks=[]",  # the config's samples and predictions cost time; the checkpoint comes next
    "--trainer.callbacks+={class_path: pytorch_lightning.callbacks.ModelCheckpoint, init_args: {save_last: true}}",
    EVERY_3_STEPS,
    "--model.init_args.d_model=32",
    "--model.init_args.nhead=2",
    "--model.init_args.num_layers=1",
    "--model.init_args.max_positions=16",
    "--model.init_args.dropout=0.1",  # a resumed run must restore the random streams
    "--model.init_args.warmup_steps=2",
    "--data.init_args.tokenizer=bpe",
    "--data.init_args.bpe_vocab_size=120",
    "--data.init_args.block_size=16",
    "--data.init_args.batch_size=8",
)


class TokenBatchLog(pl.Callback):
    """Append each training batch's fit (an id per run of the CLI), process, step and first tokens to a JSON-lines
    file, and at the start of training the process's sampler: its share of the data."""

    def __init__(self, path: str):
        self.path, self.fit = path, uuid.uuid4().hex

    def write(self, **record) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"fit": self.fit, **record}) + "\n")

    def on_train_start(self, trainer, pl_module):
        sampler = trainer.train_dataloader.sampler
        self.write(rank=trainer.global_rank, replicas=sampler.num_replicas, share=sampler.rank, size=len(sampler))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.write(rank=trainer.global_rank, step=trainer.global_step, tokens=batch["input"][:, :6].tolist())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for en, de in toy_translation_pairs(800, seed=5):
            f.write(json.dumps({"text": f"{en} {de}"}) + "\n")
    return path


def lm_args(root: Path, corpus: Path, cache: Path, *args: str) -> list[str]:
    log = json.dumps({"class_path": f"{__name__}.TokenBatchLog", "init_args": {"path": str(root / "batches.jsonl")}})
    return [
        "fit",
        *LM,
        f"--trainer.default_root_dir={root}",
        f"--data.init_args.path={corpus}",
        f"--data.init_args.cache_dir={cache}",
        f"--trainer.callbacks+={log}",
        *args,
    ]


def environment() -> dict[str, str]:
    return {**os.environ, **ENV}  # tests/ on the path: this module's TokenBatchLog, test_interrupts.KillAt


def records(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "batches.jsonl").read_text().splitlines()]


def test_two_ddp_processes_prepare_the_store_once_and_each_reads_its_share(corpus, tmp_path):
    cache, root = tmp_path / "cache", tmp_path / "run"
    ddp = ("--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.max_epochs=1", "--trainer.max_steps=5")
    ranks = torchrun(lm_args(root, corpus, cache, *ddp), environment(), tmp_path / "logs")
    codes = wait_all(ranks, timeout=300)
    err = "".join(rank.stderr() for rank in ranks)
    assert codes == [0, 0], err[-3000:]
    prepared = re.findall(r"^attnlab: token store (\S+): ", err, re.M)
    assert len(prepared) == 1, err[-3000:]  # one process prepared; the other waited for it, or found it made
    assert [p.name for p in (cache / "tokens").iterdir()] == [Path(prepared[0]).name]  # no other, no temporary
    starts = sorted((r["rank"], r["replicas"], r["share"], r["size"]) for r in records(root) if "share" in r)
    assert [s[:3] for s in starts] == [(0, 2, 0), (1, 2, 1)] and starts[0][3] == starts[1][3]  # half each
    batches = {r["rank"]: r["tokens"] for r in records(root) if r.get("step") == 0}
    assert batches[0] != batches[1]


def test_sigkill_mid_epoch_then_resume_from_the_store_matches_an_uninterrupted_run(corpus, tmp_path, capsys):
    cache, reference, run = tmp_path / "cache", tmp_path / "reference", tmp_path / "run"
    main(lm_args(reference, corpus, cache))  # prepares the store
    assert "attnlab: token store" in capsys.readouterr().err
    job = CLIProcess(lm_args(run, corpus, cache, probe(KillAt, step=8)), environment(), tmp_path / "logs")
    assert job.wait(timeout=300) == -signal.SIGKILL, job.stderr()[-3000:]
    saved = load(run / "checkpoints" / "last.ckpt")
    batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    assert saved["global_step"] == 6 and saved["epoch"] == 1 and batches["ready"] == 1  # one batch into epoch 2

    main(lm_args(run, corpus, cache, "--ckpt_path", "last"))
    assert "attnlab: token store" not in job.stderr() + capsys.readouterr().err  # both mapped the reference's store
    log, theirs = [r for r in records(run) if "step" in r], [r for r in records(reference) if "step" in r]
    assert [r["step"] for r in log if r["fit"] != log[0]["fit"]] == list(range(6, STEPS))
    assert {r["step"]: r["tokens"] for r in log} == {r["step"]: r["tokens"] for r in theirs}  # the same batches
    ours, theirs = load(run / "checkpoints" / "last.ckpt"), load(reference / "checkpoints" / "last.ckpt")
    assert ours["global_step"] == theirs["global_step"] == STEPS
    worst = max((ours["state_dict"][k] - theirs["state_dict"][k]).abs().max().item() for k in theirs["state_dict"])
    assert worst <= 1e-6
