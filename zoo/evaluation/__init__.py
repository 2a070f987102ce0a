"""Measuring models: perplexity and expert usage, lm-evaluation-harness tasks, the claims' one verdict rule.
Imports io and the MoE core."""
from zoo import submodules

__getattr__ = submodules(__name__)
