"""Publishing: model cards, the Hub (exact pushes), shipping the zoo's models, masking tokens in errors.
Imports evaluation, io and below."""
from zoo import submodules

__getattr__ = submodules(__name__)
