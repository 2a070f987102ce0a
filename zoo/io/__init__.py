"""Reading and writing checkpoints: the lazy checkpoint reader, shards, atomic saves, finite checks, load,
convert, export (native, GGUF, compressed-tensors), adapter folders. Imports the architectures and the MoE core."""
from zoo import submodules

__getattr__ = submodules(__name__)
