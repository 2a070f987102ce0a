"""Where the layer-at-a-time engine spends its time: seconds per phase, summed over layers and passes since the last
``reset()`` (read the layer's tensors, capture and carry the calibration tokens, statistics passes, compress,
write). ``benchmarks/scale.py --phases`` reads it for docs/scale.md's time model."""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

SECONDS: defaultdict[str, float] = defaultdict(float)


@contextmanager
def phase(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        SECONDS[name] += time.perf_counter() - start


def reset() -> None:
    SECONDS.clear()
