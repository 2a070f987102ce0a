"""Experts used where they lie in the memory-mapped checkpoint (``zoo.offload(path, reader="in-place")``), held to a
budget of resident memory (``cache_experts`` / ``cache_bytes``).

In place, the kernel reads each routed expert's rows straight from the file's pages: nothing is copied, and a page
the process has not touched is faulted in from the page cache (or the disk) as it is read. Without a budget every
touched page stays in the process. With one, the layer's routed experts are looked up in the model's
``ExpertCache`` before each call, as the cache modes look them up, and the least recently used experts of all
layers beyond the budget are evicted: their pages are given back (``ShardReader.release_row``), to be faulted in
again when routed. A miss costs page faults where the cache modes copy the expert into memory of their own (the
304M model on an AVX2 processor, 50% of the experts, eager decode: 0.86-0.92 of the in-memory speed at bf16 against
the copying cache's 0.61-0.66; benchmarks/offload.py); cheapest where the page cache holds the experts in 2 MB
folios, mapped and given back whole, so a tensor's first miss has its cached pages dropped and read again from
the disk so (``ShardReader.uncache``). The lookups are an operation of their own
(``zoo::mapped_lookup``), so the compiled decode step keeps the budget too.
"""
from __future__ import annotations

import copy
import itertools
import mmap
import weakref

import torch

from zoo.io import finite
from zoo.runtime.offloaded import ExpertCache, NotOffloadable, ShardReader, one_expert_plan


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


class LayerBooks:
    """One layer's experts within the budget: their cache entries, sizes, and which were checked. ``lookup`` runs
    before the layer's experts compute (``zoo::mapped_lookup``), ``settle`` after."""

    _count = itertools.count()

    def __init__(self, experts, layer: int, keys: dict[str, str], reader: ShardReader, cache: ExpertCache):
        self.layer, self.reader, self.cache, self.num_experts = layer, reader, cache, experts.num_experts
        self.tensors = experts.state_dict()
        self.plans = {e: one_expert_plan(experts, e)[1] for e in range(experts.num_experts)}
        self.entries = {e: MappedExpert(reader, [(keys[name], row) for name, row in rows.items()])
                        for e, rows in self.plans.items()}
        self.sizes = {e: sum(reader.row_bytes(key) for key, _ in entry.rows) for e, entry in self.entries.items()}
        self.checked: set[int] = set()
        self.uncached: set[str] = set()  # tensors whose cached pages were dropped (at their first miss)
        self.used: list[int] = []  # the experts of the call in flight
        self.key = next(self._count)
        _BOOKS[self.key] = self

    def __deepcopy__(self, memo):
        """A copy of the model keeps books of its own (registered apart) over its copied cache: empty, as a copied
        cache is (``ExpertCache.__deepcopy__``)."""
        new = memo[id(self)] = object.__new__(type(self))
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "tensors"})
        new.tensors, new.key = {}, next(self._count)
        _BOOKS[new.key] = new
        return new

    def _miss(self, e: int):
        for key, _ in self.entries[e].rows:  # (a file cut short under its map would fault with SIGBUS on the read)
            self.reader.check(key)
            if key not in self.uncached:  # read from the disk once, in 2 MB folios (each later miss maps them whole)
                self.reader.uncache(key)
                self.uncached.add(key)
        if e not in self.checked and finite.enabled() and self.tensors:
            bad = finite.non_finite((name, self.tensors[name][row:row + 1]) for name, row in self.plans[e].items())
            if bad:
                raise NotOffloadable(f"NaN or inf in expert {e} of layer {self.layer} ({', '.join(bad)}): the "
                                     "checkpoint is corrupt")
        self.checked.add(e)
        return self.entries[e], self.sizes[e]

    def lookup(self, indices: torch.Tensor) -> None:
        """The call's routed experts looked up in the cache (misses read nothing; evictions give pages back), after
        the previous call's settled if it was not (a compiled step settles each call at the layer's next one)."""
        self.settle()
        # a set of the listed indices, not ``unique()``: one decode step's 2-8 indices in 0.2 us against 4.6
        self.used = sorted(e for e in set(indices.view(-1).tolist()) if e < self.num_experts)  # (E: an empty slot)
        with self.cache.lock:
            self.cache.pinned.update((self.layer, e) for e in self.used)  # none of this call's evicts another
        for e in self.used:
            self.cache.get((self.layer, e), lambda e=e: self._miss(e), self.sizes[e])

    def settle(self) -> None:
        """After the call: the pages of its experts the cache did not keep (a budget smaller than one call's
        experts, or 0) given back."""
        for e in self.used:
            if (self.layer, e) not in self.cache.entries:
                self.entries[e].release()
        self.used = []


_BOOKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # LayerBooks.key -> books (the model holds them)


# An operation the compiler cannot see into, so that the budget holds in the compiled decode step as in eager
# calls: the step keeps it (it writes ``ledger``), and runs it after the previous layer's experts (the routing it
# reads depends on their output). Defined on a ``Library`` with a CPU kernel alone rather than with ``custom_op``,
# whose Python wrappers (autograd, version counters) cost ~8 us a call where this one costs ~1.4: a call per layer
# and token, inside the compiled step too.
_LIBRARY = torch.library.Library("zoo", "FRAGMENT")
_LIBRARY.define("mapped_lookup(Tensor indices, Tensor(a!) ledger, int books) -> ()")


def mapped_lookup(indices: torch.Tensor, ledger: torch.Tensor, books: int) -> None:
    _BOOKS[books].lookup(indices)


_LIBRARY.impl("mapped_lookup", mapped_lookup, "CPU")


@torch.library.register_fake("zoo::mapped_lookup")
def _(indices, ledger, books):
    return None


def _before(module, args, kwargs):
    routing = args[1] if len(args) > 1 else kwargs["routing"]
    torch.ops.zoo.mapped_lookup(routing.indices, module.mapped_ledger, module.mapped_books.key)


def _after(module, args, kwargs, output):
    # eager calls settle at once; a compiled step leaves it to the layer's next lookup: an operation reading the
    # experts' output here would make the step round it to the model's dtype before the residual add, where the
    # step without a budget adds it unrounded (other tokens after ~25 on the 304M model)
    if not torch.compiler.is_compiling():
        module.mapped_books.settle()


def keep_within(experts, layer: int, keys: dict[str, str], reader: ShardReader, cache: ExpertCache) -> None:
    """Holds layer ``layer``'s mapped ``experts`` (views of ``reader``'s maps; ``keys``: each of its tensors' name in
    the checkpoint) to ``cache``'s budget: hooks on its calls look up the routed experts before it runs (evicting
    others beyond the budget) and give back, after it ran, the pages of those the cache did not keep. An expert's
    rows are checked for NaN and inf on its first miss (at open they would all be read: the whole model resident
    at once)."""
    experts.mapped_books = LayerBooks(experts, layer, keys, reader, cache)  # (its cache: ``cache_of``'s)
    experts.register_buffer("mapped_ledger", torch.zeros(1, dtype=torch.uint8), persistent=False)
    experts.register_forward_pre_hook(_before, with_kwargs=True)
    experts.register_forward_hook(_after, with_kwargs=True)
