"""Every callback of the suite, one job per module; the class paths in configs name them from here
(``experiments.callbacks.PredictionWriter``, ``experiments.callbacks.DetectionImages`` ...). Beside them, what only
they use: the attention statistics (`attention_stats`), sinks (`sinks`) and simulated W8A8 (`w8a8`) they measure."""

from experiments.callbacks.attention_logits import MaxAttentionLogit
from experiments.callbacks.attention_maps import AttentionMapLogger
from experiments.callbacks.attention_sinks import AttentionSinks
from experiments.callbacks.base import shadowed
from experiments.callbacks.compile import Compile
from experiments.callbacks.detection import DetectionImages, DetectionWriter
from experiments.callbacks.float8 import Float8Training
from experiments.callbacks.guards import NonFiniteLoss
from experiments.callbacks.interrupts import ExactResume, LastCheckpoint
from experiments.callbacks.monitors import GradientNorm, Throughput
from experiments.callbacks.predictions import PredictionWriter
from experiments.callbacks.quantization import W8A8
from experiments.callbacks.scaling import LearningRateScaling
from experiments.callbacks.summary import RunSummary
from experiments.callbacks.text import LanguageModelSamples, TranslationSamples
from experiments.callbacks.time_budget import LearningRateLog, TimeBudget

__all__ = [
    "AttentionMapLogger",
    "AttentionSinks",
    "Compile",
    "DetectionImages",
    "DetectionWriter",
    "ExactResume",
    "Float8Training",
    "GradientNorm",
    "LanguageModelSamples",
    "LastCheckpoint",
    "LearningRateLog",
    "LearningRateScaling",
    "MaxAttentionLogit",
    "NonFiniteLoss",
    "PredictionWriter",
    "RunSummary",
    "Throughput",
    "TimeBudget",
    "TranslationSamples",
    "W8A8",
    "shadowed",
]
