"""Run alone or under ``torchrun --nproc-per-node N``: streamed ``apply`` of each recipe on the same calibration
tokens, written by rank 0 to OUT/<recipe index>. tests/test_distributed_calibration.py compares the folders that 1
and 2 processes write.

    python tests/calibration_worker.py SRC OUT
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zoo.editing import distributed, stream  # noqa: E402

# statistics summed over ranks (REAP, frequencies, output sums), raw tokens gathered (error curves), routing sums
RECIPES = [
    [("prune-frequency", {"num_experts": 4, "allocation": "error"})],
    [("prune-reap", {"num_experts": 6}), ("hc-smoe", {"num_experts": 3})],
]
CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(i)) for i in range(5)]  # 5: uneven


def main(src: str, out: str) -> None:
    torch.set_num_threads(1)
    for n, recipe in enumerate(RECIPES):
        stream.apply(src, recipe, os.path.join(out, str(n)), calibration=CAL)
    rank, size = distributed.world()
    if rank == 0:
        with open(os.path.join(out, "world"), "w") as f:
            f.write(str(size))


if __name__ == "__main__":
    main(*sys.argv[1:3])
