"""transformers' model tests for mixtral: native classes and zoo classes (see README.md)."""
from .zoo_variants import classes_for

globals().update(classes_for("mixtral", __name__))
