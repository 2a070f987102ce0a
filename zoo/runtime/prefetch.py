"""Reading offloaded experts ahead of their use (``zoo.offload(..., prefetch=True)``): one background reader thread
per expert cache, after FloE's prefetch of the next layer's experts while the current layer computes ("FloE:
On-the-Fly MoE Inference on Memory-constrained GPU", Zhou et al., ICML 2025, arXiv:2505.05950).

When layer i's experts run, the decode thread hands the reader thread a fresh queue (what was left of the previous
layer's is dropped): (a) the experts layer i's router chose that the cache lacks, but the first, which the decode
thread reads itself at once, so the others' reads overlap its compute; then (b) the experts layer i+1's router
chooses for layer i's input (the usual next-layer predictor: the residual stream changes little between layers).
The cache (``ExpertCache``) keeps all consistent under its lock: a lookup of an expert the thread is reading waits
for that read, the current layer's routed experts are pinned (nothing evicts them before they run), and the
thread's reads for layer i+1 never evict each other; a read ahead evicts first the layers the forward reaches last
(plain LRU would evict layer i+1's own experts of the previous token). What is computed is unchanged: the same
bytes in the same one-expert modules, run by the same sorted dispatch.

Measured (docs/offload.md): on a 2-core machine whose page cache holds the checkpoint, a read is a memory copy that
competes with the matmuls for the same cores and memory bandwidth, and the predictor (~55% right on the random
304M model) adds reads: decode is slower with the thread than without, hence ``prefetch=False`` by default.

The thread holds the cache only through weak references: it stops when the cache is garbage collected, or at
``cache.close()`` (which also waits for it).
"""
from __future__ import annotations

import threading
import weakref
from collections import deque

import torch

from zoo.moe import context
from zoo.moe.block import unwrapped
from zoo.moe.dispatch import run_sorted


def predicts(block) -> bool:
    """Whether the experts of ``block`` see the block's input as is (no input projection or norm, no per-slot rows):
    only then is their input what the next layer's router can be applied to."""
    return (block.input_proj is None and block.input_norm is None and block.expert_output_norm is None
            and not block.weights_scale_input)


class Prefetcher:
    """The reader thread of one ``ExpertCache``. ``links``: MoE layer -> (the next MoE layer's
    ``OffloadedExperts``, its block), for the layers whose experts' input predicts the next layer's choice."""

    routed, predicted = True, True  # which reads it makes ahead: (a) and (b) of the module docstring (measuring)

    def __init__(self, cache, links: dict, experts: list):
        for module in experts:  # built here: the thread only copies them (see OffloadedExperts.empty)
            for e in range(module.num_experts):
                module.empty(e)
        self.cache, self.links = cache, dict(links)
        self._guess: dict[int, set] = {}  # next layer -> the experts the predictor named for it
        self._jobs: deque = deque()
        self._wake = threading.Condition()  # guards the jobs and the state; notified at each change
        self._state = _State()
        self.thread = threading.Thread(target=_serve, args=(self._jobs, self._wake, self._state), daemon=True,
                                       name="zoo-expert-prefetch")
        self.thread.start()
        self._finalizer = weakref.finalize(self, _signal, self._jobs, self._wake, self._state)

    def close(self) -> None:
        """Stops the thread (a read in progress ends first) and waits for it."""
        self._finalizer()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def drain(self) -> None:
        """Waits until the thread has done every job queued so far (tests; a benchmark's clean cut)."""
        with self._wake:
            self._wake.wait_for(lambda: self._state.stop or not (self._jobs or self._state.busy))

    def run(self, experts, hidden: torch.Tensor, routing, expert=None) -> torch.Tensor:
        """``run_sorted`` over ``experts`` (an ``OffloadedExperts``) with ``expert(e, x)`` (``experts.expert`` if
        None), with the reads described in the module docstring queued first."""
        layer, count, cache = experts.layer, experts.num_experts, self.cache
        chosen = sorted({e for e in routing.indices.reshape(-1).tolist() if 0 <= e < count})
        self._score(layer, chosen)
        guess = self._predict(layer, hidden) if self.predicted else None
        with cache.lock:
            cache.pinned = {(layer, e) for e in chosen}
            cache._ahead.clear()
            missing = [e for e in chosen if (layer, e) not in cache.entries]
            # the first expert is read on the decode thread at once when it is missing; the rest by the reader
            # thread meanwhile (whichever thread reaches an expert first reads it, the other waits for that read)
            ahead = missing[1:] if missing and missing[0] == chosen[0] else missing
            jobs = [(weakref.ref(experts), e) for e in ahead] if self.routed else []
            if guess is not None:
                upcoming, named = guess
                for e in named:
                    key = (upcoming.layer, e)
                    if key in cache.entries:  # kept: the most recently used, and out of the thread's reach
                        cache.entries.move_to_end(key)
                        cache._ahead.add(key)
                    else:
                        jobs.append((weakref.ref(upcoming), e))
        with self._wake:
            self._jobs.clear()
            self._jobs.extend(jobs)
            self._wake.notify_all()
        try:
            return run_sorted(hidden, routing.indices, routing.weights, count, expert or experts.expert)
        finally:
            with cache.lock:
                cache.pinned = set()

    def _predict(self, layer: int, hidden: torch.Tensor):
        """(the next MoE layer's experts, the experts its router chooses for ``hidden``), or None. The router's
        ``forward``, not its call: hooks (router-logit recorders, usage statistics) see only the real routing."""
        link = self.links.get(layer)
        if link is None:
            return None
        upcoming, block = link
        router = unwrapped(block.router)
        with torch.no_grad():
            routing = router.forward(hidden, context.current()) if router.uses_context else router.forward(hidden)
        named = sorted({e for e in routing.indices.reshape(-1).tolist() if 0 <= e < upcoming.num_experts})
        self._guess[upcoming.layer] = set(named)
        return upcoming, named

    def _score(self, layer: int, chosen: list) -> None:
        """The predictor's record: of the experts this layer chose, how many the previous layer named."""
        named = self._guess.pop(layer, None)
        if named is not None:
            with self.cache.lock:
                self.cache.predicted_right += len(named.intersection(chosen))
                self.cache.predicted_of += len(chosen)


class _State:
    stop = False  # asked to end
    busy = False  # a job is running


def _serve(jobs: deque, wake: threading.Condition, state: _State) -> None:
    """The reader thread: (experts weak reference, expert) jobs, until stopped. It holds nothing of the model
    between jobs, so the model can be collected while it waits."""
    while True:
        with wake:
            state.busy = False
            wake.notify_all()
            wake.wait_for(lambda: jobs or state.stop)
            if state.stop:
                return
            ref, e = jobs.popleft()
            state.busy = True
        experts = ref()
        if experts is not None:
            try:
                experts.read_ahead(e)
            except Exception:  # e.g. a corrupt expert: the decode thread's own read of it raises the error
                with experts.cache.lock:
                    experts.cache.prefetch_errors += 1
        del experts, ref


def _signal(jobs: deque, wake: threading.Condition, state: _State) -> None:
    with wake:
        state.stop = True
        jobs.clear()
        wake.notify_all()
