"""Changing models: apply, the layer-at-a-time engine, streaming from shards, calibration, expert statistics,
snapshots, consolidation. Imports io, the architectures and the MoE core."""
from zoo import submodules

__getattr__ = submodules(__name__)
