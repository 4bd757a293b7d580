"""Text data: sources, tokenizers, preparation into the token store, batching, and the DataModules for translation
(`ParallelTextDataModule`) and language modelling (`TextCorpusDataModule`)."""

# the classes configs name, as ``datamodules.text.<Class>``
from datamodules.text.corpus import TextCorpusDataModule
from datamodules.text.parallel import ParallelTextDataModule
from datamodules.text.tokenizers import BOS_ID, EOS_ID, PAD_ID

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "ParallelTextDataModule", "TextCorpusDataModule"]
