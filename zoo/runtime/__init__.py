"""Running models: greedy decode, its ahead-of-time step, expert offloading. Imports io, editing's statistics
and the MoE core."""
from zoo import submodules

__getattr__ = submodules(__name__)
