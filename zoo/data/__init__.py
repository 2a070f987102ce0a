"""Offline training data for the zoo's own small models: a shipped two-domain corpus and its BPE tokenizer.

Names are imported lazily so that ``python -m zoo.data.corpus`` runs cleanly and the corpus needs no transformers.
"""
from importlib import import_module

_EXPORTS = {"DOMAINS": "corpus", "SPLITS": "corpus", "SEPARATOR": "corpus", "CorpusChecksumError": "corpus",
            "build_corpus": "corpus", "load_split": "corpus", "load_text": "corpus",
            "load_tokenizer": "tokenizer", "train_tokenizer": "tokenizer"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f"zoo.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'zoo.data' has no attribute {name!r}")
