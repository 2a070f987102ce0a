"""transformers' model tests for olmoe: native classes and zoo classes (see README.md)."""
from .zoo_variants import classes_for

globals().update(classes_for("olmoe", __name__))
