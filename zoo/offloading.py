"""``zoo.offload(path, cache_experts=...)``: a model whose experts stay in its safetensors checkpoint.

Everything but the routed experts is loaded into memory (embeddings, attention, norms, routers, shared experts, LM
head); each MoE layer's experts become ``zoo.moe.offloaded.OffloadedExperts``, which read an expert's bytes from
the checkpoint when the router picks it and keep the recently used ones in one LRU cache for the whole model.
Experts are stored as the checkpoint stores them: dense, or in the zoo's packed int8/4/3/2 forms after
``zoo.apply(model, "quantize", ...)`` (the compressed storage FloE offloads; see docs/offload.md for what of FloE
is and is not here). Decode eagerly: ``zoo.decode.greedy(model, ids, n, compile=False)`` or ``model.generate``.
"""
from __future__ import annotations

import numbers
from collections import defaultdict

import torch

from zoo.checkpoint import LAYER_KEY, Checkpoint, CheckpointError
from zoo.moe.offloaded import (READERS, ExpertCache, NotOffloadable, OffloadedExperts, ShardReader, check_offloadable,
                               one_expert_plan)
from zoo.options import suggest


def _check_options(cache_experts, cache_bytes, reader):
    from zoo.stream import parse_bytes

    if cache_experts is not None and (isinstance(cache_experts, bool) or not isinstance(cache_experts, numbers.Integral)
                                      or cache_experts < 0):
        raise ValueError(f"cache_experts must be a whole number >= 0 or None, got {cache_experts!r}")
    if reader not in READERS:
        raise ValueError(f"unknown reader {reader!r}{suggest(str(reader), READERS)} (choose from {', '.join(READERS)})")
    if cache_bytes is None:
        return cache_experts, None
    size = parse_bytes(cache_bytes)
    if size < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes!r}")
    return cache_experts, size


def offload(path, cache_experts: int | None = None, cache_bytes=None, reader: str = "pread"):
    """The zoo checkpoint at ``path`` (a folder or a shipped model's name) with its experts offloaded.

    ``cache_experts``: how many experts (over all layers) the cache keeps; ``cache_bytes`` (``"512MB"`` or a number):
    how many bytes they may take. Either, both, or neither (no limit: every expert is read once, on first use).
    ``reader``: ``"pread"`` (plain reads, the default) or ``"mmap"`` (safetensors' memory map). The cache is
    ``zoo.offloading.cache_of(model)``: hits, misses, bytes read. Options are checked and every expert tensor of
    the checkpoint is looked up before anything is loaded: a missing one fails with its name."""
    from zoo.stream import resolve

    cache_experts, cache_bytes = _check_options(cache_experts, cache_bytes, reader)
    ckpt = Checkpoint(resolve(path))
    if ckpt.native:
        raise NotOffloadable(f"{ckpt.path} is a native {ckpt.family.name} checkpoint: offloading reads a zoo checkpoint "
                             "(experts fused per layer); convert it first (zoo.stream.convert(src, out))")
    blocks = _moe_blocks(ckpt)
    if not blocks:
        raise NotOffloadable(f"{ckpt.path} has no MoE layers: there are no experts to offload")
    files = ShardReader(ckpt.files, reader)
    largest = _check_expert_tensors(ckpt, files, blocks)
    if cache_bytes is not None and cache_experts != 0 and cache_bytes < largest:
        raise ValueError(f"cache_bytes={cache_bytes} cannot hold one expert ({largest} bytes); give at least that, "
                         "or cache_experts=0 for no cache")
    cache = ExpertCache(cache_experts, cache_bytes)
    for i, layer in enumerate(ckpt.layers):
        if i in blocks:
            _load_layer_without_experts(ckpt, i, files, cache)
        else:
            ckpt.load_layer(i)
    model = ckpt.model
    model.config.name_or_path = ckpt.path  # its tokenizer, for zoo.loading.tokenizer_for
    return model


def cache_of(model) -> ExpertCache:
    """The expert cache of a model from ``zoo.offload`` (one for all its layers)."""
    for module in model.modules():
        if isinstance(module, OffloadedExperts):
            return module.cache
    raise ValueError("this model has no offloaded experts (open it with zoo.offload)")


def _moe_blocks(ckpt) -> dict:
    from zoo.layout import get_block
    from zoo.moe import SparseMoE

    return {i: get_block(layer) for i, layer in enumerate(ckpt.layers) if isinstance(get_block(layer), SparseMoE)}


def _experts_prefix(ckpt, i: int) -> str:
    return f"model.layers.{i}.{ckpt.family.block_attr}.experts."


def _check_expert_tensors(ckpt, files: ShardReader, blocks: dict) -> int:
    """Every stored tensor of every layer's experts present with the shape and dtype its kind expects (the
    stored dtype: the checkpoint's, or the packed kinds' own); returns the largest expert's bytes."""
    largest = 0
    for i, block in blocks.items():
        stored, prefix = block.experts, _experts_prefix(ckpt, i)
        check_offloadable(stored)
        for name, t in stored.state_dict().items():
            key = prefix + name
            if key not in ckpt.files:
                raise NotOffloadable(f"{ckpt.path} lacks tensor {key}")
            dtype, shape, _, _ = files.info(key)
            if shape != tuple(t.shape):
                raise NotOffloadable(f"{ckpt.path}: tensor {key} has shape {shape}, the layout needs {tuple(t.shape)}")
            if dtype.is_floating_point != t.dtype.is_floating_point:
                raise NotOffloadable(f"{ckpt.path}: tensor {key} is {dtype}, the layout needs {t.dtype}")
        for e in range(stored.num_experts):
            _, rows = one_expert_plan(stored, e)
            nbytes = 0
            for name in rows:
                _, shape, _, size = files.info(prefix + name)
                nbytes += size // shape[0]
            largest = max(largest, nbytes)
    return largest


def _load_layer_without_experts(ckpt, i: int, files: ShardReader, cache: ExpertCache) -> None:
    """Decoder layer i in memory but for its experts, which become ``OffloadedExperts`` over the checkpoint."""
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import local_torch_dtype

    from zoo.layout import build_block, get_block, put_block

    old = ckpt.layers[i]
    prefix = _experts_prefix(ckpt, i)
    with no_init_weights(), local_torch_dtype(ckpt.dtype), torch.device("meta"):
        layer = type(old)(ckpt.config, i)
        block = build_block(get_block(old).layout())
    block.experts = OffloadedExperts(block.experts, i, prefix, files, cache)
    put_block(layer, block)
    layer.to_empty(device="cpu")
    layer.eval()
    for module in layer.modules():  # non-persistent buffers (rotary tables, index tables) as the model builds them
        if module._non_persistent_buffers_set:
            ckpt.model._init_weights(module)
    ckpt.layers[i] = layer
    keys = defaultdict(list)
    for file, names in ckpt.by_layer.get(i, {}).items():
        keys[file] = [k for k in names if not k.startswith(prefix)]
    missing = ckpt._load(ckpt.model, keys, lambda k: LAYER_KEY.match(k) and k.startswith(f"model.layers.{i}."))
    if missing:
        raise CheckpointError(f"{ckpt.path} lacks tensors of layer {i}: {sorted(missing)[:5]}")


__all__ = ["offload", "cache_of", "NotOffloadable"]
