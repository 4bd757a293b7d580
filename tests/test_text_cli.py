"""The real `attnlab` CLI on the embedded toy corpus: translation fit/test/predict, the LM, bad input."""

import csv
import io
import json
import re
import sys

import pytest
import torch
from conftest import LM_SMALL, config_args
from tokenizers import Tokenizer

TOY = "configs/text/toy_en_de.yaml"
LM = "configs/text/shakespeare_char_cpu.yaml"


def metric(run, key):
    return [float(r[key]) for r in csv.DictReader((run / "metrics.csv").open()) if r.get(key)]


@pytest.mark.slow
def test_translation_fit_test_predict(attnlab, tmp_path, monkeypatch):
    toy = config_args(TOY, tmp_path, f"--data.init_args.cache_dir={tmp_path / 'data'}")
    code, out, err = attnlab("fit", *toy, "--trainer.max_epochs=3", "--trainer.limit_val_batches=2")
    assert code == 0, err
    run = tmp_path / "lightning_logs" / "version_0"
    bleu = metric(run, "val/bleu")
    assert len(bleu) == 3 and bleu[-1] > 20 > bleu[0], bleu  # it learns to translate
    assert "sacreBLEU signatures: nrefs:1|case:mixed|eff:no|tok:13a" in out
    assert "| source | reference | hypothesis |" in (run / "val_samples.md").read_text()
    saved = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).to_str()  # beside the checkpoints, and inside them
    assert (
        torch.load(run / "checkpoints" / "best.ckpt", weights_only=False)["ParallelTextDataModule"]["tokenizers"][
            "tokenizer"
        ]
        == saved
    )

    code, out, err = attnlab("test", *toy, "--ckpt_path", "best", "--trainer.limit_test_batches=2")
    assert code == 0, err
    assert "test/bleu" in out and "best.ckpt" in err

    sentences = tmp_path / "in.en"
    sentences.write_text("A dog sleeps in the park.\n\nTwo cats see a red ball.\n")
    code, out, err = attnlab("predict", *toy, "--ckpt_path", "best", f"--data.init_args.predict_file={sentences}")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rows] == ["A dog sleeps in the park.", "", "Two cats see a red ball."] and rows[1][
        "translation"
    ] == ""
    assert all(r["translation"] in out for r in rows)  # printed too, one per line

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"A cat sits.\n")))
    code, out, err = attnlab("predict", *toy, "--ckpt_path", "best", "--data.init_args.predict_file=-")
    assert code == 0, err
    assert json.loads((tmp_path / "predictions.jsonl").read_text())["source"] == "A cat sits."

    other_vocab = ("--data.init_args.tokenizer=bpe", "--data.init_args.vocab_size=90")
    code, _, err = attnlab("test", *toy, "--ckpt_path", "best", *other_vocab)
    assert code == 2
    assert re.search(
        r"attnlab: error: --ckpt_path \S+/best.ckpt holds a models.text.TranslationModule of src_vocab_size=\d+, "
        r"tgt_vocab_size=\d+; this config's data gives src_vocab_size=90, tgt_vocab_size=90",
        err,
    )


@pytest.mark.slow
def test_language_model_fit_and_complete_a_prompt(attnlab, tmp_path):
    cache = f"--data.init_args.cache_dir={tmp_path / 'data'}"
    args = config_args(LM, tmp_path, cache, "--data.init_args.path=null", *LM_SMALL)
    code, out, err = attnlab("fit", *args, "--trainer.max_steps=40", "--trainer.val_check_interval=20")
    assert code == 0, err
    loss = metric(tmp_path / "lightning_logs" / "version_0", "val/loss")
    assert len(loss) == 2 and loss[1] < loss[0] < 4.0  # below log(vocabulary) ≈ 4.2 after 20 steps
    samples = (
        tmp_path / "lightning_logs" / "version_0" / "val_samples.md"
    ).read_text()  # LanguageModelSamples, at each validation
    assert "| step | sample |" in samples and samples.count("### epoch") == 2
    code, out, err = attnlab(
        "predict",
        *args,
        "--ckpt_path",
        "best",
        "--data.init_args.prompt=Two dogs",
        "--model.init_args.max_new_tokens=20",
    )
    assert code == 0, err
    completion = json.loads((tmp_path / "predictions.jsonl").read_text())["completion"]
    assert completion.startswith("Two dogs") and len(completion) == len("Two dogs") + 20 and completion in out


def test_parallel_files_of_different_lengths_fail_with_one_line(attnlab, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split, german in (("train", "Ein Hund.\nEine Katze.\nEin Vogel.\n"), ("val", "Ein Hund.\nEine Katze.\n")):
        (data / f"{split}.en").write_text("A dog.\nA cat.\n")
        (data / f"{split}.de").write_text(german)
    code, _, err = attnlab(
        "fit", *config_args(TOY, tmp_path, f"--data.init_args.data_dir={data}", "--data.init_args.test_split=null")
    )
    lines = [line for line in err.splitlines() if line.startswith("attnlab: error:")]
    assert code == 2 and len(lines) == 1, err
    assert f"{data}/train.en has 2 lines but {data}/train.de has 3" in lines[0]
