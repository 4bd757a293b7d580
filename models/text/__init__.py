"""Text on the core: the encoder-decoder for translation (`seq2seq`), the decoder-only LM (`lm`), decoding on the
caches, the GPT-2, Marian and Llama importers (`hf`), and their LightningModules."""

import importlib

# the classes configs name, as ``models.text.<Class>``; each is imported when first asked for
_EXPORTS = {
    "TranslationModule": "models.text.translation_module",
    "LanguageModelModule": "models.text.lm_module",
    "Seq2SeqTransformer": "models.text.seq2seq",
    "DecoderOnlyLM": "models.text.lm",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
