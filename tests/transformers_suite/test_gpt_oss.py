"""transformers' model tests for gpt_oss: native classes and zoo classes (see README.md)."""
from .zoo_variants import classes_for

globals().update(classes_for("gpt_oss", __name__))
