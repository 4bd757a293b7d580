"""Pretrained Hugging Face text models through ``model.init_from``: tiny random GPT-2, Llama, Mistral and Marian models,
built offline with transformers and saved with save_pretrained, give the same logits and greedy tokens
through our models as through transformers; the data side uses their tokenizers; bad folders, hub names
offline and timm hub names offline are refused with one line. Nothing downloads."""

import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
)

from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.text.toy import toy_translation_pairs
from models.core.attention import AttentionConfig
from models.text.lm_module import LanguageModelModule
from models.text.translation_module import TranslationModule
from models.vision.module import ImageClassifier

PAIRS = toy_translation_pairs(400)
ENGLISH = "\n".join(en for en, _ in PAIRS) + "\n"


def _randomize(model: torch.nn.Module) -> None:
    """Weights far from the near-zero init, so that a misplaced or transposed matrix shows in the logits."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" not in name:  # Marian's fixed sinusoids stay as they are
                p.normal_(0, 0.3)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """A folder as save_pretrained writes it: a 2-layer GPT-2 and its byte-level BPE tokenizer.json."""
    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(ENGLISH.splitlines(keepends=True), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|endoftext|>")
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=tokenizer.get_vocab_size(),
            n_positions=64,
            bos_token_id=eot,
            eos_token_id=eot,
        )
    )
    _randomize(model)
    model.save_pretrained(folder)
    return folder


LLAMA_VOCAB = 97
# sizes no other test uses; grouped-query (6 query heads on 2 key/value heads) and plain multi-head attention,
# RoPE θ at its default and not, untied and tied embeddings, no biases and biases everywhere
LLAMAS = {
    "llama-gqa": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    ),
    "llama-mha-biased-tied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_key_value_heads=6,
            rope_theta=500.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        dict(num_key_value_heads=3, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
    ),
}


def _llama_tokenizer() -> Tokenizer:
    """A Llama-style tokenizer.json: BPE over Metaspace ("▁" for spaces), <unk>, <s>, </s>, 97 tokens."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=LLAMA_VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(ENGLISH.splitlines(keepends=True), trainer)
    assert tokenizer.get_vocab_size() == LLAMA_VOCAB
    return tokenizer


def _save_llama(folder: Path, kind: str) -> Path:
    """A 3-layer Llama-architecture model (width 48, 6 heads, MLP 80) of `LLAMAS` and its tokenizer.json, as
    save_pretrained writes them."""
    config_class, model_class, options = LLAMAS[kind]
    _llama_tokenizer().save(str(folder / "tokenizer.json"))
    config = config_class(
        vocab_size=LLAMA_VOCAB,
        hidden_size=48,
        num_hidden_layers=3,
        num_attention_heads=6,
        intermediate_size=80,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        **options,
    )
    model = model_class(config)
    torch.manual_seed(0)
    with torch.no_grad():  # far from the init (norms included), yet greedy decoding does not repeat one token
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(LLAMAS))
def llama(request, tmp_path_factory) -> Path:
    return _save_llama(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama_gqa(tmp_path_factory) -> Path:
    """One of them, for the tests that need one."""
    return _save_llama(tmp_path_factory.mktemp("llama"), "llama-gqa")


MARIAN_VOCAB, MARIAN_PAD = 60, 59


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> Path:
    """A 2+2-layer Marian model as save_pretrained writes it (opus-mt's options: swish, scaled embeddings)."""
    folder = tmp_path_factory.mktemp("marian")
    _marian_model(MARIAN_VOCAB).save_pretrained(folder)
    return folder


def _marian_model(vocab: int) -> MarianMTModel:
    config = MarianConfig(
        vocab_size=vocab,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=vocab - 1,
        decoder_start_token_id=vocab - 1,
        eos_token_id=0,
        forced_eos_token_id=0,
        scale_embedding=True,
        activation_function="swish",
    )
    model = MarianMTModel(config)
    _randomize(model)
    return model.eval()


def _lm_data(gpt2: Path, tmp_path: Path) -> TextCorpusDataModule:
    text = tmp_path / "corpus.txt"
    text.write_text(ENGLISH)
    return TextCorpusDataModule(
        path=str(text),
        tokenizer="pretrained",
        tokenizer_dir=str(gpt2),
        block_size=16,
        batch_size=4,
        cache_dir=str(tmp_path),
    )


def test_gpt2_gives_the_logits_and_greedy_tokens_of_transformers(gpt2, tmp_path):
    dm = _lm_data(gpt2, tmp_path)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(gpt2 / "tokenizer.json"))
    assert (
        dm.tokenizer.encode(PAIRS[0][0]).ids == hf_tokenizer(PAIRS[0][0]).input_ids
    )  # the folder's BPE, used as it is
    module = LanguageModelModule(vocab_size=dm.vocab_size, dropout=0.0, init_from=str(gpt2)).eval()
    assert (
        module.hparams.d_model,
        module.hparams.num_layers,
        module.hparams.activation,
        module.hparams.max_positions,
    ) == (32, 2, "gelu_tanh", 64)
    _assert_logits_and_greedy_tokens_agree(module, GPT2LMHeadModel.from_pretrained(gpt2).eval(), dm, 12, 1e-4)


def _assert_logits_and_greedy_tokens_agree(module, hf, dm, new_tokens: int, tol: float) -> torch.Tensor:
    """Our language model against transformers' on a training batch (4, 16): the logits within ``tol``, and the
    greedy tokens after a 5-token prompt (ours one cached step a token). Returns ours (2, 5 + new_tokens)."""
    dm.setup("fit")
    tokens = next(iter(dm.train_dataloader()))["input"]  # (4, 16)
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(module(tokens), expected, atol=tol, rtol=tol)
    assert expected.std() > 0.1  # logits that would show a misplaced weight
    prompt = tokens[:2, :5]
    greedy = hf.generate(
        prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt)
    )
    ours = module.model.generate(prompt, new_tokens, temperature=0)
    assert torch.equal(ours, greedy)
    return ours


def test_llama_gives_the_logits_and_greedy_tokens_of_transformers(llama, tmp_path):
    dm = _lm_data(llama, tmp_path)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(llama / "tokenizer.json"))
    text = PAIRS[0][0]
    assert (
        dm.tokenizer.encode(text, add_special_tokens=False).ids
        == hf_tokenizer(text, add_special_tokens=False).input_ids
    )
    module = LanguageModelModule(vocab_size=dm.vocab_size, dropout=0.0, init_from=str(llama)).eval()
    hf = AutoModelForCausalLM.from_pretrained(llama).eval()
    config = hf.config
    hp = module.hparams
    assert (hp.d_model, hp.nhead, hp.num_kv_heads, hp.num_layers, hp.dim_feedforward) == (
        48,
        6,
        config.num_key_value_heads,
        3,
        80,
    )
    assert (hp.positions, hp.rope_theta, hp.norm, hp.layer_norm_eps, hp.activation, hp.bias) == (
        "rope",
        config.rope_parameters["rope_theta"],
        "rmsnorm",
        config.rms_norm_eps,
        "swiglu",
        getattr(config, "attention_bias", False),  # Mistral has none
    )
    tied = module.model.lm_head.weight is module.model.tok_embed.weight
    assert tied == config.tie_word_embeddings
    ours = _assert_logits_and_greedy_tokens_agree(module, hf, dm, 10, 1e-5)
    assert len(set(ours[:, 5:].flatten().tolist())) > 3  # tokens that differ, so that each step is checked


def test_marian_gives_the_logits_and_greedy_tokens_of_transformers(marian):
    ids = {"pad_id": MARIAN_PAD, "bos_id": MARIAN_PAD, "eos_id": 0}  # Marian's decoder starts with PAD
    module = TranslationModule(
        src_vocab_size=MARIAN_VOCAB, tgt_vocab_size=MARIAN_VOCAB, dropout=0.0, init_from=str(marian), **ids
    ).eval()
    assert (module.hparams.positions, module.hparams.activation, module.hparams.norm_first) == (
        "sinusoidal_concat",
        "silu",
        False,
    )
    hf = MarianMTModel.from_pretrained(marian).eval()
    torch.manual_seed(1)
    src = torch.randint(1, MARIAN_PAD, (3, 9))
    src[:, -1], src[1, 6:], src[2, 4:] = 0, MARIAN_PAD, MARIAN_PAD  # EOS-terminated, two of them padded
    src[1, 5] = src[2, 3] = 0
    tgt = torch.randint(1, MARIAN_PAD, (3, 7))
    tgt[:, 0] = MARIAN_PAD
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=src.ne(MARIAN_PAD).long(), decoder_input_ids=tgt).logits
        torch.testing.assert_close(module(src, tgt), expected, atol=1e-4, rtol=1e-4)
        ours = module.translate(src, beam_size=1)  # (B, L): EOS-terminated, PAD after
        greedy = hf.generate(
            input_ids=src,
            attention_mask=src.ne(MARIAN_PAD).long(),
            max_new_tokens=ours.size(1),
            do_sample=False,
            num_beams=1,
            bad_words_ids=[[MARIAN_PAD]],
        )[:, 1:]  # HF keeps the start token; ours never emits PAD
    assert torch.equal(ours, greedy[:, : ours.size(1)]) and (greedy[:, ours.size(1) :] == MARIAN_PAD).all()


@pytest.mark.parametrize(("config", "model"), [("gpt2", "gpt2"), ("llama", "llama_gqa")])
def test_a_finetune_config_runs_on_a_tiny_model_and_keeps_its_tokenizer(attnlab, config, model, request, tmp_path):
    folder = request.getfixturevalue(model)  # a tiny saved GPT-2, or Llama with grouped-query attention
    text = tmp_path / "corpus.txt"
    text.write_text(ENGLISH)
    code, _, err = attnlab(
        "fit",
        "--config",
        f"configs/text/shakespeare_{config}_finetune.yaml",
        f"--model.init_args.init_from={folder}",
        f"--data.init_args.tokenizer_dir={folder}",
        f"--data.init_args.path={text}",
        "--data.init_args.block_size=16",
        "--data.init_args.batch_size=4",
        "--trainer.fast_dev_run=true",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert code == 0, err
    assert (
        Tokenizer.from_file(str(tmp_path / "tokenizer.json")).to_str()
        == Tokenizer.from_file(str(folder / "tokenizer.json")).to_str()
    )


@pytest.fixture(scope="module")
def marian_with_tokenizer(tmp_path_factory) -> Path:
    """A Marian folder with its tokenizer: a SentencePiece model per language over one vocab.json."""
    import sentencepiece as spm  # in the dev extra, as in pretrained-text: these tests run in CI
    from transformers import MarianTokenizer

    folder = tmp_path_factory.mktemp("marian_tok")
    vocab = {"</s>": 0, "<unk>": 1}
    for side, lang in ((0, "source"), (1, "target")):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([p[side] for p in PAIRS]),
            model_prefix=str(folder / lang),
            vocab_size=120,
            model_type="unigram",
            minloglevel=2,
            bos_id=-1,
            eos_id=-1,
            unk_id=0,
        )
        (folder / f"{lang}.model").rename(folder / f"{lang}.spm")
        for line in (folder / f"{lang}.vocab").read_text().splitlines():
            vocab.setdefault(line.split("\t")[0], len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    MarianTokenizer(*(str(folder / name) for name in ("source.spm", "target.spm", "vocab.json"))).save_pretrained(
        folder
    )
    _marian_model(len(vocab)).save_pretrained(folder)
    return folder


def _parallel_files(tmp_path: Path) -> Path:
    for split, part in (("train", PAIRS[:40]), ("val", PAIRS[40:48])):
        for side, lang in ((0, "en"), (1, "de")):
            (tmp_path / f"{split}.{lang}").write_text("".join(p[side] + "\n" for p in part))
    return tmp_path


def test_the_marian_tokenizer_feeds_the_model_as_transformers_does(marian_with_tokenizer, tmp_path):
    from transformers import MarianTokenizer

    hf_tokenizer = MarianTokenizer.from_pretrained(marian_with_tokenizer)
    dm = ParallelTextDataModule(
        data_dir=str(_parallel_files(tmp_path)),
        tokenizer="pretrained",
        tokenizer_dir=str(marian_with_tokenizer),
        test_split=None,
        batch_size=4,
        bucket=False,
    )
    pad = hf_tokenizer.pad_token_id
    assert (dm.pad_id, dm.bos_id, dm.eos_id, dm.src_vocab_size) == (pad, pad, 0, len(hf_tokenizer))
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    hf_src = hf_tokenizer(batch["src_text"], padding=True, return_tensors="pt")
    hf_tgt = hf_tokenizer(text_target=batch["tgt_text"], padding=True, return_tensors="pt").input_ids
    assert torch.equal(batch["src"], hf_src.input_ids)
    assert (
        torch.equal(batch["tgt"][:, 1:], hf_tgt) and (batch["tgt"][:, 0] == pad).all()
    )  # start token, then the target + EOS
    assert dm.decode_target(batch["tgt"][:, 1:].tolist()) == batch["tgt_text"]
    module = TranslationModule(
        src_vocab_size=dm.src_vocab_size,
        tgt_vocab_size=dm.tgt_vocab_size,
        pad_id=dm.pad_id,
        bos_id=dm.bos_id,
        eos_id=dm.eos_id,
        dropout=0.0,
        init_from=str(marian_with_tokenizer),
    ).eval()
    hf = MarianMTModel.from_pretrained(marian_with_tokenizer).eval()
    with torch.no_grad():
        expected = hf(**hf_src, labels=hf_tgt).logits  # HF shifts the labels right itself, starting with PAD
        counted = hf_tgt.ne(pad)  # positions past EOS: HF lets them see padding, we do not; they count for nothing
        torch.testing.assert_close(
            module(batch["src"], batch["tgt"][:, :-1])[counted], expected[counted], atol=1e-4, rtol=1e-4
        )


def test_the_marian_finetune_config_runs_on_a_tiny_marian(attnlab, marian_with_tokenizer, tmp_path):
    """configs/text/multi30k_marian_finetune.yaml as it is, on a 2+2-layer Marian folder and 40 sentence pairs:
    two steps, validation with BLEU, the best checkpoint, and the test on it."""
    (tmp_path / "data").mkdir()
    data = _parallel_files(tmp_path / "data")
    tiny = (
        "--config",
        "configs/text/multi30k_marian_finetune.yaml",
        f"--model.init_args.init_from={marian_with_tokenizer}",
        f"--data.init_args.tokenizer_dir={marian_with_tokenizer}",
        f"--data.init_args.data_dir={data}",
        "--data.init_args.test_split=val",
        "--data.init_args.batch_size=4",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=1",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={tmp_path}",
    )
    code, out, err = attnlab("fit", *tiny)
    assert code == 0, err
    assert "attnlab: best val/bleu=" in out
    code, out, err = attnlab("test", *tiny, "--ckpt_path", "best")
    assert code == 0, err
    assert "test/bleu" in out


# ----------------------------------------------------------------------------- refused, with one line


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_folder_without_its_tokenizer_is_refused(gpt2, tmp_path):
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(gpt2, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError) as err:
        _ = _lm_data(folder, tmp_path).tokenizer
    assert "has no tokenizer.json" in _one_line(err) and str(folder) in str(err.value)


def test_a_tokenizer_of_an_unknown_type_is_refused(gpt2, tmp_path):
    folder = tmp_path / "odd_tokenizer"
    shutil.copytree(gpt2, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["type"] = "SuffixTree"
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError) as err:
        _ = _lm_data(folder, tmp_path).tokenizer
    assert "cannot be read by the tokenizers library" in _one_line(err)


@pytest.mark.parametrize("model_type", ["bloom", "qwen2"])  # ALiBi; biases on q, k, v but not on o
def test_an_architecture_we_cannot_express_is_refused(gpt2, tmp_path, model_type):
    folder = tmp_path / model_type
    shutil.copytree(gpt2, folder)
    config = json.loads((folder / "config.json").read_text()) | {"model_type": model_type}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=config["vocab_size"], init_from=str(folder))
    assert (
        f"describes a {model_type!r} model; this model imports 'gpt2' or 'llama' or 'mistral' folders only"
        in _one_line(err)
    )


@pytest.mark.parametrize(
    "option, value", [("scale_attn_by_inverse_layer_idx", True), ("activation_function", "quick_gelu")]
)
def test_a_gpt2_option_we_cannot_express_is_refused(gpt2, tmp_path, option, value):
    folder = tmp_path / "odd"
    shutil.copytree(gpt2, folder)
    config = json.loads((folder / "config.json").read_text()) | {option: value}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=config["vocab_size"], init_from=str(folder))
    assert f"{option}={value!r}, which attnlab cannot express" in _one_line(err)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5}, "rope_type='llama3' (RoPE scaling)"),
        ("hidden_act", "gelu", "hidden_act='gelu', which attnlab cannot express"),
        ("mlp_bias", True, "mlp_bias=True, which attnlab cannot express (supported: False)"),  # attention_bias: false
        ("sliding_window", 16, "sliding_window=16, which attnlab cannot express (supported: None)"),
    ],
)
def test_a_llama_option_we_cannot_express_is_refused(llama_gqa, tmp_path, option, value, message):
    folder = tmp_path / "odd"
    shutil.copytree(llama_gqa, folder)
    config = json.loads((folder / "config.json").read_text()) | {option: value}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=LLAMA_VOCAB, init_from=str(folder))
    assert message in _one_line(err)


def test_rope_scaling_of_an_older_config_is_refused(llama_gqa, tmp_path):
    """transformers < 5 wrote rope_theta and rope_scaling at the top of config.json."""
    folder = tmp_path / "old"
    shutil.copytree(llama_gqa, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"]
    (folder / "config.json").write_text(json.dumps(config | {"rope_theta": 123.0, "rope_scaling": None}))
    assert LanguageModelModule(vocab_size=LLAMA_VOCAB, init_from=str(folder)).hparams.rope_theta == 123.0
    (folder / "config.json").write_text(json.dumps(config | {"rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=LLAMA_VOCAB, init_from=str(folder))
    assert "rope_type='linear' (RoPE scaling), which attnlab cannot express" in _one_line(err)


@pytest.mark.parametrize(
    "option, message",
    [
        (
            {"attention": AttentionConfig(qk_norm="rmsnorm")},
            "GPT-2 was trained with the default attention block; set model.attention.qk_norm=null",
        ),
        (
            {"attention": AttentionConfig(normalization="sigmoid", gate="headwise")},
            "set model.attention.normalization=softmax, model.attention.gate=null",
        ),
        ({"positions": "rope"}, "GPT-2 was trained with positions='learned', not 'rope'; set model.positions=learned"),
        (
            {"positions": "alibi"},
            "GPT-2 was trained with positions='learned', not 'alibi'; set model.positions=learned",
        ),
    ],
)
def test_gpt2_with_qk_norm_or_positions_in_attention_is_refused(gpt2, option, message):
    vocab = json.loads((gpt2 / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=vocab, init_from=str(gpt2), **option)
    assert message in _one_line(err)


@pytest.mark.parametrize(
    "option, message",
    [
        (
            {"attention": AttentionConfig(qk_norm="layernorm")},
            "Marian was trained with the default attention block; set model.attention.qk_norm=null",
        ),
        ({"positions": "t5"}, "Marian was trained with positions='sinusoidal_concat', not 't5'"),
    ],
)
def test_marian_with_qk_norm_or_positions_in_attention_is_refused(marian, option, message):
    ids = {"pad_id": MARIAN_PAD, "bos_id": MARIAN_PAD, "eos_id": 0}
    with pytest.raises(ValueError) as err:
        TranslationModule(
            src_vocab_size=MARIAN_VOCAB, tgt_vocab_size=MARIAN_VOCAB, init_from=str(marian), **ids, **option
        )
    assert message in _one_line(err)


def test_another_vocabulary_than_the_folders_is_refused(gpt2, marian):
    vocab = json.loads((gpt2 / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=vocab + 1, init_from=str(gpt2))
    assert f"vocab_size={vocab + 1} from the data but {vocab} in config.json" in _one_line(
        err
    ) and "data.tokenizer=pretrained" in str(err.value)
    with pytest.raises(ValueError) as err:  # our own tokenizer's ids: PAD=0, BOS=1, EOS=2
        TranslationModule(src_vocab_size=MARIAN_VOCAB, tgt_vocab_size=MARIAN_VOCAB, init_from=str(marian))
    assert f"pad_id=0 from the data but {MARIAN_PAD} in config.json" in _one_line(err)


def test_hub_names_offline_name_the_local_folder_alternative(tmp_path):
    with pytest.raises(ValueError) as err:
        LanguageModelModule(vocab_size=50257, init_from="attnlab-tests/no-such-gpt2")
    message = _one_line(err)
    assert "HF_HUB_OFFLINE=1" in message and "--local-dir" in message
    with pytest.raises(ValueError) as err:
        _ = TextCorpusDataModule(
            tokenizer="pretrained", tokenizer_dir="attnlab-tests/no-such-gpt2", cache_dir=str(tmp_path)
        ).tokenizer
    assert "give a folder written by save_pretrained" in _one_line(err)


def test_a_timm_hub_name_offline_names_the_local_folder_alternative(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # empty, whatever the machine's
    name = "timm/vit_small_patch16_224.augreg_in21k"
    with pytest.raises(ValueError) as err:
        ImageClassifier(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, init_from=name)
    message = _one_line(err)
    assert f"model.init_from={name}" in message and "HF_HUB_OFFLINE=1" in message
    assert f"hf download {name} --local-dir DIR`, then model.init_from=DIR" in message
    with pytest.raises(ValueError) as err:  # timm's name without its hub owner: the same repository
        ImageClassifier(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, init_from=name[5:])
    assert f"model.init_from={name}: not a local path" in _one_line(err)
