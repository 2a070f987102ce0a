"""transformers' model tests for deepseek_v3: native classes and zoo classes (see README.md)."""
from .zoo_variants import classes_for

globals().update(classes_for("deepseek_v3", __name__))
