"""zoo.offload(..., prefetch=True): a reader thread reads experts ahead (the routed ones the cache lacks, and those
the next layer's router picks for this layer's input); the tokens are those of the model without it."""
import gc
import threading

import pytest
import torch

import zoo
from tests.tiny import padded_batch, tiny_native
from zoo.moe import kernels
from zoo.moe.layout import sync_layout
from zoo.moe.quantized import QuantizedExperts
from zoo.runtime import prefetch as prefetch_module
from zoo.runtime.decode import greedy
from zoo.runtime.offloaded import ExpertCache
from zoo.runtime.offloading import cache_of

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
IDS = torch.tensor([[5, 17, 33, 9, 70, 11]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """fp32 tiny checkpoints: Mixtral (2 layers x 4 experts) with dense and with packed experts of mixed widths, and
    OLMoE (2 layers x 8 experts, top-2)."""
    dense = zoo.convert(tiny_native("mixtral")).eval()
    packed = zoo.convert(tiny_native("mixtral", seed=1)).eval()
    for layer in packed.model.layers:
        layer.mlp.experts = QuantizedExperts.from_dense(layer.mlp.experts, [4, 8, 4, 2], group_size=32)
    sync_layout(packed)
    out = {}
    for name, model in (("dense", dense), ("packed", packed), ("olmoe", zoo.convert(tiny_native("olmoe")).eval())):
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out


def consistent(cache: ExpertCache) -> None:
    """The cache's books after the reader thread is done: within its budget, nothing pinned or being read."""
    cache.prefetcher.drain()
    assert cache.resident == sum(n for _, n in cache.entries.values())
    assert cache.max_experts is None or len(cache.entries) <= cache.max_experts
    assert not cache.pinned and not cache._loading and cache._unused <= set(cache.entries)
    assert cache.prefetch_errors == 0


@pytest.mark.parametrize("kind,cache_experts,reader", [("dense", 2, "pread"), ("dense", 3, "mmap"),
                                                       ("packed", 3, "pread"), ("olmoe", 4, "pread")])
@torch.no_grad()
def test_same_tokens_and_logits_as_without_prefetch(saved, kind, cache_experts, reader):
    ref = zoo.load(saved[kind]).eval()
    off = zoo.offload(saved[kind], cache_experts=cache_experts, reader=reader)
    ahead = zoo.offload(saved[kind], cache_experts=cache_experts, reader=reader, prefetch=True)
    ids, mask = padded_batch()
    with kernels.turned_off():  # offloaded experts run the sorted dispatch: the reference on the same path
        want = off(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(ahead(input_ids=ids, attention_mask=mask).logits, want)
        if kind != "olmoe":  # (OLMoE's in-memory experts add in another order: 1 ulp apart, prefetch or not)
            assert torch.equal(ref(input_ids=ids, attention_mask=mask).logits, want)
        tokens = greedy(ref, IDS, 10, compile=False)
    assert torch.equal(greedy(ahead, IDS, 10, compile=False), tokens)
    assert torch.equal(greedy(off, IDS, 10, compile=False), tokens)
    plain, stats = cache_of(off).stats(), cache_of(ahead).stats()
    consistent(cache_of(ahead))
    assert stats["prefetch"] and not plain["prefetch"]
    assert stats["hits"] + stats["misses"] == plain["hits"] + plain["misses"]  # one lookup per expert run
    assert stats["misses"] == sum(cache_of(ahead).missed.values())  # (reads ahead are counted apart)
    assert stats["bytes_read"] > 0 and 0 < stats["peak_resident_bytes"]
    assert 0 <= stats["predictor_hit_rate"] <= 1


@torch.no_grad()
def test_lookups_match_and_reads_ahead_are_used(saved, monkeypatch):
    """With the thread's jobs done before each layer computes (drained), every lookup is a hit or a miss as
    without prefetch, reads ahead are used, and the decode never waits."""
    ahead = zoo.offload(saved["olmoe"], cache_experts=6, prefetch=True)
    cache = cache_of(ahead)
    plain = zoo.offload(saved["olmoe"], cache_experts=6)

    def drained(*args):
        cache.prefetcher.drain()
        return run_sorted(*args)

    run_sorted = prefetch_module.run_sorted
    monkeypatch.setattr(prefetch_module, "run_sorted", drained)
    assert torch.equal(greedy(ahead, IDS, 8, compile=False), greedy(plain, IDS, 8, compile=False))
    consistent(cache)
    assert cache.hits + cache.misses == cache_of(plain).hits + cache_of(plain).misses  # one lookup per expert run
    assert cache.prefetched > 0 and cache.prefetch_used > 0 and cache.waits == 0
    assert cache.misses < cache_of(plain).misses  # the reads ahead took misses off the decode path
    assert cache.stats()["hit_rate"] > cache_of(plain).stats()["hit_rate"]


@torch.no_grad()
def test_predictor_rate_against_a_reference(saved):
    """The predictor's record equals one computed by hand: layer 1's router applied to layer 0's block input,
    against the experts layer 1 chose; the prediction runs the router's forward, so router hooks see one call."""
    ahead = zoo.offload(saved["olmoe"], cache_experts=4, prefetch=True)
    blocks = [layer.mlp for layer in ahead.model.layers]
    inputs, chosen, calls = [], [], [0, 0]
    blocks[0].register_forward_pre_hook(lambda mod, args: inputs.append(args[0].reshape(-1, args[0].shape[-1])))

    def count(i):
        def hook(mod, args, out):
            calls[i] += 1
            if i == 1:
                chosen.append({e for e in out.indices.reshape(-1).tolist() if e < 8})
        return hook

    for i, block in enumerate(blocks):
        block.router.register_forward_hook(count(i))
    greedy(ahead, IDS, 6, compile=False)
    right = of = 0
    for x, used in zip(inputs, chosen, strict=True):
        named = {e for e in blocks[1].router.forward(x).indices.reshape(-1).tolist() if e < 8}
        right, of = right + len(named & used), of + len(used)
    cache = cache_of(ahead)
    assert (cache.predicted_right, cache.predicted_of) == (right, of) and of > 0
    assert calls == [len(inputs), len(inputs)]  # one router call per block per forward: the prediction is unseen
    assert cache.stats()["predictor_hit_rate"] == right / of


def fake(nbytes=10):
    return lambda: (torch.nn.Linear(1, 1), nbytes)


def test_reads_ahead_never_evict_pinned_experts_or_each_other():
    cache = ExpertCache(max_experts=2)
    cache.get("a", fake())
    cache.get("b", fake())
    cache.pinned = {"a"}  # the current layer's expert yet to run
    assert cache.read_ahead("c", fake(), 10)  # evicts b, the least recently used one not pinned
    assert list(cache.entries) == ["a", "c"] and cache.prefetched == 1
    assert not cache.read_ahead("d", fake(), 10)  # room only by evicting a (pinned) or c (read ahead): skipped
    assert list(cache.entries) == ["a", "c"] and cache.prefetch_skipped == 1
    assert not cache.read_ahead("c", fake(), 10)  # already there: nothing read
    cache.get("c", fake())
    assert cache.prefetch_used == 1 and cache.hits == 1
    cache.get("d", fake(), 10)  # the decode's own read may evict what was read ahead, not what is pinned
    assert list(cache.entries) == ["a", "d"] and cache.misses == 3


def test_a_read_ahead_evicts_the_layer_the_forward_reaches_last():
    """Decode visits the layers in a cycle: a read for layer 2 evicts layer 1's expert (just run, next needed a whole
    cycle later), not layer 3's, the least recently used but needed next after layer 2."""
    cache = ExpertCache(max_experts=3)
    cache.cycle = {0: 0, 1: 1, 2: 2, 3: 3}
    for key in ((3, 0), (0, 0), (1, 0)):  # the previous token's layer 3, then this token's layers 0 and 1
        cache.get(key, fake())
    assert cache.read_ahead((2, 5), fake(), 10)
    assert list(cache.entries) == [(3, 0), (0, 0), (2, 5)]  # layer 1's went, not the least recently used
    assert cache.read_ahead((3, 1), fake(), 10)  # layer 0's now (layer 2's, further, was read ahead: kept)
    assert list(cache.entries) == [(3, 0), (2, 5), (3, 1)]
    cache.get((0, 1), fake(), 10)  # the decode's own reads evict the least recently used, as without a thread
    assert list(cache.entries) == [(2, 5), (3, 1), (0, 1)]


def test_a_lookup_waits_for_the_threads_read_and_a_failed_read_is_retried():
    cache = ExpertCache(max_experts=4)
    started, go, loads = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        go.wait(10)
        loads.append("thread")
        return torch.nn.Linear(1, 1), 10

    thread = threading.Thread(target=cache.read_ahead, args=("a", slow, 10))
    thread.start()
    started.wait(10)
    threading.Timer(0.2, go.set).start()
    module = cache.get("a", lambda: loads.append("decode") or (torch.nn.Linear(1, 1), 10), 10)
    thread.join(10)
    assert loads == ["thread"] and module is cache.entries["a"][0]
    assert (cache.waits, cache.hits, cache.misses, cache.prefetch_used) == (1, 1, 0, 1)

    def broken():
        raise OSError("disk gone")

    with pytest.raises(OSError):
        cache.read_ahead("b", broken, 10)
    assert not cache._loading and "b" not in cache.entries  # nothing left half-read: the next lookup reads it
    cache.get("b", fake())
    assert cache.misses == 1 and "b" in cache.entries


def test_the_thread_stops_when_closed_or_collected(saved):
    off = zoo.offload(saved["dense"], cache_experts=2, prefetch=True)
    thread = cache_of(off).prefetcher.thread
    assert thread.is_alive() and thread.daemon
    with torch.no_grad():
        want = greedy(off, IDS, 4, compile=False)
        cache_of(off).close()
        assert not thread.is_alive() and cache_of(off).prefetcher is None
        assert torch.equal(greedy(off, IDS, 4, compile=False), want)  # reads on the decode path again
    off = zoo.offload(saved["dense"], cache_experts=2, prefetch=True)
    thread = cache_of(off).prefetcher.thread
    with torch.no_grad():
        greedy(off, IDS, 4, compile=False)
    del off
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_bad_prefetch_options_are_refused_before_anything_is_read(saved, tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="prefetch must be True or False"):
            zoo.offload(tmp_path / "nothing here", prefetch=bad)  # refused before the path is looked at
    for budget in ({}, {"cache_experts": 2}):
        with pytest.raises(ValueError, match="reader='in-place' reads none"):
            zoo.offload(saved["dense"], reader="in-place", prefetch=True, **budget)
    with pytest.raises(ValueError, match="cache_experts=0 keeps none"):
        zoo.offload(saved["dense"], cache_experts=0, prefetch=True)
    threads = threading.active_count()
    zoo.offload(saved["dense"], cache_experts=2)  # off by default: no thread
    assert threading.active_count() == threads
