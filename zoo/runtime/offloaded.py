"""Experts that stay in the checkpoint file: each routed expert is read from its safetensors shard when the router
picks it, and a small cache shared by all layers keeps the recently used ones (expert offloading, after FloE:
"FloE: On-the-Fly MoE Inference on Memory-constrained GPU", Zhou et al., ICML 2025, arXiv:2505.05950).

A zoo checkpoint stores a layer's experts fused along a first, expert dimension (``gate_up_proj [E, 2I, H]``; the
quantized kind one stack per bit width, ``gate_up_int4 [n4, 2I, H/2]``), so one expert is one contiguous row of
each tensor: it is read by its byte range alone, into a one-expert module of the stored kind, whose own
``expert(0, x)`` then computes exactly what the in-memory module's ``expert(e, x)`` computes (and inference reads
it on the zoo's kernel where the in-memory experts' call would: ``OffloadedExperts.on_kernel``). The host decides
what to read from the router's indices, so these experts run eagerly (``torch.compiler.disable``): a compiled
step cannot hold a cache on the host.
"""
from __future__ import annotations

import mmap
import os
import sys
import threading
from collections import Counter, OrderedDict

import torch

from zoo.moe import kernels
from zoo.io import finite
from zoo.io.checkpoint import DTYPES, CheckpointError, shard_header
from zoo.moe.dispatch import run_sorted
from zoo.moe.experts import Experts, SwiGLUExperts, use_kernel
from zoo.moe.quantized import QuantizedExperts
from zoo.moe.routing import Routing
from zoo.runtime.huge_pages import HUGE_PAGE

READERS = ("pread", "mmap", "in-place")  # in-place: no reads at all; the experts are the memory-mapped file


class NotOffloadable(CheckpointError):
    """The checkpoint or its experts cannot be offloaded (the message says why, naming the tensor)."""


class ExpertCache:
    """Least-recently-used experts of every layer within ``max_experts`` entries and/or ``max_bytes`` bytes
    (None: no limit of that kind). ``get(key, load)`` counts a hit or a miss; ``load() -> (module, nbytes)``.

    Shared with at most one reader thread (``zoo.runtime.prefetch``, ``zoo.offload(..., prefetch=True)``): every
    change is made under ``lock``, reads outside it. A key being read is in ``_loading`` until its read ends: a
    ``get`` of it waits for that read rather than reading it again. ``pinned`` keys (the current layer's routed
    experts not yet run) are never evicted; the thread's reads (``read_ahead``) also keep what it read for the
    coming layer (``_ahead``). A read in flight is memory beyond the budget (one expert per reading thread), as a
    read that cannot be kept always was."""

    def __init__(self, max_experts: int | None = None, max_bytes: int | None = None):
        self.max_experts, self.max_bytes = max_experts, max_bytes
        self.entries: OrderedDict = OrderedDict()  # (layer, expert) -> (module, nbytes), oldest first
        self.resident = self.peak_resident = 0
        self.missed: Counter = Counter()  # (layer, expert) -> reads on the decode path
        self.reset_counts()
        self.lock = threading.Lock()
        self.pinned: set = set()
        self.prefetcher = None  # zoo.runtime.prefetch.Prefetcher: the reader thread, when there is one
        self._loading: dict = {}  # key -> Event set when its read ends (kept or not)
        self._ahead: set = set()  # read ahead for the coming layer: the thread's later reads do not evict them
        self._unused: set = set()  # read ahead and not asked for yet
        self._local = threading.local()  # .spare: bytes -> evicted experts' buffers, for this thread's one load
        self.cycle: dict = {}  # layer -> its place in the forward's order (set with a reader thread), see read_ahead

    def __deepcopy__(self, memo):
        """A copy of the model (``copy.deepcopy``) gets a cache of its own with the same budget, empty, and no reader
        thread (``zoo.offload(..., prefetch=True)`` starts one for the model it opens): its experts are read again
        as they are routed. Nothing here can be copied as it is (a lock, events, thread-local buffers)."""
        new = memo[id(self)] = type(self)(self.max_experts, self.max_bytes)
        return new

    def __reduce__(self):
        raise NotOffloadable("an offloaded model cannot be pickled (torch.save of the model object): its experts live "
                             "in the checkpoint it was opened from; save the path and open it again with zoo.offload")

    def get(self, key, load, nbytes: int | None = None):
        """The cached module of ``key``, or ``load()``'s. ``nbytes``: the bytes a load will read, when known: room is
        made first, and the evicted experts' memory is what the load reads into (``take``)."""
        while True:
            with self.lock:
                self.pinned.discard(key)  # asked for: the caller holds it while it runs
                entry = self.entries.get(key)
                if entry is not None:
                    self.entries.move_to_end(key)
                    self.hits += 1
                    if key in self._unused:
                        self._unused.discard(key)
                        self.prefetch_used += 1
                    return entry[0]
                done = self._loading.get(key)
                if done is None:
                    spare = {}
                    if nbytes is not None:
                        self._evict_for(nbytes, self.pinned, spare)
                    done = self._loading[key] = threading.Event()
                    break
                self.waits += 1
            done.wait()  # the reader thread is reading it: kept, it is a hit on the next look
        return self._read(key, load, spare, done, ahead=False)

    def read_ahead(self, key, load, nbytes: int | None = None) -> bool:
        """Read ``key`` into the cache before it is asked for (the reader thread). Nothing when it is cached or being
        read; skipped (counted) when it cannot fit without evicting a pinned expert or one read for the coming
        layer. True when it was read."""
        with self.lock:
            if key in self.entries or key in self._loading:
                return False
            spare = {}
            room = nbytes is None or self._evict_for(nbytes, self.pinned | self._ahead, spare, self._soonest(key))
            if not room:
                self.prefetch_skipped += 1
                return False
            done = self._loading[key] = threading.Event()
        self._read(key, load, spare, done, ahead=True)
        return True

    def _soonest(self, key) -> list | None:
        """The cached keys in the order a read ahead for ``key`` evicts them: the layers the forward reaches last
        after ``key``'s layer first (the layer just run, then the one before...), least recently used first within
        a layer. Decode visits the layers in a cycle, where plain LRU would evict the very layer read for next."""
        if not self.cycle or not isinstance(key, tuple) or key[0] not in self.cycle:
            return None
        n, at = len(self.cycle), self.cycle[key[0]]
        return sorted(self.entries, key=lambda k: -((self.cycle.get(k[0], at) - at) % n))

    def _read(self, key, load, spare: dict, done, ahead: bool):
        self._local.spare = spare
        try:
            module, nbytes = load()
        except BaseException:
            with self.lock:
                del self._loading[key]
                done.set()
            raise
        finally:
            self._local.spare = {}  # what the load did not take is freed: spare memory lives for one load only
            spare.clear()
        with self.lock:
            self.bytes_read += nbytes
            if ahead:
                self.prefetched += 1
            else:
                self.misses += 1
                self.missed[key] += 1
            protect = self.pinned | self._ahead if ahead else self.pinned
            if self._evict_for(nbytes, protect, None, self._soonest(key) if ahead else None):
                self.entries[key] = (module, nbytes)
                self.resident += nbytes
                self.peak_resident = max(self.peak_resident, self.resident)
                if ahead:
                    self._ahead.add(key)
                    self._unused.add(key)
            elif ahead:
                self.prefetch_skipped += 1
            del self._loading[key]
            done.set()
        return module  # not kept (too large, a cache of 0 experts, or no room beside pinned ones): used once, freed

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 buffer of ``nbytes`` from an expert just evicted for this thread's load, or None. Reading into
        memory already mapped is ~8x faster than into fresh memory, whose pages the kernel must first fault in and
        zero (11.5 MB: 0.8 against 6.5 ms, measured)."""
        free = getattr(self._local, "spare", {}).get(nbytes)
        if not free:
            return None
        with self.lock:
            self.reads_into_evicted += 1
        return free.pop()

    def _fits(self, count: int, nbytes: int) -> bool:
        return ((self.max_experts is None or count <= self.max_experts)
                and (self.max_bytes is None or nbytes <= self.max_bytes))

    def _evict_for(self, nbytes: int, protect: set, spare: dict | None, order: list | None = None) -> bool:
        """Evicts experts not in ``protect``, least recently used first (or in ``order``), until one more of
        ``nbytes`` fits; False, and nothing evicted, when it cannot fit even so. Evicted memory nothing else holds
        goes to ``spare`` (None: freed)."""
        held = [k for k in protect if k in self.entries]
        if not self._fits(len(held) + 1, sum(self.entries[k][1] for k in held) + nbytes):
            return False
        victims = None if order is None else iter(order)  # (a list: the evictions leave it as it is)
        while not self._fits(len(self.entries) + 1, self.resident + nbytes):
            self._evict(next(k for k in (self.entries if victims is None else victims) if k not in protect), spare)
        return True

    def _evict(self, key, spare: dict | None) -> None:
        module, freed = self.entries.pop(key)
        self.resident -= freed
        self.evictions += 1
        self._ahead.discard(key)
        if key in self._unused:
            self._unused.discard(key)
            self.prefetch_wasted += 1
        _release_mapped(module)
        held = module.state_dict().values() if isinstance(module, torch.nn.Module) else []
        storages = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in held}.values())
        del held
        del module  # the cache's reference: its memory is free to read into unless something else holds it
        if spare is not None:
            self._keep_spare(storages, spare)

    @staticmethod
    def _keep_spare(storages: list, spare: dict) -> None:
        """An evicted module's storages, kept for the next load to read into: only those nothing else holds (a
        tensor of the module kept by a caller stays untouched). ``storages`` is emptied."""
        while storages:
            storage = storages.pop()
            if _only_held_here(storage):
                buf = torch.empty(0, dtype=torch.uint8).set_(storage)
                spare.setdefault(buf.numel(), []).append(buf)

    def clear(self) -> None:
        """Drops every cached expert (an expert used in place gives its pages back, as an eviction does)."""
        with self.lock:
            for module, _ in self.entries.values():
                _release_mapped(module)
            self.entries.clear()
            self._ahead.clear()
            self._unused.clear()
            self.resident = 0

    def close(self) -> None:
        """Stops the reader thread, if any (and waits for it): later reads happen on the decode path."""
        prefetcher, self.prefetcher = self.prefetcher, None
        if prefetcher is not None:
            prefetcher.close()

    def reset_counts(self) -> None:
        self.hits = self.misses = self.evictions = self.bytes_read = self.reads_into_evicted = 0
        # the reader thread's: reads, those later asked for, those evicted unused, those skipped for lack of room,
        # lookups that waited for its read; the predictor's: next-layer chosen experts it named, of all chosen
        self.prefetched = self.prefetch_used = self.prefetch_wasted = self.prefetch_skipped = self.waits = 0
        self.predicted_right = self.predicted_of = self.prefetch_errors = 0
        self.missed.clear()

    def stats(self) -> dict:
        looked = self.hits + self.misses
        out = {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / looked if looked else None,
               "evictions": self.evictions, "bytes_read": self.bytes_read,
               "reads_into_evicted": self.reads_into_evicted, "cached_experts": len(self.entries),
               "resident_bytes": self.resident, "peak_resident_bytes": self.peak_resident,
               "max_experts": self.max_experts, "max_bytes": self.max_bytes, "prefetch": self.prefetcher is not None}
        if self.prefetched or self.prefetcher is not None:
            out.update(prefetched=self.prefetched, prefetch_used=self.prefetch_used,
                       prefetch_wasted=self.prefetch_wasted, prefetch_skipped=self.prefetch_skipped, waits=self.waits,
                       prefetch_errors=self.prefetch_errors,
                       predictor_hit_rate=self.predicted_right / self.predicted_of if self.predicted_of else None)
        return out


def _release_mapped(entry) -> None:
    """An entry dropped from the cache: an expert used where it lies in the mapped file (``zoo.runtime.mapped``)
    gives its pages back; a module read into memory of its own is freed by its last reference going."""
    if hasattr(entry, "release"):
        entry.release()


def _only_held_here(storage) -> bool:
    """True when nothing but the caller's one reference holds this storage (no tensor, no other Python name)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # private: without it, nothing is reused
    return (use_count is not None and use_count(storage._cdata) == 1
            and sys.getrefcount(storage) <= _refs_when_held_once())


def _refs_when_held_once() -> int:
    """``sys.getrefcount`` of an object one local name holds, passed on as ``_only_held_here``'s caller passes its
    storage: measured, not assumed. It is 3 on CPython's usual call path (the name, the parameter, the argument), and
    one more once a frame-evaluation hook is installed, as torch 2.13's compiler leaves it after a ``fullgraph``
    compile that failed: calls then hold each argument once more, and a fixed 3 judged every storage held."""
    held = object()
    return _refcount_in_callee(held)


def _refcount_in_callee(obj) -> int:
    return sys.getrefcount(obj)


class ShardReader:
    """Rows (one index of the first dimension) of tensors in safetensors shards. ``pread``: plain reads of the
    row's bytes into memory of its own (what is resident is what the cache holds); ``mmap``: safetensors'
    memory map (``safe_open(...).get_slice``), whose touched file pages also count as the process's memory."""

    def __init__(self, files: dict[str, str], reader: str = "pread"):
        self.files, self.reader = files, reader  # tensor name -> shard file
        self._fds: dict[str, int] = {}
        self._handles: dict = {}
        self._maps: dict[str, mmap.mmap] = {}  # shard file -> its copy-on-write map (``mapped``)
        self._info: dict[str, tuple] = {}
        self._opened: dict[str, tuple] = {}  # shard file -> its identity when first read (``_identity``)

    def __deepcopy__(self, memo):
        """A reader of the same shards for a copy of the model, with file descriptors and maps of its own (shared
        ones would be closed under it when the original goes), that refuses the same changed files: the shards
        must still be what they were when the original model was opened."""
        new = memo[id(self)] = type(self)(dict(self.files), self.reader)
        new._opened = dict(self._opened)
        return new

    def _unchanged(self, file: str) -> None:
        """The shard must be the file it was when the model was opened: a rewrite, truncation or replacement since
        is refused (its header no longer describes it; the zoo never reads bytes it cannot place)."""
        try:
            now = _identity(file)
        except FileNotFoundError:
            raise NotOffloadable(f"{file} is gone since the model was opened: reopen it with zoo.offload") from None
        if self._opened.setdefault(file, now) != now:
            raise NotOffloadable(f"{file} has changed since the model was opened (rewritten or replaced): its experts "
                                 "cannot be read; reopen it with zoo.offload")

    def check(self, key: str) -> None:
        """NotOffloadable unless the shard holding ``key`` is still the file it was when first read."""
        self._unchanged(self.files[key])

    def info(self, key: str) -> tuple[torch.dtype, tuple, int, int]:
        """(dtype, shape, data offset, bytes) of a stored tensor (its shard's header parsed once)."""
        if key not in self._info:
            self._info[key] = self._read_info(key)
        return self._info[key]

    def _read_info(self, key: str) -> tuple[torch.dtype, tuple, int, int]:
        self._unchanged(self.files[key])
        start, header = shard_header(self.files[key])  # checked: dtypes, byte ranges inside the file
        info = header.get(key)
        if info is None:
            raise NotOffloadable(f"{self.files[key]} does not hold tensor {key} (the index names the wrong shard?)")
        begin, end = info["data_offsets"]
        return DTYPES[info["dtype"]], tuple(info["shape"]), start + begin, end - begin

    def row_bytes(self, key: str) -> int:
        dtype, shape, offset, nbytes = self.info(key)
        return nbytes // shape[0]

    def row(self, key: str, index: int, take=None) -> torch.Tensor:
        """``tensor[index : index + 1]`` of a stored tensor, read alone (``pread``: into ``take(nbytes)``'s buffer
        when it gives one)."""
        self._unchanged(self.files[key])
        if self.reader == "mmap":
            return self._handle(self.files[key]).get_slice(key)[index:index + 1]
        dtype, shape, offset, nbytes = self.info(key)
        size = self.row_bytes(key)
        return self._pread(key, offset + index * size, size, take).view(dtype).view(1, *shape[1:])

    def whole(self, key: str) -> torch.Tensor:
        """A whole stored tensor (one expert's own matrix, in a checkpoint that stores experts one by one)."""
        self._unchanged(self.files[key])
        if self.reader == "mmap":
            return self._handle(self.files[key]).get_tensor(key)
        dtype, shape, offset, nbytes = self.info(key)
        return self._pread(key, offset, nbytes).view(dtype).view(shape)

    def mapped(self, key: str) -> torch.Tensor:
        """The whole stored tensor as a view of the file's memory map (one map a shard): nothing is read until used,
        and the operating system's page cache keeps (and drops) its pages. Copy-on-write: a write to it changes this
        process's copy of that page, never the file."""
        self._unchanged(self.files[key])
        dtype, shape, offset, nbytes = self.info(key)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        file = self.files[key]
        if file not in self._maps:
            with open(file, "rb") as f:
                pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            _huge_pages(pages)
            self._maps.setdefault(file, pages)
        return torch.frombuffer(self._maps[file], dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)

    def release_row(self, key: str, index: int) -> int:
        """Gives back this process's pages of row ``index`` of a ``mapped`` tensor: ``MADV_DONTNEED``, after which a
        read of them faults them in again from the file (from the page cache, or the disk once the system has
        dropped them). A write made to them is lost. The range is the row's bytes widened to whole 2 MB pieces
        within the tensor (its first and last rows stop at the tensor's own pages): a huge page that holds the end
        of one row and the start of the next is given back whole, where giving back part of it splits its mapping
        into 4 KB pages for good (read again 64 KB a fault); the neighbouring row's part of it is faulted in again
        when that row is read. 304M model, 25% budget, compiled decode, interleaved: 1.025 / 1.035x with the
        checkpoint's page cache in 2 MB folios, 0.99x in small ones. Returns the bytes given back (none where this
        reader maps nothing of the shard: a copy's)."""
        dtype, shape, offset, nbytes = self.info(key)
        size, page = self.row_bytes(key), mmap.PAGESIZE
        begin = max((offset + index * size) // HUGE_PAGE * HUGE_PAGE, -(-offset // page) * page)
        end = min(-(-(offset + (index + 1) * size) // HUGE_PAGE) * HUGE_PAGE, (offset + nbytes) // page * page)
        pages = self._maps.get(self.files[key])
        if end <= begin or pages is None:
            return 0
        pages.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        return end - begin

    def uncache(self, key: str) -> None:
        """Drops the page cache's clean, unmapped pages of a ``mapped`` tensor, widened to the 2 MB pieces it
        touches (``POSIX_FADV_DONTNEED``; the file is untouched), so that its rows are read again from the disk
        through the map's ``MADV_HUGEPAGE`` in 2 MB folios, mapped and given back whole. Called on a tensor's first
        miss within a budget: pages cached in 4 KB folios (a file written by ``cp`` or a download and not yet
        dropped) would stay so, and each miss would map them one by one (304M model, 25% budget, compiled, a copy:
        179-195 tok/s, 266-281 with each expert's rows dropped at its first miss, whole tensors 1.04-1.15x more).
        Pages that any process maps, or not yet written back, stay where they are; nothing where the system has no
        such advice."""
        if not hasattr(os, "posix_fadvise"):
            return
        dtype, shape, offset, nbytes = self.info(key)
        begin, end = offset // HUGE_PAGE * HUGE_PAGE, -(-(offset + nbytes) // HUGE_PAGE) * HUGE_PAGE
        try:
            os.posix_fadvise(self._fd(self.files[key]), begin, end - begin, os.POSIX_FADV_DONTNEED)
        except OSError:  # advice: a file system that takes none reads the pages where they are
            pass

    def _fd(self, file: str) -> int:
        if file not in self._fds:  # (a reader thread may open it at the same time: one descriptor is kept)
            fd = os.open(file, os.O_RDONLY)
            if self._fds.setdefault(file, fd) != fd:
                os.close(fd)
        return self._fds[file]

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles.setdefault(file, safe_open(file, "pt"))
        return self._handles[file]

    def _pread(self, key: str, offset: int, size: int, take=None) -> torch.Tensor:
        buf = take(size) if take is not None else None
        buf = torch.empty(size, dtype=torch.uint8) if buf is None else buf
        file = self.files[key]
        if os.preadv(self._fd(file), [buf.numpy()], offset) != size:
            raise NotOffloadable(f"{file}: tensor {key} is cut short (the file is truncated)")
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._handles.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _huge_pages(pages: mmap.mmap) -> None:
    """Asks for the map's pages in 2 MB pieces (``MADV_HUGEPAGE``): the pages a fault reads from the disk then come
    as 2 MB folios of the page cache, each mapped (and given back) at one stroke, where 4 KB pages take one entry
    each. An expert given back and routed again (``reader="in-place"`` within a budget) costs ~0.1 ms to map again
    against ~1 ms for 11.5 MB of small pages, measured. Pages already in the page cache keep the size they have
    (within a budget a tensor's first miss drops them: ``ShardReader.uncache``). Advice only: nothing where the
    system has no such pages."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


def _identity(file: str) -> tuple:
    """The file's device, inode, size and modification time: a rewrite, truncation or replacement (a symbolic link
    pointed elsewhere too: ``stat`` follows it) changes it. One ``stat``, where ``file_key`` also resolves the path
    (~16 us against ~3): checked on every miss of an expert used in place."""
    st = os.stat(file)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def one_expert_plan(stored: Experts, e: int) -> tuple[dict, dict[str, int]]:
    """(options of a one-expert module of the stored kind, {its tensor: row of the stored tensor of that name}) for
    expert e. Quantized experts: the width's stack at the expert's slot (and the expert's own bias row); other
    kinds: every stored tensor's row e."""
    opts = {**stored.options(), "num_experts": 1}
    if isinstance(stored, QuantizedExperts):
        b, slot = stored.bits[e], stored.slot[e]
        rows = {name: slot for proj in stored.shapes for name in (f"{proj}_int{b}",
                f"{proj}_int{b}_scale" if b == 8 else f"{proj}_int{b}_scale_zero")}
        rows.update({name: e for name in ("gate_up_proj_bias", "down_proj_bias") if getattr(stored, name) is not None})
        return {**opts, "bits": [b]}, rows
    return opts, {name: e for name in stored.state_dict()}


def check_offloadable(stored: Experts) -> None:
    """NotOffloadable unless one expert of this kind can be read alone and computed by a one-expert module."""
    kind = type(stored)
    if not callable(getattr(kind, "expert", None)):
        raise NotOffloadable(f"experts kind {stored.name or kind.__name__!r} has no per-expert compute (expert(e, x))")
    if isinstance(stored, QuantizedExperts):
        return
    odd = [n for n, t in stored.state_dict().items() if t.dim() == 0 or t.shape[0] != stored.num_experts]
    extra = sorted(stored._non_persistent_buffers_set)
    if odd or extra:
        raise NotOffloadable(f"experts kind {stored.name or kind.__name__!r} stores tensors that are not one row per "
                             f"expert ({', '.join(odd + extra)}): it cannot be read one expert at a time")


def blank_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of an empty (meta) module for a load to fill: every container attribute its own, one level down
    (parameters, buffers, hooks, option lists), submodules copied alike; values inside them (the meta tensors a load
    replaces, options) shared. ``copy.deepcopy`` walked every object of the module: ~0.6 ms a miss on the 304M
    model's int4 experts, about as long as reading one of them."""
    new = object.__new__(type(module))
    new.__dict__ = {k: v.copy() if isinstance(v, (dict, list, set)) else v for k, v in module.__dict__.items()}
    new._modules = {name: None if m is None else blank_copy(m) for name, m in module._modules.items()}
    return new


def run_on_kernel(module: Experts, x: torch.Tensor) -> torch.Tensor:
    """A cached one-expert module on its tokens ``x`` read in place on ``zoo::moe_gemv`` (one slot of weight 1 a
    token): the kernel branch of its kind's forward, without that forward's own choice of path (the layer's call makes
    it, as the in-memory experts' does: ``OffloadedExperts.on_kernel``)."""
    return module._forward_kernel(x, Routing(x.new_ones(len(x), 1), x.new_zeros(len(x), 1, dtype=torch.long)))


class OffloadedExperts(Experts):
    """The experts of one layer, read from the checkpoint when routed (see the module docstring). ``stored``: the
    layer's experts module on the meta device (its kind, options and tensor names); ``keys``: each of its tensors'
    name in the checkpoint (``gate_up_proj`` -> ``model.layers.3.mlp.experts.gate_up_proj``), or, for a checkpoint
    that stores each expert's matrices apart, the names of the per-expert tensors concatenated into it, with
    ``{e}`` for the expert (``["...experts.{e}.w1.weight", "...experts.{e}.w3.weight"]``)."""

    name = "offloaded"
    summary = "Experts read from the checkpoint file when the router picks them, with an LRU cache (FloE-style offload)."
    paper = "FloE: On-the-Fly MoE Inference on Memory-constrained GPU (Zhou et al., ICML 2025), arXiv:2505.05950"
    eager_only_reason = "offloaded experts are read from the checkpoint on the host (the router's choice decides)"

    def __init__(self, stored: Experts, layer: int, keys: dict[str, str], reader: ShardReader, cache: ExpertCache):
        super().__init__()
        check_offloadable(stored)
        self.num_experts, self.layer, self.keys = stored.num_experts, layer, dict(keys)
        self.hidden_size = getattr(stored, "hidden_size", None)
        self.reader, self.cache = reader, cache
        self.__dict__["stored"] = stored  # not a submodule: its meta tensors are not the model's
        self._quantized = isinstance(stored, QuantizedExperts)
        self._empty: dict[str, Experts] = {}  # one-expert modules on meta, by options: copied, not rebuilt, per miss
        self._checked: set[int] = set()  # experts whose bytes were found finite
        self._bytes: dict[int, int] = {}  # expert -> bytes a read of it takes
        kind = type(stored).forward
        on_kernel = kind is SwiGLUExperts.forward or (kind is QuantizedExperts.forward and set(stored.widths) <= {4, 8})
        # the stored stacks' dtypes (empty tensors), which the in-memory kind's choice of path reads (on_kernel)
        self._stacks_like = [torch.empty(0, dtype=t.dtype) for t in stored.state_dict().values() if t.dim() >= 3] \
            if on_kernel else None

    def options(self) -> dict:
        raise NotOffloadable("an offloaded model cannot be saved or re-laid out: its experts live in the checkpoint "
                             "it was opened from; load that with zoo.load to work on it in memory")

    def num_parameters(self) -> int:
        return self.stored.num_parameters()

    def nbytes(self) -> int:
        return self.stored.nbytes()  # what the checkpoint holds; ``cache.resident`` is what memory holds

    def empty(self, e: int) -> Experts:
        """The one-expert module of expert e's options, on meta (built once per options). The reader thread only
        copies these: ``zoo.runtime.prefetch`` builds them all first, on the calling thread, since
        ``no_init_weights`` patches torch's init functions for the whole process while it builds one."""
        from transformers.initialization import no_init_weights

        opts, _ = one_expert_plan(self.stored, e)
        key = repr(sorted(opts.items()))
        if key not in self._empty:
            with no_init_weights(), torch.device("meta"):
                self._empty[key] = type(self.stored)(**opts)
        return self._empty[key]

    def load(self, e: int):
        """Expert e as a one-expert module of the stored kind, and the bytes read (``cache.get``'s loader)."""
        _, rows = one_expert_plan(self.stored, e)
        # a copy of the empty module: building one checks its options (~1 ms, most of a small expert's miss)
        module = blank_copy(self.empty(e))
        tensors = {name: self.reader.row(self.keys[name], row, self.cache.take) if isinstance(self.keys[name], str)
                   else torch.cat([self.reader.whole(k.format(e=row)) for k in self.keys[name]])[None]
                   for name, row in rows.items()}
        # checked on its first read: a later read of the same, unchanged file (each read checks that) gives the same
        # bytes, and the check costs as much as a third of a read
        bad = finite.non_finite(tensors.items()) if finite.enabled() and e not in self._checked else []
        if bad:
            raise NotOffloadable(f"NaN or inf in expert {e} of layer {self.layer} ({', '.join(bad)}): the checkpoint "
                                 "is corrupt")
        self._checked.add(e)
        module.load_state_dict(tensors, assign=True, strict=True)
        if self._quantized:  # its index tables, which a load never fills (not saved)
            module.register_buffer("width_of", torch.tensor(module.bits), persistent=False)
            module.register_buffer("slot_of", torch.tensor(module.slot), persistent=False)
        module.eval().requires_grad_(False)
        return module, sum(t.numel() * t.element_size() for t in tensors.values())

    def read_bytes(self, e: int) -> int | None:
        """The bytes a read of expert e takes (None where its matrices are stored apart and concatenated)."""
        if e not in self._bytes:
            _, rows = one_expert_plan(self.stored, e)
            keys = [self.keys[name] for name in rows]
            self._bytes[e] = sum(self.reader.row_bytes(k) for k in keys) if all(isinstance(k, str) for k in keys) \
                else None
        return self._bytes[e]

    def fetch(self, e: int):
        return self.cache.get((self.layer, e), lambda: self.load(e), self.read_bytes(e))

    def read_ahead(self, e: int) -> bool:
        """Expert e read into the cache before it is asked for (the prefetch thread's call)."""
        return self.cache.read_ahead((self.layer, e), lambda: self.load(e), self.read_bytes(e))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.fetch(e).expert(0, x)

    def on_kernel(self, hidden: torch.Tensor, routing) -> bool:
        """Whether this call's routed experts are read in place on the zoo's kernel: the choice the in-memory kind
        makes for the same call (``use_kernel``: inference, the kernel loaded, few pairs per selected expert, from its
        stacks' dtypes), for dense gated experts and int8 / int4 ones (2/3-bit ones would build an int4 working copy
        beside each cached expert, memory the cache does not count). Per expert, ``expert(0, x)`` widened a bf16 expert
        to fp32 or dequantised an int4 one on every call: the 304M model decoded ~5 tokens a second offloaded on an
        AVX2 processor, 0.03-0.07x of the same experts in memory."""
        return self._stacks_like is not None and use_kernel(hidden, routing, self.num_experts, *self._stacks_like,
                                                            packed=self._quantized)

    @torch.compiler.disable
    def forward(self, hidden: torch.Tensor, routing) -> torch.Tensor:
        # the in-memory kinds' eager path (the sorted dispatch), each routed expert fetched once per call
        if self._quantized or not torch.is_grad_enabled():
            kernels.load()  # as the in-memory kinds' forwards: inference on the kernel (on_kernel), int4 prefill
        expert = self.expert_on_kernel if self.on_kernel(hidden, routing) else self.expert
        prefetcher = self.cache.prefetcher
        if prefetcher is not None:  # the same dispatch, with reads ahead on the reader thread
            return prefetcher.run(self, hidden, routing, expert)
        return run_sorted(hidden, routing.indices, routing.weights, self.num_experts, expert)

    def expert_on_kernel(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return run_on_kernel(self.fetch(e), x)
