"""Training the zoo's own models and fine-tuning adapters. Imports editing, evaluation, io and below."""
from zoo import submodules

__getattr__ = submodules(__name__)
