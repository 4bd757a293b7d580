"""Text on the core: the encoder-decoder for translation (`seq2seq`), the decoder-only LM (`lm`), decoding on the
caches, the GPT-2, Marian and Llama importers (`hf`), and their LightningModules."""

# the classes configs name, as ``models.text.<Class>``
from models.text.lm import DecoderOnlyLM
from models.text.lm_module import LanguageModelModule
from models.text.seq2seq import Seq2SeqTransformer
from models.text.translation_module import TranslationModule

__all__ = ["DecoderOnlyLM", "LanguageModelModule", "Seq2SeqTransformer", "TranslationModule"]
