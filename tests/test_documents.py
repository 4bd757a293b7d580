"""Packed documents (``data.documents: true``): a block of several documents computes, token for token, what each
document computes alone; the store keeps where each document starts; blocks carry each token's document, its place in
it and the ignored target of a document's last token, as computed here by hand or from the text itself."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.documents import IGNORE_INDEX, DocumentBlockDataset
from datamodules.text.token_store import open_array
from models.core.attention_config import AttentionConfig
from models.text.lm import DecoderOnlyLM, document_positions
from models.text.lm_module import LanguageModelModule

VOCAB = 23
LENGTHS = ([5, 1, 7, 3], [2, 9, 5])  # each row's documents, 16 tokens a row


def _packed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens and document ids (2, 16) of the documents of `LENGTHS`."""
    tokens = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    ids = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in LENGTHS])
    return tokens, ids


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi", "t5", "sinusoidal"])
@pytest.mark.parametrize("budget", [16.0, 1e-4], ids=["whole", "chunked"])
def test_a_packed_block_gives_the_loss_and_gradients_of_each_document_alone(positions, budget):
    """Without the document mask the packed sum differs for every kind of position; without the positions restarting at
    each document, for the added ones (learned, sines): RoPE, ALiBi and T5 are relative."""
    torch.manual_seed(0)
    attention = AttentionConfig(memory_budget_mib=budget)  # tiny: the chunked path, never an (L, L) document mask
    model = DecoderOnlyLM(VOCAB, 32, 4, 2, dropout=0.0, positions=positions, max_positions=16, attention=attention)
    tokens, ids = _packed()
    targets = tokens.roll(-1, 1).masked_fill(ids != ids.roll(-1, 1), IGNORE_INDEX)  # -100 at each document's end
    targets[:, -1] = IGNORE_INDEX  # the last document of a row ends with the row here
    logits = model(tokens, document_ids=ids)  # (2, 16, V)
    packed = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    packed.backward()
    packed_grads = _grads(model)

    alone = torch.zeros(())
    for row, lengths in zip(tokens, LENGTHS):
        for doc in row.split(lengths):
            logits = model(doc[None])  # positions from 0, nothing else visible
            alone = alone + F.cross_entropy(logits[0, :-1], doc[1:], reduction="sum")
    alone.backward()
    assert torch.allclose(packed, alone, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(packed_grads, _grads(model), strict=True):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


def test_positions_restart_at_every_change_of_document():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2], [4, 4, 5, 5, 5, 5]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 0, 1, 2, 3]]


def test_given_position_ids_are_used_and_sinks_or_a_cache_are_refused():
    torch.manual_seed(0)
    model = DecoderOnlyLM(VOCAB, 16, 2, 1, dropout=0.0, max_positions=16)
    tokens, ids = _packed()
    derived = model(tokens, document_ids=ids)
    assert torch.equal(model(tokens, document_ids=ids, position_ids=document_positions(ids)), derived)
    assert not torch.allclose(model(tokens, document_ids=ids, position_ids=torch.zeros_like(ids)), derived)
    with pytest.raises(ValueError, match="a cache takes none"):
        model(tokens, cache=model.init_cache(), document_ids=ids)
    sinks = DecoderOnlyLM(VOCAB, 16, 2, 1, max_positions=16, register_tokens=2)
    with pytest.raises(ValueError, match=r"^model.register_tokens=2: .*data.documents=true"):
        sinks(tokens, document_ids=ids)


def test_blocks_carry_document_ids_positions_and_ignored_targets_computed_by_hand():
    """Documents start at tokens 0, 3, 4, 9 and 15 of a stream of 20 tokens; blocks of 8."""
    blocks = DocumentBlockDataset(np.arange(20, dtype=np.uint16), np.array([0, 3, 4, 9, 15]), 8, random_offset=False)
    first, second = blocks[0], blocks[1]
    assert first["input"].tolist() == list(range(8))
    assert first["target"].tolist() == [1, 2, -100, -100, 5, 6, 7, 8]
    assert first["document_ids"].tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert first["position_ids"].tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    # the block starts inside the document of token 4: its part here starts at position 0
    assert second["target"].tolist() == [-100, 10, 11, 12, 13, 14, -100, 16]
    assert second["document_ids"].tolist() == [0, 1, 1, 1, 1, 1, 1, 2]
    assert second["position_ids"].tolist() == [0, 0, 1, 2, 3, 4, 5, 0]


TEXT = "First:\nab cd\n\n\nSecond:\nef\n\nThird:\ngh ij kl\nmn\n\nFourth:\nop qr\n"


def test_a_text_file_stores_its_paragraphs_as_documents_and_the_same_ids(tmp_path):
    """A paragraph and the blank lines after it are one document; the ids are those of the store without documents
    (a char tokenizer: one id per character), in a store of their own."""
    path = tmp_path / "play.txt"
    path.write_text(TEXT)
    settings = dict(cache_dir=str(tmp_path / "cache"), block_size=8, val_fraction=0.25)
    docs = TextCorpusDataModule(str(path), documents=True, **settings)
    plain = TextCorpusDataModule(str(path), **settings)
    assert docs.store[0] != plain.store[0]
    ids = open_array(*docs.store, "corpus.ids")[:]
    assert ids.tolist() == open_array(*plain.store, "corpus.ids")[:].tolist()
    starts = [0] + [m.end() for m in re.finditer(r"\n\n+", TEXT)]
    assert open_array(*docs.store, "corpus.offsets")[:].tolist() == [*starts, len(TEXT)]


def test_records_are_documents_and_validation_blocks_match_the_text(tmp_path):
    """Every record (an empty one too) is a document; a validation block's ids and targets follow from the text."""
    records = ["the cat sat", "", "on the mat and the dog", "ran off fast", "and far away"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    settings = dict(cache_dir=str(tmp_path / "cache"), block_size=10, val_fraction=0.4)
    dm = TextCorpusDataModule(str(path), documents=True, **settings)
    dm.setup("fit")
    text = "".join(r + "\n" for r in records)
    document = np.repeat(np.arange(len(records)), [len(r) + 1 for r in records])  # each character's record
    n_train = int(len(text) * 0.6)
    item, first = dm.val_set[0], n_train
    assert item["input"].tolist() == dm.tokenizer.encode(text[first : first + 10]).ids  # one id per character
    own = document[first : first + 11]
    assert item["document_ids"].tolist() == (own[:-1] - own[0]).tolist()
    assert (item["target"] == IGNORE_INDEX).tolist() == (own[1:] != own[:-1]).tolist()


def test_one_document_in_all_is_refused_in_one_line(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a single paragraph\nwith no blank line\n")
    dm = TextCorpusDataModule(str(path), cache_dir=str(tmp_path / "cache"), block_size=4, documents=True)
    with pytest.raises(
        ValueError, match=r"^data.documents=true: .*one.txt is one document .*set data.documents=false$"
    ):
        dm.setup("fit")
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()]


def test_a_step_of_training_and_validation_runs_on_packed_documents(tmp_path):
    path = tmp_path / "play.txt"
    path.write_text(TEXT * 8)
    dm = TextCorpusDataModule(str(path), cache_dir=str(tmp_path / "cache"), block_size=16, batch_size=2, documents=True)
    model = LanguageModelModule(vocab_size=dm.vocab_size, d_model=16, nhead=2, num_layers=1, max_positions=16)
    trainer = pl.Trainer(
        fast_dev_run=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    trainer.fit(model, dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
