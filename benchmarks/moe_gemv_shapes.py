"""zoo::moe_gemv on the expert shapes of the MoE models people run: each stored form's read speed as a share of the
machine's read bandwidth measured in the same rounds, one row per projection, in one run, with the processor's flags.

    python benchmarks/moe_gemv_shapes.py                    # every shape below, 2 threads (~10 minutes)
    python benchmarks/moe_gemv_shapes.py --models olmoe,gpt-oss
    python benchmarks/moe_gemv_shapes.py --smoke            # two small shapes, seconds (the test suite runs this)

moe_gemv.py measures one shape (the 304M benchmark model's gate_up) on every instruction set; this one the best set
on the shapes a kernel meets in practice, whose lengths are not all multiples of 256 (1408, 2880) and whose sizes
span 2 to 235 MB an expert in bf16. Each call reads k=2 experts for one token; a stack holds enough copies of a few
experts that its 2-bit form alone is three times the last-level cache, and every round starts after an eviction
(moe_gemv.evict), so the bytes come from memory as in decode over a model larger than the cache.
"""
from __future__ import annotations

import argparse
import difflib
import math

import torch

from moe_gemv import Setting, clock, cpu_flags, evict, read_bandwidth, stacks, sum_slices
from zoo.moe import kernels

# (model, projection, N, K): the gate_up projection is [2 I, H], down [H, I]
SHAPES = [
    ("olmoe", "gate_up", 2048, 2048), ("olmoe", "down", 2048, 1024),
    ("qwen-moe", "gate_up", 2816, 2048), ("qwen-moe", "down", 2048, 1408),  # Qwen1.5-MoE-A2.7B, DeepSeek-V2-Lite
    ("qwen3-moe", "gate_up", 1536, 2048), ("qwen3-moe", "down", 2048, 768),  # Qwen3-30B-A3B
    ("gpt-oss", "gate_up", 5760, 2880), ("gpt-oss", "down", 2880, 2880),  # GPT-OSS-20B
    ("deepseek-v3", "gate_up", 4096, 7168), ("deepseek-v3", "down", 7168, 2048),
    ("mixtral", "gate_up", 28672, 4096), ("mixtral", "down", 4096, 14336),  # Mixtral-8x7B
]
SMOKE_SHAPES = [("smoke", "gate_up", 256, 128), ("smoke", "down", 128, 320)]


def tiled_stacks(N: int, K: int, group_size: int, distinct: int, copies: int):
    """stacks() of ``distinct`` experts, each form's stack repeated ``copies`` times along the experts (new memory:
    the calls read every copy from memory as they would distinct experts; quantising only a few keeps the run
    short)."""
    out = []
    for label, bits, w, s, per in stacks(distinct, N, K, group_size):
        tile = lambda t: None if t is None else t.repeat(copies, *([1] * (t.dim() - 1))).contiguous()  # noqa: E731
        out.append((label, bits, tile(w), tile(s), per))
    return out


def measure(N: int, K: int, group_size: int, isa: str, dot: bool, probe, smoke: bool, calls: int):
    """Each form's share of the bandwidth on [N, K] experts (and the 8-bit-input forms' where ``dot``), and the
    bandwidth of the row's rounds."""
    distinct = 2 if smoke else 4
    copies = 2 if smoke else max(1, math.ceil(3 * 32 * 2 ** 20 / (N * K / 4) / distinct))  # int2: 3x a 32 MiB cache
    forms = tiled_stacks(N, K, group_size, distinct, copies)
    S = distinct * copies
    picks = [torch.tensor([[(2 * i) % S, (2 * i + 1) % S]]) for i in range(calls)]
    x = torch.randn(1, K).to(torch.bfloat16)
    labels, fns, per_call = [], [], []
    for label, bits, w, s, per in forms:
        call = lambda i, w=w, s=s, bits=bits: kernels.moe_gemv(x, picks[i], w, s, bits, group_size)  # noqa: E731
        for eight in (False, True) if dot and bits < 16 else (False,):
            labels.append(label + (" x8" if eight else ""))
            fns.append(Setting(call, isa, int8_inputs=eight))
            per_call.append(2 * per)
    *times, t_sum = clock(fns + [probe[0]], calls, between=probe[3])
    bw = max(probe[1] / t_sum / 1e9, probe[2])
    return labels, [b / t / 1e9 / bw for b, t in zip(per_call, times)], bw, forms[0][4] / 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="", help="comma-separated model names of SHAPES (default: all)")
    ap.add_argument("--isa", default="", help="the kernel's instruction set (default: the best the processor has)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.models:
        names = sorted({m for m, *_ in SHAPES})
        want = args.models.split(",")
        for name in want:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise SystemExit(f"unknown model {name!r}{hint}; known: {', '.join(names)}")
        shapes = [s for s in shapes if s[0] in want]
    torch.set_num_threads(args.threads)
    if not kernels.load():
        print(f"zoo::moe_gemv unavailable: {kernels.unavailable_reason()}")
        return
    isa = args.isa or kernels.best_isa()
    usable = kernels.ISAS[:kernels.ISAS.index(kernels.best_isa()) + 1]
    if isa not in usable:
        raise SystemExit(f"--isa {isa!r}: this processor runs {', '.join(usable)}")
    sum_gbs, how, compiled = read_bandwidth(args.smoke)
    probe = (*sum_slices(args.smoke), compiled, evict(args.smoke))
    dot = isa in kernels.INT8_DOT_ISAS
    print(f"processor flags: {cpu_flags()}\nkernel instruction set: {isa}")
    print(f"machine read bandwidth ({how}, {args.threads} threads): {sum_gbs:.1f} GB/s\n")
    header = None
    for model, proj, N, K in shapes:
        labels, shares, bw, bf16_mb = measure(N, K, 64, isa, dot, probe, args.smoke, 8 if args.smoke else 32)
        if header is None:
            header = f"{'model':12} {'projection':10} {'[N, K]':>13} {'bf16 MB':>8} " + " ".join(
                f"{lab:>7}" for lab in labels) + f" {'lowest':>7} {'bw GB/s':>7}"
            print(header + "\n" + "-" * len(header))
        cells = " ".join(f"{v:7.2f}" for v in shares)
        print(f"{model:12} {proj:10} {f'[{N}, {K}]':>13} {bf16_mb:8.1f} {cells} {min(shares):7.2f} {bw:7.1f}",
              flush=True)
    print("\n(each cell: bytes of the two selected experts' stored weights and scales per second, bf16 inputs ('x8': "
          "inputs rounded to 8 bits, zoo.moe.kernels.int8_inputs(True)), over the read bandwidth measured in the "
          "row's own rounds ('bw GB/s': an eager fp32 sum over 1 GiB in 64 slices, interleaved with the calls, or "
          "the compiled sum above where faster; a smoke run: 4 MiB, in the cache); groups of 64; 'bf16 MB': one "
          "expert's bf16 weight)")


if __name__ == "__main__":
    main()
