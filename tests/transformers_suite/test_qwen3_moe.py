"""transformers' model tests for qwen3_moe: native classes and zoo classes (see README.md)."""
from .zoo_variants import classes_for

globals().update(classes_for("qwen3_moe", __name__))
