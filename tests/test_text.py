"""Text modality: masks, teacher forcing, label smoothing, tokenizers, decoding, data errors."""

import itertools
import math
import os

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from builders import padded_batch, tiny_lm, tiny_seq2seq

from datamodules.checks import read_lines
from datamodules.text.batching import LengthBucketSampler, collate_pairs
from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.text.tokenizers import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, build_tokenizer
from datamodules.text.toy import TOY_SPLITS, toy_translation_pairs, write_toy_corpus
from models.core.attention import AttentionConfig
from models.core.capture import capture_attention
from models.optim import param_groups
from models.text.decoding import beam_search, greedy_decode, length_penalty
from models.text.lm import DecoderOnlyLM
from models.text.seq2seq import Seq2SeqTransformer, label_smoothed_nll_loss, teacher_forcing
from models.text.training import check_vocabulary

V = 24
IDS = dict(bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID)


# ----------------------------------------------------------------------------- model


def test_shapes_and_tied_shared_embeddings():
    model = tiny_seq2seq(V, share_embeddings=True)
    src, tgt = padded_batch(V, [5, 3]), padded_batch(V, [4, 6], seed=2)
    assert model(src, tgt).shape == (2, 6, V)
    assert model.encode(src).shape == (2, 5, 32)
    assert model.src_embed is model.tgt_embed and model.generator.weight is model.tgt_embed.weight
    with pytest.raises(
        ValueError, match="share_embeddings=true needs one vocabulary.*src_vocab_size=10 and tgt_vocab_size=12"
    ):
        Seq2SeqTransformer(10, 12, d_model=8, nhead=2, share_embeddings=True)
    for network, args in ((Seq2SeqTransformer, (10, 10)), (DecoderOnlyLM, (10,))):
        with pytest.raises(ValueError, match=r"model.nhead=4 does not divide model.d_model=30; choose a divisor of 30"):
            network(*args, d_model=30, nhead=4)
    lm = DecoderOnlyLM(V, d_model=32, nhead=4, num_layers=2, max_positions=16)
    assert lm(padded_batch(V, [7, 7])).shape == (2, 7, V) and lm.lm_head.weight is lm.tok_embed.weight


def test_embeddings_are_scaled_by_sqrt_d_model():
    model = tiny_seq2seq(V)
    tokens = torch.tensor([[5, 6]])
    torch.testing.assert_close(model.src_embed(tokens), model.src_embed.weight[tokens] * math.sqrt(32))
    lm = DecoderOnlyLM(V, d_model=64, nhead=4, num_layers=1, scale_embeddings=True)
    torch.testing.assert_close(lm.tok_embed(tokens), lm.tok_embed.weight[tokens] * 8.0)
    assert lm.lm_head.weight is lm.tok_embed.weight and 0.1 < lm.tok_embed.weight.std() < 0.15  # N(0, 64^-1/2)
    assert DecoderOnlyLM(V, d_model=64, nhead=4, num_layers=1).tok_embed.scale == 1.0  # GPT-2: unscaled by default


def test_no_position_attends_to_padding_or_to_the_future():
    model = tiny_seq2seq(V)
    src, tgt = padded_batch(V, [6, 3]), padded_batch(V, [5, 2], seed=2)
    with capture_attention(model) as maps:
        model(src, tgt)
    src_pad, tgt_pad = src.eq(PAD_ID), tgt.eq(PAD_ID)
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for name, weights in maps.items():
        w = weights[0]  # (B, H, Lq, Lk)
        if name.startswith("encoder"):
            blocked = src_pad[:, None, None, :].expand_as(w)
        elif "multihead_attn" in name:  # encoder-decoder attention: keys are the encoder memory
            blocked = src_pad[:, None, None, :].expand_as(w)
        else:  # masked decoder self-attention
            blocked = (tgt_pad[:, None, None, :] | future).expand_as(w)
        assert w[blocked].abs().max() == 0, name
        torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))  # every query still attends somewhere


def test_outputs_ignore_padding_content_and_future_tokens():
    model = tiny_seq2seq(V)
    src, tgt = padded_batch(V, [6, 3]), padded_batch(V, [5, 5], seed=2)
    logits = model(src, tgt)
    mask, garbage = src.eq(PAD_ID), src.clone()
    garbage[1, 3:] = 7  # other tokens where the source is padding: the key padding mask hides them
    torch.testing.assert_close(model.decode(tgt, model.encode(garbage, mask), mask, tgt.eq(PAD_ID)), logits)
    tgt2 = tgt.clone()
    tgt2[:, 3:] = 9  # change the future: earlier positions must not see it
    torch.testing.assert_close(model(src, tgt2)[:, :3], logits[:, :3])


def test_attention_and_activation_dropout_refine_dropout():
    """fairseq's split: ``dropout`` stays on the residual branches, the attention weights and the MLP's
    inner activations take their own rate when given and ``dropout``'s when not."""

    def rates(layers):  # (residual, attention weights, MLP inner) rates of every layer
        return {
            (
                layer.dropout1.p,
                *{a.dropout for a in (layer.self_attn, getattr(layer, "multihead_attn", layer.self_attn))},
                layer.dropout.p,
            )
            for layer in layers
        }

    split = tiny_seq2seq(V, dropout=0.3, attn_dropout=0.0, activation_dropout=0.1)
    assert rates([*split.encoder.layers, *split.decoder.layers]) == {(0.3, 0.0, 0.1)}
    assert rates(tiny_seq2seq(V, dropout=0.3).decoder.layers) == {(0.3, 0.3, 0.3)}
    lm = DecoderOnlyLM(V, d_model=32, nhead=4, num_layers=2, dropout=0.2, attn_dropout=0.0, activation_dropout=0.0)
    assert rates(lm.blocks.layers) == {(0.2, 0.0, 0.0)}
    # in training, a model whose only dropout is on the attention weights is random, one without is not
    src, tgt = padded_batch(V, [5, 3]), padded_batch(V, [4, 6], seed=2)
    for attn_dropout, random in ((0.5, True), (0.0, False)):
        model = tiny_seq2seq(V, dropout=0.0, attn_dropout=attn_dropout).train()
        assert (not torch.equal(model(src, tgt), model(src, tgt))) == random


def test_teacher_forcing_feeds_the_target_shifted_right():
    tgt = torch.tensor([[BOS_ID, 7, 8, 9, EOS_ID], [BOS_ID, 5, EOS_ID, PAD_ID, PAD_ID]])
    decoder_input, labels = teacher_forcing(tgt)
    assert decoder_input.tolist() == [[BOS_ID, 7, 8, 9], [BOS_ID, 5, EOS_ID, PAD_ID]]
    assert labels.tolist() == [[7, 8, 9, EOS_ID], [5, EOS_ID, PAD_ID, PAD_ID]]


def test_label_smoothing_against_a_hand_computation():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0], [1.0, 2.0, 3.0, 4.0]]])  # (1, 3, V=4)
    target = torch.tensor([[1, 2, 0]])  # the last position is PAD (= class 0): it counts for nothing
    eps = 0.1
    expected = []
    for row, t in zip(logits[0, :2], (1, 2)):
        logp = row.log_softmax(-1)
        q = torch.tensor([0.0, eps / 3, eps / 3, eps / 3])  # uniform over the 3 non-PAD classes, none on PAD
        q[t] += 1 - eps
        expected.append(-(q * logp).sum())
    loss, nll = label_smoothed_nll_loss(logits, target, eps, ignore_index=0)
    assert loss.item() == pytest.approx(sum(expected).item() / 2, abs=1e-6)
    assert nll.item() == pytest.approx(F.cross_entropy(logits[0, :2], target[0, :2]).item(), abs=1e-6)
    assert label_smoothed_nll_loss(logits, target, 0.0, 0)[0].item() == pytest.approx(nll.item(), abs=1e-6)


def test_weight_decay_only_on_matrices_not_embeddings():
    model = tiny_seq2seq(V, positions="learned")
    decay, no_decay = param_groups(model, 0.1, model.no_weight_decay())
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert id(model.tgt_embed.weight) in ids(no_decay) and id(model.pos.weight) in ids(no_decay)
    assert id(model.encoder.layers[0].linear1.weight) in ids(decay) and id(model.encoder.layers[0].linear1.bias) in ids(
        no_decay
    )


# ----------------------------------------------------------------------------- decoding


def test_cached_decoding_equals_uncached_decoding():
    model = tiny_seq2seq(V)
    src = padded_batch(V, [6, 4, 2])
    memory, mask = model.encode(src), src.eq(PAD_ID)
    tgt = torch.cat([torch.full((3, 1), BOS_ID), padded_batch(V, [7, 7, 7], seed=3)], dim=1)  # (3, 8)
    full = model.decode(tgt, memory, mask)
    cache = model.init_cache()
    steps = torch.cat(
        [model.decode(tgt[:, t : t + 1], memory, mask, cache=cache, start_pos=t) for t in range(8)], dim=1
    )
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)
    cached, cached_scores = greedy_decode(model, src, max_len=12, **IDS)
    uncached, uncached_scores = greedy_decode(model, src, max_len=12, use_cache=False, **IDS)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(cached_scores, uncached_scores)


def test_lm_generation_with_cache_equals_without_even_past_the_context():
    torch.manual_seed(0)
    lm = DecoderOnlyLM(V, d_model=32, nhead=4, num_layers=2, dropout=0.0, max_positions=8).eval()
    prompt = padded_batch(V, [3, 3])
    fast = lm.generate(prompt, 12, temperature=0)  # 15 tokens > 8 positions: the window slides
    slow = lm.generate(prompt, 12, temperature=0, use_cache=False)
    assert fast.shape == (2, 15) and torch.equal(fast, slow)
    assert torch.equal(lm.generate(prompt, 5, temperature=1.0, top_k=1), fast[:, :8])  # top-1 sampling is greedy


IN_ATTENTION = ["rope", "alibi", "t5"]


@pytest.mark.parametrize("positions,qk_norm", [("rope", None), ("alibi", "rmsnorm"), ("t5", "layernorm")])
def test_positions_inside_attention_decode_with_the_cache_as_without(positions, qk_norm):
    model = tiny_seq2seq(
        V, d_model=24, nhead=3, positions=positions, attention=AttentionConfig(qk_norm=qk_norm), seed=11
    )  # head size 8
    assert model.pos is None
    src = padded_batch(V, [5, 3, 6], seed=12)
    memory, mask = model.encode(src), src.eq(PAD_ID)
    tgt = torch.cat([torch.full((3, 1), BOS_ID), padded_batch(V, [6, 6, 6], seed=13)], dim=1)  # (3, 7)
    full = model.decode(tgt, memory, mask)
    cache = model.init_cache()
    steps = [model.decode(tgt[:, t : t + 1], memory, mask, cache=cache, start_pos=t) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    cached, cached_scores = greedy_decode(model, src, max_len=9, **IDS)
    uncached, uncached_scores = greedy_decode(model, src, max_len=9, use_cache=False, **IDS)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(cached_scores, uncached_scores)
    batched, _ = beam_search(model, src, max_len=7, beam_size=2, **IDS)  # reordered caches, shared memory
    alone, _ = beam_search(model, src[1:2, :3], max_len=7, beam_size=2, **IDS)
    assert torch.equal(batched[1, : alone.size(1)], alone[0])


@pytest.mark.parametrize("positions", IN_ATTENTION)
def test_lm_with_positions_inside_attention_generates_with_the_cache_as_without(positions):
    lm = tiny_lm(V, positions, max_positions=6)
    prompt = padded_batch(V, [4, 4], seed=5)
    fast = lm.generate(prompt, 7, temperature=0)  # 11 tokens > 6 positions: the window slides
    assert torch.equal(fast, lm.generate(prompt, 7, temperature=0, use_cache=False))


@pytest.mark.parametrize("positions", IN_ATTENTION)
def test_positions_inside_attention_make_the_encoder_see_order(positions):
    model = tiny_seq2seq(V, d_model=24, nhead=3, positions=positions, seed=14)
    src = padded_batch(V, [6], seed=15)
    order = torch.tensor([2, 1, 0, 3, 4, 5])
    # without positions an encoder is permutation-equivariant; with them, the shuffled sentence reads differently
    assert not torch.allclose(model.encode(src[:, order]), model.encode(src)[:, order], atol=1e-4)
    # ALiBi's encoder bias -m·|i - j| is symmetric: it tells near from far, not left from right
    reversal_equivariant = torch.allclose(model.encode(src.flip(1)), model.encode(src).flip(1), atol=1e-5)
    assert reversal_equivariant == (positions == "alibi")


def test_t5_tables_are_one_per_stack_and_not_decayed():
    model = tiny_seq2seq(V, d_model=24, nhead=3, positions="t5")
    tables = [n for n, _ in model.named_parameters() if "relative_attention_bias" in n]
    assert tables == [
        "encoder_positions.bias.relative_attention_bias.weight",
        "decoder_positions.bias.relative_attention_bias.weight",
    ]
    assert model.encoder_positions.bias.bidirectional and not model.decoder_positions.bias.bidirectional
    _, no_decay = param_groups(model, 0.1, model.no_weight_decay())
    assert id(model.encoder_positions.bias.relative_attention_bias.weight) in {id(p) for p in no_decay["params"]}


def test_position_and_qk_norm_keys_are_refused_with_their_names():
    with pytest.raises(ValueError, match="model.positions='rotary' is not known; choose one of .*rope, alibi, t5"):
        tiny_seq2seq(V, positions="rotary")
    with pytest.raises(ValueError, match=r"model.positions=rope needs an even head size, .* = 5"):
        DecoderOnlyLM(V, d_model=15, nhead=3, positions="rope")
    with pytest.raises(ValueError, match="qk_norm='l2' is not known"):
        DecoderOnlyLM(V, d_model=16, nhead=2, attention=AttentionConfig(qk_norm="l2"))


def test_beam_of_one_is_greedy():
    model = tiny_seq2seq(V, seed=3)
    src = padded_batch(V, [7, 5, 3, 6], seed=4)
    greedy, _ = greedy_decode(model, src, max_len=10, **IDS)
    beam, _ = beam_search(model, src, max_len=10, beam_size=1, **IDS)
    assert torch.equal(beam, greedy)


def test_batched_beam_search_equals_one_sentence_at_a_time():
    model = tiny_seq2seq(V, seed=5)
    src = padded_batch(V, [7, 2, 5, 4], seed=6)
    batched, batched_scores = beam_search(model, src, max_len=9, beam_size=3, alpha=0.6, **IDS)
    for i in range(len(src)):
        alone = src[i : i + 1, : int(src[i].ne(PAD_ID).sum())]
        tokens, score = beam_search(model, alone, max_len=9, beam_size=3, alpha=0.6, **IDS)
        n = tokens.size(1)
        assert torch.equal(batched[i, :n], tokens[0]) and batched[i, n:].eq(PAD_ID).all()
        assert batched_scores[i].item() == pytest.approx(score.item(), abs=1e-4)


def test_beam_search_finds_the_exact_best_when_the_beam_holds_every_prefix():
    vocab, max_len = 8, 3  # next tokens: EOS, UNK and 4..7 (PAD and BOS are never generated)
    model = tiny_seq2seq(vocab, seed=7)
    src = torch.tensor([[4, 5, 6]])
    memory = model.encode(src)
    best, best_score = None, -math.inf
    words = (3, 4, 5, 6, 7)
    for n in range(max_len):
        for body in itertools.product(words, repeat=n):
            seq = list(body) + [EOS_ID]
            logp = model.decode(torch.tensor([[BOS_ID] + seq[:-1]]), memory, None).log_softmax(-1)[0]
            score = sum(logp[i, t].item() for i, t in enumerate(seq))
            if score > best_score:
                best, best_score = seq, score
    tokens, score = beam_search(model, src, max_len=max_len, beam_size=25, alpha=0.0, **IDS)
    assert tokens[0].tolist()[: len(best)] == best and score.item() == pytest.approx(best_score, abs=1e-4)


def gnmt_length_penalty(length: int, alpha: float) -> float:
    """lp(Y) = (5 + |Y|)^α / (5 + 1)^α (Wu et al. 2016, eq. 14)."""
    return (5 + length) ** alpha / (5 + 1) ** alpha


def test_length_penalty_is_gnmts():
    for length, alpha in itertools.product((1, 2, 7, 30), (0.0, 0.6, 1.0, 2.0)):
        assert length_penalty(length, alpha) == pytest.approx(gnmt_length_penalty(length, alpha), rel=1e-12)
    assert length_penalty(torch.tensor([1.0, 7.0]), 0.6).tolist() == pytest.approx([1.0, 2.0**0.6])  # (5 + 7) / 6 = 2


def test_beam_search_with_a_length_penalty_finds_the_exact_best_normalised_score():
    """Every sentence of up to 4 tokens (EOS last) scored by hand: log p(Y) / lp(Y), |Y| counting the EOS. With this
    model the shortest sentence (EOS alone) is the most likely and wins at α = 0; GNMT's penalty at α = 0.6 makes
    a 4-token one win, and a penalty of the wrong sign would keep the shortest. The beam (150) holds every prefix."""
    vocab, max_len, words = 8, 4, (3, 4, 5, 6, 7)  # next tokens: EOS, UNK and 4..7 (PAD and BOS never)
    model = tiny_seq2seq(vocab, seed=1)
    src = torch.tensor([[4, 5, 6]])
    bodies = torch.tensor(list(itertools.product(words, repeat=max_len - 1)))  # (125, 3)
    inputs = torch.cat([torch.full((len(bodies), 1), BOS_ID), bodies], dim=1)  # (125, 4)
    with torch.no_grad():  # causal: position i's distribution depends on the tokens before it only
        memory = model.encode(src).expand(len(bodies), -1, -1)
        logp = model.decode(inputs, memory, None).log_softmax(-1)  # (125, 4, V)
    scores = {}  # sentence -> log p
    for row, body in zip(logp, bodies.tolist()):
        for n in range(max_len):
            sentence = (*body[:n], EOS_ID)
            scores[sentence] = sum(row[i, t].item() for i, t in enumerate(sentence))
    assert max(scores, key=scores.get) == (EOS_ID,)
    for alpha in (0.0, 0.6):
        best = max(scores, key=lambda s: scores[s] / gnmt_length_penalty(len(s), alpha))
        tokens, score = beam_search(model, src, max_len=max_len, beam_size=150, alpha=alpha, **IDS)
        assert tuple(tokens[0].tolist()[: len(best)]) == best and tokens[0, len(best) :].eq(PAD_ID).all()
        assert score.item() == pytest.approx(scores[best] / gnmt_length_penalty(len(best), alpha), abs=1e-4)
    assert len(best) == max_len  # α = 0.6 changed the winner; the wrong sign keeps EOS alone
    assert max(scores, key=lambda s: scores[s] / gnmt_length_penalty(len(s), -0.6)) == (EOS_ID,)


def test_hypotheses_end_with_eos_within_max_len():
    model = tiny_seq2seq(V, seed=8)
    src = padded_batch(V, [5, 3], seed=9)
    for tokens in (
        greedy_decode(model, src, max_len=4, **IDS)[0],
        beam_search(model, src, max_len=4, beam_size=3, **IDS)[0],
    ):
        assert tokens.size(1) <= 4
        assert all(EOS_ID in row.tolist() for row in tokens)
        assert not tokens.eq(BOS_ID).any()


@pytest.mark.slow
def test_tiny_model_overfits_a_few_sentence_pairs_to_bleu_100():
    pairs = toy_translation_pairs(6, seed=3)
    tok = build_tokenizer("word", [s for p in pairs for s in p], min_frequency=1)
    src = collate_pairs(
        [
            {
                "index": i,
                "src": tok.encode(e, add_special_tokens=False).ids + [EOS_ID],
                "src_text": e,
                "tgt": [BOS_ID] + tok.encode(d, add_special_tokens=False).ids + [EOS_ID],
                "tgt_text": d,
            }
            for i, (e, d) in enumerate(pairs)
        ]
    )
    model = tiny_seq2seq(tok.get_vocab_size(), share_embeddings=True).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    decoder_input, labels = teacher_forcing(src["tgt"])
    for _ in range(150):
        loss, _ = label_smoothed_nll_loss(model(src["src"], decoder_input), labels, 0.1, PAD_ID)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    hyps = tok.decode_batch(greedy_decode(model, src["src"], max_len=20, **IDS)[0].tolist())
    assert sacrebleu.corpus_bleu(hyps, [src["tgt_text"]]).score == pytest.approx(100.0), hyps


# ----------------------------------------------------------------------------- tokenizers and data


@pytest.mark.parametrize("kind", ["word", "bpe", "char"])
def test_tokenizer_round_trip_and_fixed_special_ids(kind):
    lines = [e for p in toy_translation_pairs(200) for e in p]
    tok = build_tokenizer(kind, lines, vocab_size=300, min_frequency=1)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    unseen = (
        ["Zwei  Hunde, im Park schlafen."] if kind != "word" else []
    )  # a new word, two spaces: subwords and characters cope
    for s in lines[:50] + unseen:
        assert tok.decode(tok.encode(s, add_special_tokens=False).ids) == s
    assert (
        tok.decode([BOS_ID] + tok.encode("Der Hund.", add_special_tokens=False).ids + [EOS_ID, PAD_ID]) == "Der Hund."
    )


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def toy_dir(tmp_path, src="A dog.\nA cat.\n", tgt="Ein Hund.\nEine Katze.\n"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        write(tmp_path / f"{split}.en", src)
        write(tmp_path / f"{split}.de", tgt)
    return tmp_path


def test_parallel_data_module_batches_and_links(tmp_path):
    dm = ParallelTextDataModule(
        str(toy_dir(tmp_path)), test_split=None, tokenizer="word", min_frequency=1, batch_size=2
    )
    dm.setup("fit")
    assert dm.src_vocab_size == dm.tgt_vocab_size == len(dm.tokenizers[0].get_vocab()) and (
        dm.pad_id,
        dm.bos_id,
        dm.eos_id,
    ) == (0, 1, 2)
    batch = next(iter(dm.val_dataloader()))
    assert batch["src"].shape == (2, 4) and batch["tgt"][:, 0].eq(BOS_ID).all()  # ▁A ▁dog . EOS
    assert batch["tgt"].tolist()[0][-1] == EOS_ID and sorted(batch["tgt_text"]) == ["Ein Hund.", "Eine Katze."]
    assert dm.decode_target(batch["tgt"].tolist()) == batch["tgt_text"]
    with pytest.raises(ValueError, match="data.test_split is not set"):
        dm.setup("test")


def test_length_buckets_are_a_permutation_of_similar_lengths():
    lengths = [int(x) for x in torch.randint(1, 50, (500,))]
    order = list(LengthBucketSampler(lengths, batch_size=10, pool=5))
    assert sorted(order) == list(range(500))
    spread = [
        max(lengths[i] for i in order[s : s + 10]) - min(lengths[i] for i in order[s : s + 10])
        for s in range(0, 500, 10)
    ]
    assert sum(spread) / len(spread) < 10  # random batches would spread over ~40


def test_long_sentences_are_truncated_with_a_counting_warning(tmp_path):
    long = " ".join(["dog"] * 30) + "\n"
    dm = ParallelTextDataModule(
        str(toy_dir(tmp_path, src=long + "A cat.\n")), test_split=None, tokenizer="word", min_frequency=1, max_len=8
    )
    with pytest.warns(UserWarning, match="1 of 2 val sentences .* longer than data.max_len=8 tokens were truncated"):
        dm.setup("validate")
    assert len(dm.val_set[0]["src"]) == 8 and dm.val_set[0]["src"][-1] == EOS_ID


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
    toy_dir(tmp_path)
    write(tmp_path / "train.de", "Ein Hund.\nEine Katze.\nEin Vogel.\n")
    dm = ParallelTextDataModule(str(tmp_path), test_split=None)
    with pytest.raises(ValueError, match=rf"{tmp_path}/train.en has 2 lines but {tmp_path}/train.de has 3"):
        dm.src_vocab_size


def test_empty_line_names_file_and_line(tmp_path):
    toy_dir(tmp_path)
    write(tmp_path / "val.de", "Ein Hund.\n \n")
    with pytest.raises(ValueError, match=rf"{tmp_path}/val.de line 2 is empty"):
        ParallelTextDataModule(str(tmp_path), test_split=None).src_vocab_size


def test_non_utf8_bytes_name_file_and_line(tmp_path):
    toy_dir(tmp_path)
    (tmp_path / "train.de").write_bytes(b"Ein Hund.\nEine M" + b"\xe4dchen.\n")
    with pytest.raises(ValueError, match=rf"{tmp_path}/train.de line 2: byte 0xe4 at column 7 is not UTF-8"):
        ParallelTextDataModule(str(tmp_path), test_split=None).src_vocab_size


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.data_dir: folder .*nowhere does not exist"):
        ParallelTextDataModule(str(tmp_path / "nowhere"))
    toy_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"data.test_split: file {tmp_path}/test.en does not exist"):
        ParallelTextDataModule(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="data.predict_file: file missing.txt does not exist"):
        ParallelTextDataModule(str(tmp_path), test_split=None, predict_file="missing.txt")
    with pytest.raises(FileNotFoundError, match="data.tokenizer_dir: tokenizer file .*tokenizer.json does not exist"):
        ParallelTextDataModule(str(tmp_path), test_split=None, tokenizer_dir=str(tmp_path)).src_vocab_size
    with pytest.raises(FileNotFoundError, match=f"data.x: {tmp_path} is not a file"):
        read_lines(tmp_path, "data.x")


def test_vocabulary_mismatch_with_a_checkpoint_is_a_clear_error():
    check_vocabulary({"hyper_parameters": {"tgt_vocab_size": 10}}, {"tgt_vocab_size": 10}, ("tgt_vocab_size",))
    with pytest.raises(ValueError, match="tgt_vocab_size=8000 in the checkpoint but 7990 from the data"):
        check_vocabulary({"hyper_parameters": {"tgt_vocab_size": 8000}}, {"tgt_vocab_size": 7990}, ("tgt_vocab_size",))


def test_checkpoint_tokenizer_must_match_the_data(tmp_path):
    dm = ParallelTextDataModule(str(toy_dir(tmp_path)), test_split=None, tokenizer="word", min_frequency=1)
    state = dm.state_dict()
    dm.load_state_dict(state)  # the same tokenizer: accepted
    other = ParallelTextDataModule(
        str(toy_dir(tmp_path / "o", src="A bird.\nA cat.\n")), test_split=None, tokenizer="word", min_frequency=1
    )
    with pytest.raises(ValueError, match="the checkpoint's tokenizer .* is not the one this data built"):
        other.load_state_dict(state)


def test_a_second_writer_of_the_toy_corpus_leaves_the_first_ones_files_whole(tmp_path, monkeypatch):
    """The ranks of a torchrun launch each write the corpus when their data module is built. Another writer that runs
    start to end while this one is between writing a file and renaming it into place (the schedule that failed rank 0
    of a two-process run) takes nothing from it: both finish, and every file holds its split's sentences."""
    replace, interleaved = os.replace, []

    def other_writer_first(src, dst):
        if not interleaved:
            interleaved.append(dst)
            write_toy_corpus(tmp_path)
        replace(src, dst)

    monkeypatch.setattr(os, "replace", other_writer_first)
    write_toy_corpus(tmp_path)
    monkeypatch.undo()
    pairs, start = toy_translation_pairs(sum(TOY_SPLITS.values())), 0
    for split, size in TOY_SPLITS.items():
        for lang, side in (("en", 0), ("de", 1)):
            assert (tmp_path / f"{split}.{lang}").read_text().splitlines() == [
                p[side] for p in pairs[start : start + size]
            ]
        start += size
    assert interleaved and not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_corpus_blocks_are_contiguous_and_split_by_position(tmp_path):
    text = "".join(f"line {i}: to be or not to be\n" for i in range(40))
    dm = TextCorpusDataModule(str(write(tmp_path / "c.txt", text)), block_size=16, val_fraction=0.25, batch_size=4)
    dm.setup("fit")
    ids = dm.tokenizer.encode(text, add_special_tokens=False).ids
    n_train = int(len(ids) * 0.75)
    item = dm.val_set[1]
    assert torch.equal(item["target"][:-1], item["input"][1:])  # the target is the input shifted by one
    assert item["input"].tolist() == ids[n_train + 16 : n_train + 32]  # the validation part is the end of the text
    assert dm.vocab_size == len(set(text)) + 4 and dm.decode([ids[:20]]) == [text[:20]]
    x = dm.train_set[3]["input"].tolist()
    assert any(ids[s : s + 16] == x for s in range(n_train - 16))  # a window of the training part


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="holds no text"):
        TextCorpusDataModule(str(write(tmp_path / "empty.txt", "\n\n"))).vocab_size
    short = TextCorpusDataModule(str(write(tmp_path / "short.txt", "abc\n" * 10)), block_size=16)
    with pytest.raises(
        ValueError, match="the validation part of .*short.txt has 4 tokens, fewer than data.block_size \\+ 1 = 17"
    ):
        short.setup("fit")


def test_saved_tokenizer_is_reused_without_training_data(tmp_path):
    dm = ParallelTextDataModule(
        str(toy_dir(tmp_path / "data")), test_split=None, tokenizer="word", min_frequency=1, shared_vocab=False
    )
    for stem, tokenizer in dm._tokenizers().items():
        tokenizer.save(str(tmp_path / f"{stem}.json"))  # what `attnlab fit` writes beside the checkpoints
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["tokenizer.de.json", "tokenizer.en.json"]
    reused = ParallelTextDataModule(
        str(tmp_path / "data"),
        train_split=None,
        val_split=None,
        test_split=None,
        shared_vocab=False,
        tokenizer_dir=str(tmp_path),
    )
    assert [t.to_str() for t in reused.tokenizers] == [t.to_str() for t in dm.tokenizers]
    with pytest.raises(ValueError, match="data.train_split=null needs data.tokenizer_dir"):
        ParallelTextDataModule(str(tmp_path / "data"), train_split=None)
