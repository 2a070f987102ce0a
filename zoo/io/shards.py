"""Writing a checkpoint as its tensors arrive: numbered safetensors shards and their index, as transformers
names them, so a model far larger than memory is written one layer at a time (a shard a layer: a layer is
never held once it is done)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

DEFAULT_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size


class ShardWriter:
    """``add(tensors)`` buffers tensors and writes a shard whenever ``max_bytes`` is reached; ``close()`` names
    the shards ``model-0000i-of-0000n.safetensors`` (one shard: ``model.safetensors``) and writes the index."""

    def __init__(self, folder, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder, self.max_bytes = os.fspath(folder), int(max_bytes)
        self.buffer: dict[str, torch.Tensor] = {}
        self.buffered = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary file name, keys)
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, t in tensors.items():
            if key in self.buffer or any(key in keys for _, keys in self.shards):
                raise ValueError(f"tensor {key} written twice")
            self.buffer[key] = t.detach().to("cpu").contiguous()
            self.buffered += t.numel() * t.element_size()
        if self.buffered >= self.max_bytes:
            self.flush()

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """``tensors`` in a shard of their own, written now (a streamed layer: nothing of it is held after)."""
        self.flush()
        self.add(tensors)
        self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"part-{len(self.shards):05d}.safetensors"
        save_file(self.buffer, os.path.join(self.folder, name), metadata={"format": "pt"})
        self.shards.append((name, list(self.buffer)))
        self.total += self.buffered
        self.buffer, self.buffered = {}, 0

    def close(self) -> dict[str, str]:
        """Final shard names and the index; returns ``{tensor: file}``."""
        self.flush()
        n = len(self.shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), final in zip(self.shards, names):
            os.replace(os.path.join(self.folder, tmp), os.path.join(self.folder, final))
            weight_map.update({k: final for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return weight_map
