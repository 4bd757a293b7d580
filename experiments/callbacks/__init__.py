"""Callbacks shared by every experiment, one job per module; the class paths in configs name them from here
(``experiments.callbacks.PredictionWriter``, ``experiments.callbacks.LearningRateScaling`` ...)."""

from experiments.callbacks.attention_logits import MaxAttentionLogit
from experiments.callbacks.attention_sinks import AttentionSinks
from experiments.callbacks.base import shadowed
from experiments.callbacks.compile import Compile
from experiments.callbacks.monitors import GradientNorm, Throughput
from experiments.callbacks.predictions import PredictionWriter
from experiments.callbacks.quantization import W8A8
from experiments.callbacks.scaling import LearningRateScaling
from experiments.callbacks.summary import RunSummary

__all__ = [
    "AttentionSinks",
    "Compile",
    "GradientNorm",
    "LearningRateScaling",
    "MaxAttentionLogit",
    "PredictionWriter",
    "RunSummary",
    "Throughput",
    "W8A8",
    "shadowed",
]
