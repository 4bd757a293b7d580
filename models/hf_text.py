"""Pretrained Hugging Face text models on our core: GPT-2 (Radford et al. 2019) as a `DecoderOnlyLM`,
Marian (the opus-mt translation models, Junczys-Dowmunt et al. 2018) as a `Seq2SeqTransformer`.

A pretrained model is a folder written by ``save_pretrained`` (``config.json`` and
``model.safetensors`` or ``pytorch_model.bin``, possibly sharded), or a hub name that
huggingface_hub resolves through its own cache when online. The architecture is read from
``config.json`` and expressed with our options; what we cannot express is refused with one line.

GPT-2 on our core: learned positions, pre-norm blocks, a final LayerNorm, GELU with the tanh
approximation ("gelu_new" = our ``gelu_tanh``), tied embeddings, biased attention. Its ``Conv1D``
layers store weights as (in, out), the transpose of ``nn.Linear``; ``c_attn`` packs q, k, v as our
``in_proj`` does.

Marian on our core: post-norm layers without final norms, token embeddings scaled by √d_model,
sinusoidal positions laid out as all sines then all cosines (``sinusoidal_concat``), one embedding
matrix shared by encoder, decoder and output, and ``final_logits_bias`` as the output bias. Its
separate q/k/v projections are packed into our ``in_proj``; the decoder starts with PAD.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from models.text import DecoderOnlyLM, Seq2SeqTransformer
from models.weights import load_weights_file

# Hugging Face activation names -> ours (models.transformer)
_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "swish": "silu",
    "silu": "silu",
}
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def pretrained_folder(name: str, key: str) -> Path:
    """A local folder, or a hub name resolved by huggingface_hub (its cache; a download only when online).

    Offline (``HF_HUB_OFFLINE=1``, which `attnlab` sets unless told otherwise) a hub name that is not
    in the cache is a ValueError naming the local-folder alternative.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(
            f"{key}={name} is not a folder; give a folder written by save_pretrained (config.json and weights) or a hub name"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        return Path(
            snapshot_download(
                name,
                local_files_only=offline,
                allow_patterns=["*.json", "*.safetensors", "*.bin", "*.spm", "*.model", "*.txt"],
            )
        )
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{key}={name}: no such local folder, and the hub name is not in the Hugging Face cache while offline (HF_HUB_OFFLINE=1); "
            f"set HF_HUB_OFFLINE=0 to download it, or give a local folder (huggingface-cli download {name} --local-dir DIR)"
        ) from None
    except (HfHubHTTPError, HFValidationError, OSError) as err:
        raise ValueError(
            f"{key}={name} is neither a local folder nor a hub model that could be fetched ({str(err).splitlines()[0]})"
        ) from None


def read_config(folder: Path, key: str, model_type: str) -> dict:
    """``config.json`` of a pretrained folder, refused unless it describes a ``model_type`` model."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{key}: {folder} has no config.json; give a folder written by save_pretrained")
    config = json.loads(path.read_text())
    if config.get("model_type") != model_type:
        raise ValueError(
            f"{key}: {path} describes a {config.get('model_type')!r} model; this model imports {model_type!r} folders only"
        )
    return config


def read_state(folder: Path, key: str) -> dict[str, Tensor]:
    """The weights of a pretrained folder (one file, or shards listed by an index), as tensors only."""
    found = next((folder / name for name in _WEIGHTS if (folder / name).is_file()), None)
    if found is None:
        raise FileNotFoundError(f"{key}: {folder} holds no weights ({', '.join(_WEIGHTS[:2])})")
    if found.name.endswith(".index.json"):
        shards = sorted(set(json.loads(found.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_weights_file(folder / shard, key).items()}
    return load_weights_file(found, key)


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


def _load(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Strict load; a tied matrix (embeddings = output projection) is given once and fills all its names."""
    state, tied = dict(state), {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for names in tied.values():
        given = next((n for n in names if n in state), None)
        for name in names if given else ():
            state.setdefault(name, state[given])
    own = model.state_dict()
    missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{source} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}, other shape {wrong[:3]}"
        )
    model.load_state_dict(state)


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


def _with_defaults(network: type[nn.Module], given: dict) -> dict:
    """The arguments ``network`` is built with: those ``given`` (the run's model options), then its defaults."""
    bound = inspect.signature(network).bind(**given)
    bound.apply_defaults()
    return bound.arguments


def gpt2_from_pretrained(name: str, network: dict) -> tuple[DecoderOnlyLM, dict]:
    """A `DecoderOnlyLM` holding the GPT-2 of ``name`` (folder or hub name), and the architecture arguments
    it was built with; of ``network`` (the run's `DecoderOnlyLM` arguments) the folder's architecture
    replaces all but ``vocab_size`` (linked from the data: it must be the folder's), the dropout rates and
    ``similarity``."""
    source = f"model.init_from={name}"
    folder = pretrained_folder(name, "model.init_from")
    config = read_config(folder, source, "gpt2")
    network = _with_defaults(DecoderOnlyLM, network)
    if network["similarity"] != "scaled_dot":
        raise ValueError(
            f"{source}: GPT-2 was trained with scaled dot-product attention; set model.similarity=scaled_dot"
        )
    _check_linked(source, {"vocab_size": (network["vocab_size"], config["vocab_size"])})
    arguments = gpt2_arguments(config, source)
    model = DecoderOnlyLM(**{**network, **arguments})
    _load(model, gpt2_to_attnlab(read_state(folder, source)), source)
    return model, arguments


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


def marian_from_pretrained(name: str, network: dict, bos_id: int, eos_id: int) -> tuple[Seq2SeqTransformer, dict]:
    """A `Seq2SeqTransformer` holding the Marian model of ``name`` (folder or hub name), and the
    architecture arguments it was built with; of ``network`` (the run's `Seq2SeqTransformer` arguments)
    the folder's architecture replaces all but the vocabulary facts, the dropout rates and ``similarity``. The
    data's vocabulary sizes, ``pad_id``, ``bos_id`` (the decoder's start token) and ``eos_id`` must be the folder's."""
    source = f"model.init_from={name}"
    folder = pretrained_folder(name, "model.init_from")
    config = read_config(folder, source, "marian")
    network = _with_defaults(Seq2SeqTransformer, network)
    if network["similarity"] != "scaled_dot":
        raise ValueError(
            f"{source}: Marian was trained with scaled dot-product attention; set model.similarity=scaled_dot"
        )
    theirs = {
        "src_vocab_size": config["vocab_size"],
        "tgt_vocab_size": config.get("decoder_vocab_size") or config["vocab_size"],
        "pad_id": config["pad_token_id"],
        "bos_id": config["decoder_start_token_id"],
        "eos_id": config["eos_token_id"],
    }
    ours = {**network, "bos_id": bos_id, "eos_id": eos_id}
    _check_linked(source, {k: (ours[k], theirs[k]) for k in theirs})
    arguments = marian_arguments(config, source)
    model = Seq2SeqTransformer(**{**network, **arguments})
    _load(model, marian_to_attnlab(read_state(folder, source)), source)
    return model, arguments
