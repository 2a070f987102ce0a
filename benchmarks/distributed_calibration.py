"""Benchmark: streamed ``moe-zoo apply`` with its calibration split over 2 processes (``torchrun``, gloo) against
one process on the same cores, on a random Mixtral-shaped checkpoint it writes itself; both must write the same
tensors (checked here, as tests/test_distributed_calibration.py does on a tiny model).

    python benchmarks/distributed_calibration.py            # 4 layers of hidden 1024 (0.9 GB), 4096 tokens
    python benchmarks/distributed_calibration.py --smoke    # 2 tiny layers, 512 tokens

One process gets all the threads (``--threads``, default the cores); each of N processes gets threads / N.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from scale import make_checkpoint, same_tensors  # noqa: E402


def timed(cmd, threads) -> float:
    env = {**os.environ, "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--recipe", nargs="+", default=["prune-reap:num_experts=4"])
    ap.add_argument("--workdir", default=None, help="where the checkpoint and outputs go (default: a temporary folder)")
    args = ap.parse_args(argv)
    shape = (dict(layers=2, hidden=64, intermediate=128, vocab=8192, heads=4, kv_heads=2) if args.smoke else
             dict(layers=4, hidden=1024, intermediate=2816, vocab=16384, heads=8, kv_heads=4))
    tokens = 512 if args.smoke else 4096
    root = args.workdir or tempfile.mkdtemp(prefix="dist-cal-")
    try:
        src = make_checkpoint(os.path.join(root, "src"), **shape)
        apply = ["apply", src, *args.recipe, "--calibration", f"mixed:{tokens}", "--stream", "--out"]
        one, many = os.path.join(root, "one"), os.path.join(root, "many")
        rows = []
        for out in (one, many):
            shutil.rmtree(out, ignore_errors=True)
        # alternate the two arms, so that a drift of the machine's speed falls on both
        t1 = timed([sys.executable, "-m", "zoo.cli", *apply, one], args.threads)
        tn = timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(args.processes), "-m", "zoo.cli", *apply, many], max(1, args.threads // args.processes))
        same = same_tensors(one, many)
        rows.append((t1, tn))
        print(f"checkpoint: {shape}, {tokens} calibration tokens, recipe {' '.join(args.recipe)}")
        print(f"{'arm':34} {'wall s':>8}")
        print(f"{'1 process, ' + str(args.threads) + ' threads':34} {t1:8.1f}")
        print(f"{f'{args.processes} processes (torchrun, gloo)':34} {tn:8.1f}")
        print(f"ratio (1 process / {args.processes}): {t1 / tn:.2f}x; same tensors: {same}")
        if not same:
            raise SystemExit("the two arms wrote different tensors")
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
