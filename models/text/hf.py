"""Pretrained Hugging Face text models on our core: GPT-2 (Radford et al. 2019) and Llama-architecture
decoders (Llama, Touvron et al. 2023; SmolLM; Mistral without a sliding window) as a `DecoderOnlyLM`,
Marian (the opus-mt translation models, Junczys-Dowmunt et al. 2018) as a `Seq2SeqTransformer`.

A pretrained model is a folder written by ``save_pretrained`` (``config.json`` and
``model.safetensors`` or ``pytorch_model.bin``, possibly sharded), or a hub name that
huggingface_hub resolves through its own cache when online. The architecture is read from
``config.json`` and expressed with our options; what we cannot express is refused with one line.

GPT-2 on our core: learned positions, pre-norm blocks, a final LayerNorm, GELU with the tanh
approximation ("gelu_new" = our ``gelu_tanh``), tied embeddings, biased attention. Its ``Conv1D``
layers store weights as (in, out), the transpose of ``nn.Linear``; ``c_attn`` packs q, k, v as our
``in_proj`` does.

Llama on our core: RoPE in HF's rotate-half layout (``rope_theta``; no ``rope_scaling``), pre-norm blocks of
RMSNorm and a final RMSNorm, a SwiGLU MLP (``gate_proj`` and ``up_proj`` packed into ``linear1``), no biases
(or ``attention_bias`` = ``mlp_bias`` = true: biases everywhere), grouped-query attention (``num_key_value_heads``;
``q_proj``, ``k_proj``, ``v_proj`` packed into ``in_proj``), tied or untied embeddings as ``tie_word_embeddings``
says. Qwen2 (biases on q, k, v but not on o) and Mistral with a sliding window are refused.

Marian on our core: post-norm layers without final norms, token embeddings scaled by √d_model,
sinusoidal positions laid out as all sines then all cosines (``sinusoidal_concat``), one embedding
matrix shared by encoder, decoder and output, and ``final_logits_bias`` as the output bias. Its
separate q/k/v projections are packed into our ``in_proj``; the decoder starts with PAD.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from models.core.attention import AttentionConfig
from models.core.position import IN_ATTENTION
from models.text.lm import DecoderOnlyLM
from models.text.seq2seq import Seq2SeqTransformer
from models.weights import load_checked, read_state, resolve

KEY = "model.init_from"

# Hugging Face activation names -> ours (models.core.transformer)
_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "swish": "silu",
    "silu": "silu",
}


def pretrained_folder(name: str, key: str) -> Path:
    """A local folder, or a hub name resolved by huggingface_hub (its cache; a download only when online)."""
    folder = resolve(
        name,
        key,
        "give a folder written by save_pretrained (config.json and weights) or a hub name",
        hub_files=("*.json", "*.spm", "*.model", "*.txt"),  # and the tokenizer's files, which the data reads
    )
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{key}={name} is not a folder; give a folder written by save_pretrained (config.json and weights) or a hub name"
        )
    return folder


def read_config(folder: Path, key: str, model_types: tuple[str, ...]) -> dict:
    """``config.json`` of a pretrained folder, refused unless it describes a model of one of ``model_types``."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {folder} has no config.json; give a folder written by save_pretrained")
    config = json.loads(path.read_text())
    if config.get("model_type") not in model_types:
        raise ValueError(
            f"{key}: {path} describes a {config.get('model_type')!r} model; "
            f"this model imports {' or '.join(map(repr, model_types))} folders only"
        )
    return config


def _expect(config: dict, key: str, source: str, allowed: tuple, default=None) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(
            f"{source}: config.json sets {key}={value!r}, which attnlab cannot express (supported: {', '.join(map(repr, allowed))})"
        )


def _activation(config: dict, source: str) -> str:
    name = config.get("activation_function")
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"{source}: config.json sets activation_function={name!r}, which attnlab cannot express (supported: {', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def _check_linked(source: str, pairs: dict[str, tuple[int, int]]) -> None:
    """The data's vocabulary facts must be the pretrained model's: its tokenizer is the folder's."""
    diffs = [
        f"{name}={ours} from the data but {theirs} in config.json"
        for name, (ours, theirs) in pairs.items()
        if ours != theirs
    ]
    if diffs:
        raise ValueError(
            f"{source}: {'; '.join(diffs)}; use the folder's tokenizer (data.tokenizer=pretrained, data.tokenizer_dir= the same folder)"
        )


# ----------------------------------------------------------------------------- GPT-2


def gpt2_arguments(config: dict, source: str) -> dict:
    """GPT-2's ``config.json`` -> `DecoderOnlyLM` arguments."""
    for key, allowed, default in (
        ("layer_norm_epsilon", (1e-5,), 1e-5),
        ("scale_attn_weights", (True,), True),
        ("scale_attn_by_inverse_layer_idx", (False,), False),
        ("add_cross_attention", (False,), False),
        ("tie_word_embeddings", (True,), True),
    ):
        _expect(config, key, source, allowed, default)
    return {
        "d_model": config["n_embd"],
        "nhead": config["n_head"],
        "num_layers": config["n_layer"],
        "dim_feedforward": config.get("n_inner") or 4 * config["n_embd"],
        "activation": _activation(config, source),
        "norm_first": True,
        "positions": "learned",
        "max_positions": config["n_positions"],
        "tie_embeddings": True,
    }


_GPT2_BLOCK = {
    "ln_1": "norm1.",
    "ln_2": "norm2.",
    "attn.c_attn": "self_attn.in_proj_",
    "attn.c_proj": "self_attn.out_proj.",
    "mlp.c_fc": "linear1.",
    "mlp.c_proj": "linear2.",
}
_GPT2_TOP = {
    "wte.weight": "tok_embed.embedding.weight",
    "wpe.weight": "pos.weight",
    "ln_f.weight": "blocks.norm.weight",
    "ln_f.bias": "blocks.norm.bias",
}


def gpt2_to_attnlab(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """GPT-2 state dict (``GPT2LMHeadModel`` or ``GPT2Model``) -> `DecoderOnlyLM` keys; Conv1D weights transposed."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith(
            (".attn.bias", ".attn.masked_bias")
        ):  # tied; old causal-mask buffers
            continue
        if key.startswith("h."):
            _, i, rest = key.split(".", 2)
            module, _, kind = rest.rpartition(".")  # kind: weight | bias
            if module in _GPT2_BLOCK:
                conv = module != "ln_1" and module != "ln_2" and kind == "weight"
                out[f"blocks.layers.{i}.{_GPT2_BLOCK[module]}{kind}"] = (
                    value.t() if conv else value
                )  # Conv1D (in, out) -> (out, in)
                continue
        out[_GPT2_TOP.get(key, key)] = value  # unknown keys pass through, and the load names them
    return out


# ----------------------------------------------------------------------------- Llama (and Mistral)


def _rope(config: dict, source: str) -> float:
    """RoPE's θ, from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` and ``rope_scaling`` (before)."""
    rope = config.get("rope_parameters")
    if rope is None:
        scaling = config.get("rope_scaling") or {}
        rope = {
            "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            "rope_theta": config.get("rope_theta", 10000.0),
        }
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"{source}: config.json sets rope_type={rope['rope_type']!r} (RoPE scaling), which attnlab cannot express "
            "(supported: 'default')"
        )
    return float(rope["rope_theta"])


def llama_arguments(config: dict, source: str) -> dict:
    """Llama's (or Mistral's) ``config.json`` -> `DecoderOnlyLM` arguments."""
    width, heads = config["hidden_size"], config["num_attention_heads"]
    bias = config.get("attention_bias", False)
    for key, allowed, default in (
        ("hidden_act", ("silu",), "silu"),
        ("mlp_bias", (bias,), False),  # one option for both: attention_bias
        ("head_dim", (None, width // heads), None),
        ("sliding_window", (None,), None),  # Mistral's
    ):
        _expect(config, key, source, allowed, default)
    return {
        "d_model": width,
        "nhead": heads,
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "num_layers": config["num_hidden_layers"],
        "dim_feedforward": config["intermediate_size"],
        "activation": "swiglu",
        "norm": "rmsnorm",
        "layer_norm_eps": config.get("rms_norm_eps", 1e-6),
        "norm_first": True,
        "bias": bias,
        "positions": "rope",
        "rope_theta": _rope(config, source),
        "max_positions": config["max_position_embeddings"],
        "tie_embeddings": config.get("tie_word_embeddings", False),
    }


_LLAMA_LAYER = {
    "input_layernorm.": "norm1.",
    "post_attention_layernorm.": "norm2.",
    "self_attn.o_proj.": "self_attn.out_proj.",
    "mlp.down_proj.": "linear2.",
}
_LLAMA_PACKED = {  # theirs -> (ours, the part's place in our packed matrix)
    "self_attn.q_proj.": ("self_attn.in_proj_", 0),
    "self_attn.k_proj.": ("self_attn.in_proj_", 1),
    "self_attn.v_proj.": ("self_attn.in_proj_", 2),
    "mlp.gate_proj.": ("linear1.", 0),
    "mlp.up_proj.": ("linear1.", 1),
}


def llama_to_attnlab(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Llama state dict (``LlamaForCausalLM``, ``MistralForCausalLM``) -> `DecoderOnlyLM` keys; q, k, v packed into
    ``in_proj``, gate and up into ``linear1``."""
    out, packed = {}, {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        if key.endswith("rotary_emb.inv_freq"):  # a buffer older transformers saved; ours is computed
            continue
        if key == "embed_tokens.weight":
            out["tok_embed.embedding.weight"] = value
        elif key == "norm.weight":
            out["blocks.norm.weight"] = value
        elif key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            module, kind = rest.rsplit(".", 1)  # kind: weight | bias
            if module + "." in _LLAMA_PACKED:
                ours, place = _LLAMA_PACKED[module + "."]
                packed.setdefault(f"blocks.layers.{i}.{ours}{kind}", {})[place] = value
                continue
            prefix = next((p for p in _LLAMA_LAYER if rest.startswith(p)), None)
            out[f"blocks.layers.{i}.{_LLAMA_LAYER[prefix]}{rest[len(prefix) :]}" if prefix else key] = value
        else:
            out[key] = value  # lm_head.weight, or unknown: named by the load
    for name, parts in packed.items():
        out[name] = torch.cat([parts[place] for place in sorted(parts)])  # a part missing: the load names the shape
    return out


# ----------------------------------------------------------------------------- Marian

_MARIAN_LAYER = {
    "self_attn_layer_norm": "norm1",
    "fc1": "linear1",
    "fc2": "linear2",
    "self_attn.out_proj": "self_attn.out_proj",
}
_MARIAN_ENCODER = {**_MARIAN_LAYER, "final_layer_norm": "norm2"}
_MARIAN_DECODER = {
    **_MARIAN_LAYER,
    "encoder_attn_layer_norm": "norm2",
    "final_layer_norm": "norm3",
    "encoder_attn.out_proj": "multihead_attn.out_proj",
}


def marian_arguments(config: dict, source: str) -> dict:
    """Marian's ``config.json`` -> `Seq2SeqTransformer` arguments (one width of heads and MLP for both stacks)."""
    _expect(config, "share_encoder_decoder_embeddings", source, (True,), True)
    _expect(config, "normalize_before", source, (False,), False)
    _expect(config, "tie_word_embeddings", source, (True,), True)
    _expect(config, "decoder_vocab_size", source, (None, config["vocab_size"]))
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if config[enc] != config[dec]:
            raise ValueError(
                f"{source}: config.json sets {enc}={config[enc]} but {dec}={config[dec]}; attnlab's stacks share one value"
            )
    return {
        "d_model": config["d_model"],
        "nhead": config["encoder_attention_heads"],
        "num_encoder_layers": config["encoder_layers"],
        "num_decoder_layers": config["decoder_layers"],
        "dim_feedforward": config["encoder_ffn_dim"],
        "activation": _activation(config, source),
        "norm_first": False,
        "positions": "sinusoidal_concat",
        "max_positions": config["max_position_embeddings"],
        "share_embeddings": True,
        "tie_output": True,
        "scale_embeddings": config.get("scale_embedding", False),
        "output_bias": True,
    }


def marian_to_attnlab(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Marian state dict (``MarianMTModel``) -> `Seq2SeqTransformer` keys; q, k, v packed into ``in_proj``."""
    out, qkv = {}, {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        if key.endswith(("embed_positions.weight", "embed_tokens.weight")) or key == "lm_head.weight":
            continue  # computed (sinusoidal), or tied to the shared matrix
        if key == "shared.weight":
            out["src_embed.embedding.weight"] = value
        elif key == "final_logits_bias":
            out["generator.bias"] = value.reshape(-1)
        elif key.startswith(("encoder.layers.", "decoder.layers.")):
            stack, _, i, rest = key.split(".", 3)
            names = _MARIAN_ENCODER if stack == "encoder" else _MARIAN_DECODER
            attn, _, proj = rest.partition(".")
            if attn in ("self_attn", "encoder_attn") and proj.startswith(("q_proj.", "k_proj.", "v_proj.")):
                ours = "self_attn" if attn == "self_attn" else "multihead_attn"
                kind = proj.split(".")[1]  # weight | bias
                qkv.setdefault(f"{stack}.layers.{i}.{ours}.in_proj_{kind}", {})[proj[0]] = value
                continue
            prefix = next((p for p in names if rest.startswith(p + ".")), None)
            out[f"{stack}.layers.{i}.{names[prefix]}{rest[len(prefix) :]}" if prefix else key] = value
        else:
            out[key] = value  # unknown: named by the load
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]])  # (3D, D) or (3D,)
    return out


def _marian_linked(config: dict) -> dict[str, int]:
    """The vocabulary facts and token ids the data must share with the folder."""
    return {
        "src_vocab_size": config["vocab_size"],
        "tgt_vocab_size": config.get("decoder_vocab_size") or config["vocab_size"],
        "pad_id": config["pad_token_id"],
        "bos_id": config["decoder_start_token_id"],  # the decoder's start token: PAD
        "eos_id": config["eos_token_id"],
    }


# ----------------------------------------------------------------------------- the families, and the one import


@dataclass(frozen=True)
class Family:
    """How a Hugging Face ``model_type`` becomes one of our networks. A new family is its ``*_arguments`` and
    ``*_to_attnlab`` functions, an entry in `FAMILIES`, and its ``model_type`` among those that the entry point of
    its network (`DECODER_ONLY` of `lm_from_pretrained` for `DecoderOnlyLM`) accepts."""

    title: str  # for messages: "GPT-2"
    network: type[nn.Module]
    arguments: Callable[[dict, str], dict]  # config.json (and the source, for errors) -> our architecture arguments
    rename: Callable[[dict[str, Tensor]], dict[str, Tensor]]  # its state dict -> our key names
    linked: Callable[[dict], dict[str, int]]  # config.json -> the data's facts it fixes (vocabulary, token ids)


def _vocabulary(config: dict) -> dict[str, int]:
    return {"vocab_size": config["vocab_size"]}


FAMILIES = {
    "gpt2": Family("GPT-2", DecoderOnlyLM, gpt2_arguments, gpt2_to_attnlab, _vocabulary),
    "llama": Family("Llama", DecoderOnlyLM, llama_arguments, llama_to_attnlab, _vocabulary),
    "mistral": Family("Mistral", DecoderOnlyLM, llama_arguments, llama_to_attnlab, _vocabulary),
    "marian": Family("Marian", Seq2SeqTransformer, marian_arguments, marian_to_attnlab, _marian_linked),
}
DECODER_ONLY = tuple(t for t, f in FAMILIES.items() if f.network is DecoderOnlyLM)


def from_pretrained(
    name: str, model_types: tuple[str, ...], network: dict, data_ids: dict[str, int] | None = None
) -> tuple[nn.Module, dict]:
    """The network holding the pretrained model of ``name`` (folder or hub name) of one of ``model_types``, and
    the architecture arguments it was built with. Of ``network`` (the run's arguments of the family's network,
    with the data's vocabulary facts) the folder's architecture replaces all but the vocabulary facts, the
    dropout rates and ``attention``, which must be the default block (and ``positions``, which may only
    be left at its default, or be the folder's); the vocabulary facts, and ``data_ids`` (token ids the network is
    not built with), must be the folder's."""
    source = f"{KEY}={name}"
    folder = pretrained_folder(name, KEY)
    config = read_config(folder, source, model_types)
    family = FAMILIES[config["model_type"]]
    bound = inspect.signature(family.network).bind(**network)
    bound.apply_defaults()
    arguments = family.arguments(config, source)
    changed = {k: v for k, v in vars(bound.arguments["attention"]).items() if v != getattr(AttentionConfig(), k)}
    if changed:
        raise ValueError(
            f"{source}: {family.title} was trained with the default attention block; set "
            + ", ".join(f"model.attention.{k}={getattr(AttentionConfig(), k)}" for k in changed).replace("None", "null")
        )
    positions = bound.arguments["positions"]
    if positions in IN_ATTENTION and positions != arguments["positions"]:
        raise ValueError(
            f"{source}: {family.title} was trained with positions={arguments['positions']!r}, not {positions!r}; "
            f"set model.positions={arguments['positions']}"
        )
    theirs = family.linked(config)
    ours = {**bound.arguments, **(data_ids or {})}
    _check_linked(source, {k: (ours[k], theirs[k]) for k in theirs})
    model = family.network(**{**bound.arguments, **arguments})
    load_checked(model, family.rename(read_state(folder, source)), source, family.title)
    return model, arguments


def lm_from_pretrained(name: str, network: dict) -> tuple[DecoderOnlyLM, dict]:
    """A `DecoderOnlyLM` holding the GPT-2 or Llama-architecture model of ``name`` (`from_pretrained`);
    ``vocab_size`` comes from the data."""
    return from_pretrained(name, DECODER_ONLY, network)


def marian_from_pretrained(name: str, network: dict, bos_id: int, eos_id: int) -> tuple[Seq2SeqTransformer, dict]:
    """A `Seq2SeqTransformer` holding the Marian model of ``name`` (`from_pretrained`); the data's vocabulary
    sizes, ``pad_id``, ``bos_id`` (the decoder's start token) and ``eos_id`` must be the folder's."""
    return from_pretrained(name, ("marian",), network, {"bos_id": bos_id, "eos_id": eos_id})
