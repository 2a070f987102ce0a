"""Experts used where they lie in the memory-mapped checkpoint (``zoo.offload(path, reader="in-place")``), held to a
budget of resident memory (``cache_experts`` / ``cache_bytes``).

In place, the kernel reads each routed expert's rows straight from the file's pages: nothing is copied, and a page
the process has not touched is faulted in from the page cache (or the disk) as it is read. Without a budget every
touched page stays in the process. With one, the layer's routed experts are looked up in the model's
``ExpertCache`` before each call, as the cache modes look them up, and the least recently used experts of all
layers beyond the budget are evicted: their pages are given back (``ShardReader.release_row``), to be faulted in
again when routed. A miss costs page faults where the cache modes copy the expert into memory of their own (the
304M model on an AVX2 processor, 50% of the experts, eager decode: ~0.8x of in memory at bf16 against the copying
cache's ~0.6x; benchmarks/offload.py).
"""
from __future__ import annotations

import mmap

from zoo.io import finite
from zoo.runtime.offloaded import ExpertCache, NotOffloadable, ShardReader, one_expert_plan

EAGER_ONLY = "in-place experts held to a budget are looked up on the host (the router's choice decides)"


def can_release() -> bool:
    """Whether this system gives back a mapped file's pages on request (``madvise(MADV_DONTNEED)``)."""
    return hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")


class MappedExpert:
    """The cache's entry for one expert used in place: its rows of the layer's mapped tensors. Nothing is read to
    make it; ``release`` gives its pages back."""

    __slots__ = ("reader", "rows")

    def __init__(self, reader: ShardReader, rows: list[tuple[str, int]]):
        self.reader, self.rows = reader, rows  # (checkpoint tensor name, row)

    def release(self) -> None:
        for key, row in self.rows:
            self.reader.release_row(key, row)


def keep_within(experts, layer: int, keys: dict[str, str], reader: ShardReader, cache: ExpertCache) -> None:
    """Holds layer ``layer``'s mapped ``experts`` (views of ``reader``'s maps; ``keys``: each of its tensors' name in
    the checkpoint) to ``cache``'s budget: hooks on its calls look up the routed experts before it runs (evicting
    others beyond the budget) and give back, after it ran, the pages of those the cache did not keep (a budget
    smaller than one call's experts, or 0). An expert's rows are checked for NaN and inf on its first miss (at
    open they would all be read: the whole model resident at once). Such a model decodes eagerly
    (``eager_only_reason``)."""
    tensors = experts.state_dict()
    plans = {e: one_expert_plan(experts, e)[1] for e in range(experts.num_experts)}
    entries = {e: MappedExpert(reader, [(keys[name], row) for name, row in rows.items()]) for e, rows in plans.items()}
    sizes = {e: sum(reader.row_bytes(key) for key, _ in entry.rows) for e, entry in entries.items()}
    checked: set[int] = set()
    used: list[int] = []  # the experts of the call in flight

    def miss(e: int):
        for key, _ in entries[e].rows:  # (a file cut short under its map would fault with SIGBUS on the read)
            reader.check(key)
        if e not in checked and finite.enabled():
            bad = finite.non_finite((name, tensors[name][row:row + 1]) for name, row in plans[e].items())
            if bad:
                raise NotOffloadable(f"NaN or inf in expert {e} of layer {layer} ({', '.join(bad)}): the checkpoint "
                                     "is corrupt")
        checked.add(e)
        return entries[e], sizes[e]

    def before(module, args, kwargs):
        routing = args[1] if len(args) > 1 else kwargs["routing"]
        used[:] = [e for e in routing.indices.unique().tolist() if e < experts.num_experts]  # (E: an empty slot)
        with cache.lock:
            cache.pinned.update((layer, e) for e in used)  # none of this call's evicts another
        for e in used:
            cache.get((layer, e), lambda e=e: miss(e), sizes[e])

    def after(module, args, kwargs, output):
        for e in used:
            if (layer, e) not in cache.entries:
                entries[e].release()
        used.clear()

    experts.eager_only_reason = EAGER_ONLY
    experts.mapped_cache = cache  # (``zoo.runtime.offloading.cache_of``)
    experts.register_forward_pre_hook(before, with_kwargs=True)
    experts.register_forward_hook(after, with_kwargs=True)
