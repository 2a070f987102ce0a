"""``zoo.offload(path, cache_experts=...)``: a model whose experts stay in its safetensors checkpoint (FloE-style
expert offloading: "FloE: On-the-Fly MoE Inference on Memory-constrained GPU", ICML 2025, arXiv:2505.05950).

Everything but the routed experts is loaded into memory (embeddings, attention, norms, routers, shared experts, LM
head); each MoE layer's experts become ``zoo.runtime.offloaded.OffloadedExperts``, which read an expert's bytes from
the checkpoint when the router picks it and keep the recently used ones in one LRU cache for the whole model.
Experts are stored as the checkpoint stores them: dense, or in the zoo's packed int8/4/3/2 forms after
``zoo.apply(model, "quantize", ...)`` (the compressed storage FloE offloads; see docs/offload.md for what of FloE
is and is not here). Decode eagerly: ``zoo.runtime.decode.greedy(model, ids, n, compile=False)`` or ``model.generate``.
"""
from __future__ import annotations

import copy
import numbers
from collections import defaultdict

import torch

from zoo.architectures.family import Family
from zoo.io import finite
from zoo.io.checkpoint import Checkpoint, CheckpointError
from zoo.moe.quantized import QuantizedExperts
from zoo.runtime.offloaded import (READERS, ExpertCache, NotOffloadable, OffloadedExperts, ShardReader, check_offloadable,
                               one_expert_plan)
from zoo.runtime.mapped import can_release, keep_within
from zoo.components.options import suggest
from zoo.moe.layout import layer_prefix


def _check_options(cache_experts, cache_bytes, reader, prefetch=False):
    from zoo.io.memory import parse_bytes

    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
    if prefetch and reader == "in-place":
        raise ValueError("prefetch=True reads experts ahead into the cache's memory, and reader='in-place' reads none "
                         "into memory of its own (the operating system reads the mapped file): leave out prefetch or "
                         "use reader='pread'")
    if prefetch and cache_experts == 0:
        raise ValueError("prefetch=True reads experts ahead into the cache, and cache_experts=0 keeps none: give the "
                         "cache room (cache_experts >= 1) or leave out prefetch")
    if cache_experts is not None and (isinstance(cache_experts, bool) or not isinstance(cache_experts, numbers.Integral)
                                      or cache_experts < 0):
        raise ValueError(f"cache_experts must be a whole number >= 0 or None, got {cache_experts!r}")
    if reader not in READERS:
        raise ValueError(f"unknown reader {reader!r}{suggest(str(reader), READERS)} (choose from {', '.join(READERS)})")
    if reader == "in-place" and (cache_experts is not None or cache_bytes is not None) and not can_release():
        raise ValueError("reader='in-place' with cache_experts or cache_bytes gives back evicted experts' pages with "
                         "madvise(MADV_DONTNEED), which this system lacks: leave out the budget, or use reader='pread'")
    if cache_bytes is None:
        return cache_experts, None
    size = parse_bytes(cache_bytes)
    if size < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes!r}")
    return cache_experts, size


def offload(path, cache_experts: int | None = None, cache_bytes=None, reader: str = "pread", prefetch: bool = False):
    """The checkpoint at ``path`` (a folder or a shipped model's name: a zoo checkpoint, or a native one of a family
    whose conversion only renames keys) with its experts offloaded, its MoE blocks converted as ``zoo.load`` does.

    ``cache_experts``: how many experts (over all layers) the cache keeps; ``cache_bytes`` (``"512MB"`` or a number):
    how many bytes they may take. Either, both, or neither (no limit: every expert is read once, on first use).
    ``reader``: ``"pread"`` (plain reads, the default) or ``"mmap"`` (safetensors' memory map), both into the cache;
    or ``"in-place"``: no reads of the zoo's own, each layer's expert tensors are views of the memory-mapped
    checkpoint (as llama.cpp maps a GGUF file), computed where they lie, by the experts' own module (so the zoo's
    kernel runs on them); the page cache holds what was touched and the operating system drops it under memory
    pressure. Without a budget every touched page stays in the process; with ``cache_experts`` / ``cache_bytes``
    the least recently routed experts beyond it have their pages given back, to be faulted in again when routed
    (``zoo.runtime.mapped``: no copies; the compiled step keeps the budget too). It needs each layer's experts
    stored as fused tensors in the model's dtype (a zoo checkpoint). The cache is
    ``zoo.runtime.offloading.cache_of(model)``: hits, misses, bytes read. ``prefetch=True`` (the cache modes): one
    background thread reads, while a layer computes, its routed experts the cache lacks and those the next layer's
    router picks for this layer's input (``zoo.runtime.prefetch``; same tokens; ``cache_of(model).close()`` stops it,
    as collecting the model does). Options are checked and every expert tensor of the checkpoint is looked up
    before anything is loaded: a missing one fails with its name."""
    from zoo.editing.stream import resolve

    import zoo

    cache_experts, cache_bytes = _check_options(cache_experts, cache_bytes, reader, prefetch)
    ckpt = Checkpoint(resolve(path))
    if ckpt.native:
        fam = type(ckpt.family)
        if fam.to_zoo_state is not Family.to_zoo_state or fam.from_native is not Family.from_native:
            raise NotOffloadable(f"{ckpt.path} is a native {ckpt.family.name} checkpoint, whose experts the zoo reshapes "
                                 "when it converts them: convert it first (zoo.editing.stream.convert(src, out))")
        zoo.convert(ckpt.model)  # the skeleton's blocks as zoo blocks (meta), as zoo.editing.stream.open_checkpoint does
    blocks = _moe_blocks(ckpt)
    if not blocks:
        raise NotOffloadable(f"{ckpt.path} has no MoE layers: there are no experts to offload")
    files = ShardReader(ckpt.files, reader)
    keys = {i: _expert_keys(ckpt, i, block.experts) for i, block in blocks.items()}
    largest = _check_expert_tensors(ckpt, files, blocks, keys)
    if cache_bytes is not None and cache_experts != 0 and cache_bytes < largest:
        raise ValueError(f"cache_bytes={cache_bytes} cannot hold one expert ({largest} bytes); give at least that, "
                         "or cache_experts=0 for no cache")
    cache = ExpertCache(cache_experts, cache_bytes)
    if reader == "in-place":
        _check_mappable(ckpt, files, blocks, keys)
        budget = cache_experts is not None or cache_bytes is not None
        place = lambda experts, i: _mapped(experts, i, keys[i], files, cache if budget else None)  # noqa: E731
    else:
        place = lambda experts, i: OffloadedExperts(experts, i, keys[i], files, cache)  # noqa: E731
    for i, layer in enumerate(ckpt.layers):
        if i in blocks:
            _load_layer_without_experts(ckpt, i, keys[i], place)
        else:
            ckpt.load_layer(i)
    model = ckpt.model
    model.config.name_or_path = ckpt.path  # its tokenizer, for zoo.io.loading.tokenizer_for
    if prefetch:
        _start_prefetch(cache, _moe_blocks(ckpt))
    return model


def _start_prefetch(cache: ExpertCache, blocks: dict) -> None:
    """The cache's reader thread, each MoE layer linked to the next one's router where its experts' input is the
    block's input (``zoo.runtime.prefetch``); a router that reads the previous layer's router state is not run
    ahead (the state is not there yet)."""
    from zoo.moe.block import unwrapped
    from zoo.runtime.prefetch import Prefetcher, predicts

    layers = sorted(blocks)
    links = {i: (blocks[j].experts, blocks[j]) for i, j in zip(layers, layers[1:])
             if predicts(blocks[i]) and not unwrapped(blocks[j].router).carries_state}
    cache.cycle = {layer: place for place, layer in enumerate(layers)}
    cache.prefetcher = Prefetcher(cache, links, [blocks[i].experts for i in layers])


def cache_of(model) -> ExpertCache:
    """The expert cache of a model from ``zoo.offload`` (one for all its layers; in place, the budget's)."""
    for module in model.modules():
        if isinstance(module, OffloadedExperts):
            return module.cache
        if getattr(module, "mapped_books", None) is not None:
            return module.mapped_books.cache
    raise ValueError("this model has no offloaded experts, or none held to a budget (open it with zoo.offload)")


def _moe_blocks(ckpt) -> dict:
    from zoo.moe.layout import get_block
    from zoo.moe import SparseMoE

    return {i: get_block(layer) for i, layer in enumerate(ckpt.layers) if isinstance(get_block(layer), SparseMoE)}


def _expert_keys(ckpt, i: int, stored) -> dict[str, str]:
    """Each stored tensor of layer i's experts -> its name in the checkpoint (a native checkpoint names them by the
    family's own key names: the zoo's renames reversed)."""
    prefix = f"{layer_prefix(ckpt.model, i, ckpt.family)}{ckpt.family.block_attr}."
    names = {f"experts.{n}": n for n in stored.state_dict()}
    if not ckpt.native:
        return {n: prefix + z for z, n in names.items()}
    keys = {names[z]: prefix + k for k, z in zip(ckpt.family.to_native_state(dict.fromkeys(names)), names)}
    if all(k in ckpt.files for k in keys.values()) or set(keys) != {"gate_up_proj", "down_proj"}:
        return keys
    return _per_expert_keys(ckpt, i) or keys  # (none found: the check names the fused tensor it looked for)


# how checkpoints that store each expert apart name its matrices: (gate, up, down), as transformers reads them
PER_EXPERT = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _per_expert_keys(ckpt, i: int) -> dict | None:
    """Layer i's per-expert tensor names, e.g. ``model.layers.0.block_sparse_moe.experts.{e}.w1.weight`` (what
    transformers writes for Mixtral), as the sources of the fused ``gate_up_proj`` (gate rows, then up rows: the
    order transformers' own conversion concatenates them in) and ``down_proj``."""
    for gate, up, down in PER_EXPERT:
        prefix = layer_prefix(ckpt.model, i, ckpt.family)
        found = [k for k in ckpt.files if k.startswith(prefix) and k.endswith(f".experts.0.{gate}.weight")]
        if len(found) == 1:
            base = found[0][: -len(f"0.{gate}.weight")]
            return {"gate_up_proj": [f"{base}{{e}}.{gate}.weight", f"{base}{{e}}.{up}.weight"],
                    "down_proj": [f"{base}{{e}}.{down}.weight"]}
    return None


def _sources(key, num_experts: int) -> list[list[str]]:
    """Per expert, the checkpoint tensors one stored tensor's row comes from (a fused tensor: the same one)."""
    return [[key]] * num_experts if isinstance(key, str) else [[k.format(e=e) for k in key] for e in range(num_experts)]


def _check_expert_tensors(ckpt, files: ShardReader, blocks: dict, keys: dict) -> int:
    """Every stored tensor of every layer's experts present with the shape and dtype its kind expects (the
    stored dtype: the checkpoint's, or the packed kinds' own); returns the largest expert's bytes."""
    largest = 0
    for i, block in blocks.items():
        stored = block.experts
        check_offloadable(stored)
        row_bytes = {}
        for name, t in stored.state_dict().items():
            if isinstance(keys[i][name], str):
                need = [tuple(t.shape)]
            else:  # per-expert matrices concatenated along their first dimension into one row
                need = [(t.shape[1] // len(keys[i][name]), *t.shape[2:])] * len(keys[i][name])
            for e, sources in enumerate(_sources(keys[i][name], t.shape[0])):
                row_bytes[name, e] = 0
                for key, shape_needed in zip(sources, need):
                    if key not in ckpt.files:
                        raise NotOffloadable(f"{ckpt.path} lacks tensor {key}")
                    dtype, shape, _, size = files.info(key)
                    if shape != shape_needed:
                        raise NotOffloadable(f"{ckpt.path}: tensor {key} has shape {shape}, the layout needs "
                                             f"{shape_needed}")
                    if dtype.is_floating_point != t.dtype.is_floating_point:
                        raise NotOffloadable(f"{ckpt.path}: tensor {key} is {dtype}, the layout needs {t.dtype}")
                    row_bytes[name, e] += size // shape[0] if isinstance(keys[i][name], str) else size
        for e in range(stored.num_experts):
            _, rows = one_expert_plan(stored, e)
            largest = max(largest, sum(row_bytes[name, row] for name, row in rows.items()))
    return largest


def _check_mappable(ckpt, files: ShardReader, blocks: dict, keys: dict) -> None:
    """NotOffloadable unless every expert tensor is one fused tensor of exactly the dtype the module holds (a view
    of the file cannot be converted or concatenated without becoming a copy)."""
    for i, block in blocks.items():
        for name, t in block.experts.state_dict().items():
            key = keys[i][name]
            if not isinstance(key, str):
                raise NotOffloadable(f"{ckpt.path} stores each expert's matrices apart ({key[0].format(e=0)}, ...): "
                                     "they cannot be used in place as one stack; convert it first "
                                     "(zoo.editing.stream.convert(src, out)) or use reader='pread'")
            dtype = files.info(key)[0]
            if dtype != t.dtype:
                raise NotOffloadable(f"{ckpt.path}: tensor {key} is stored as {dtype}, the model holds it as {t.dtype}: "
                                     "it cannot be used in place; save the model in its dtype or use reader='pread'")


def _mapped(stored, i: int, keys: dict, files: ShardReader, cache: ExpertCache | None):
    """Layer i's experts module of the stored kind whose tensors are views of the memory-mapped checkpoint (held to
    ``cache``'s budget when there is one)."""
    tensors = {name: files.mapped(keys[name]) for name in stored.state_dict()}
    bad = finite.non_finite(tensors.items()) if finite.enabled() and cache is None else []  # (budget: on first use)
    if bad:
        raise NotOffloadable(f"NaN or inf in the experts of layer {i} ({', '.join(bad)}): the checkpoint is corrupt")
    experts = copy.deepcopy(stored)  # (on meta: the kind and its options, nothing allocated)
    experts.load_state_dict(tensors, assign=True, strict=True)
    if isinstance(experts, QuantizedExperts):  # its index tables, which a load never fills (not saved)
        experts.register_buffer("width_of", torch.tensor(experts.bits), persistent=False)
        experts.register_buffer("slot_of", torch.tensor(experts.slot), persistent=False)
    if cache is not None:
        keep_within(experts, i, keys, files, cache)
    return experts


def _load_layer_without_experts(ckpt, i: int, keys: dict, place) -> None:
    """Decoder layer i in memory but for its experts, which ``place(experts on meta, i)`` makes (``OffloadedExperts``
    over the checkpoint, or the experts mapped in place). A native block is loaded as the family's own (its experts
    a placeholder) and converted as ``zoo.convert`` converts it."""
    from transformers.initialization import no_init_weights
    from transformers.modeling_utils import local_torch_dtype

    from zoo.moe.layout import build_block, get_block, put_block

    old = ckpt.layers[i]
    with no_init_weights(), local_torch_dtype(ckpt.dtype), torch.device("meta"):
        layer = type(old)(ckpt.config, i)
        block = get_block(layer) if ckpt.native else build_block(get_block(old).layout())
    # the experts stay on meta, out of the layer, while the rest is allocated and loaded: nothing of them is read
    stored, block.experts = block.experts, torch.nn.Module()
    if not ckpt.native:
        put_block(layer, block)
    layer.to_empty(device="cpu")
    layer.eval()
    for module in layer.modules():  # non-persistent buffers (rotary tables, index tables) as the model builds them
        if module._non_persistent_buffers_set:
            ckpt.model._init_weights(module)
    ckpt.layers[i] = layer
    count = get_block(old).experts.num_experts
    expert_keys = {k for key in keys.values() for sources in _sources(key, count) for k in sources}
    by_file = defaultdict(list)
    for file, names in ckpt.by_layer.get(i, {}).items():
        by_file[file] = [k for k in names if k not in expert_keys]
    prefix = layer_prefix(ckpt.model, i, ckpt.family)
    missing = ckpt._load(ckpt.model, by_file, lambda k: k.startswith(prefix))
    if missing:
        raise CheckpointError(f"{ckpt.path} lacks tensors of layer {i}: {sorted(missing)[:5]}")
    if ckpt.native:
        block.experts = stored
        block = ckpt.family.from_native(block, ckpt.config)  # the router etc. as zoo.convert makes them
        stored = block.experts
    block.experts = place(stored, i)
    put_block(layer, block)


__all__ = ["offload", "cache_of", "NotOffloadable"]
