"""Prefetch variants of offloaded experts in one process, rounds taking turns: the in-memory model, the cache
without prefetch, with both kinds of read ahead, with only the routed experts' reads (a) and with only the next
layer's predicted experts (b), at one cache share, on the 304M bf16 benchmark checkpoint (written to a temporary
folder). ``--sleep-ms`` adds a wait to every read (no CPU, the GIL released): a model of a slow disk, not a disk.

    python benchmarks/offload_prefetch.py --share 0.25
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import zoo
from decode import mixtral_shaped
from zoo.runtime.decode import greedy
from zoo.runtime.offloading import cache_of

VARIANTS = {"in memory": None, "off": None, "prefetch": (True, True), "(a) only": (True, False),
            "(b) only": (False, True)}


def slow_reads(seconds: float) -> None:
    from zoo.runtime.offloaded import ShardReader

    pread = ShardReader._pread

    def slow(self, *args, **kwargs):
        time.sleep(seconds)
        return pread(self, *args, **kwargs)

    ShardReader._pread = slow


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--share", type=float, default=0.25, help="cache size as a share of all experts")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.sleep_ms:
        slow_reads(args.sleep_ms / 1000)
    folder = tempfile.mkdtemp(prefix="offload-prefetch-")
    zoo.convert(mixtral_shaped(False)).eval().save_pretrained(folder)
    total = 32  # 4 layers x 8 experts
    models = {}
    for name, switches in VARIANTS.items():
        if name == "in memory":
            models[name] = zoo.load(folder).eval()
            continue
        model = zoo.offload(folder, cache_experts=round(total * args.share), prefetch=switches is not None)
        if switches is not None:
            cache_of(model).prefetcher.routed, cache_of(model).prefetcher.predicted = switches
        models[name] = model
    ids = torch.randint(3, 8192, (1, 16), generator=torch.Generator().manual_seed(0))
    speeds = {name: [] for name in models}
    with torch.no_grad():
        for model in models.values():
            greedy(model, ids, 4, compile=False)
        for _ in range(args.rounds):
            for name, model in models.items():
                cache = cache_of(model) if name != "in memory" else None
                start = time.perf_counter()
                greedy(model, ids, 1, compile=False)
                one = time.perf_counter() - start
                if cache is not None and cache.prefetcher is not None:
                    cache.prefetcher.drain()
                if cache is not None:
                    cache.reset_counts()
                start = time.perf_counter()
                greedy(model, ids, args.tokens, compile=False)
                speeds[name].append((args.tokens - 1) / (time.perf_counter() - start - one))
    memory = statistics.median(speeds["in memory"])
    print(f"cache {args.share:.0%} of the experts, {args.tokens} tokens, {args.threads} threads, {args.rounds} rounds "
          f"taking turns, extra wait per read {args.sleep_ms} ms")
    for name, model in models.items():
        s = cache_of(model).stats() if name != "in memory" else {}
        median = statistics.median(speeds[name])
        print(f"  {name:10} {median:6.1f} tok/s ({median / memory:.2f}"
              f" of in memory) runs {[round(v, 1) for v in speeds[name]]} hit rate {rate(s.get('hit_rate'))} "
              f"predictor {rate(s.get('predictor_hit_rate'))} MB read {s.get('bytes_read', 0) / 1e6:.0f}")


def rate(value) -> str:
    return "-" if value is None else f"{value:.0%}"


if __name__ == "__main__":
    main()
