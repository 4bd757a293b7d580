"""Text data: sources, tokenizers, preparation into the token store, batching, and the DataModules for translation
(`ParallelTextDataModule`) and language modelling (`TextCorpusDataModule`)."""

import importlib

# the classes configs name, as ``datamodules.text.<Class>``; each is imported when first asked for
_EXPORTS = {
    "ParallelTextDataModule": "datamodules.text.parallel",
    "TextCorpusDataModule": "datamodules.text.corpus",
    "BOS_ID": "datamodules.text.tokenizers",
    "EOS_ID": "datamodules.text.tokenizers",
    "PAD_ID": "datamodules.text.tokenizers",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
