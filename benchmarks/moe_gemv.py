"""zoo::moe_gemv's read speed against the machine's: GB/s of selected expert weights read per second, for
every stored form and every instruction set the processor has (interleaved), beside the machine's read bandwidth
(the faster of torch's eager fp32 sum and a compiled bf16 sum over 1 GiB: read_bandwidth) and torch's own one-row
kernels on the same experts, in one run, with the processor's flags.

    python benchmarks/moe_gemv.py                  # the 304M benchmark model's expert shape, 2 threads
    python benchmarks/moe_gemv.py --smoke          # small sizes, seconds (the test suite runs this)

Each call reads k=2 experts' gate_up weights [2I, H] for one token; the experts rotate through a stack larger
than the last-level cache, so the bytes come from memory, as in decode over a model bigger than the cache.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from zoo.moe import kernels
from zoo.moe.packing import int4unpack, torch_packs_int4_alike
from zoo.moe.quantized import quantize_grouped, quantize_int8


def clock(fns, calls: int, repeats: int = 5, between=None) -> list:
    """Median seconds per call of each function over ``repeats`` rounds of ``calls`` calls, the functions taking
    turns within each round (so a slow spell of a noisy machine falls on all of them), after one warm-up call. A
    ``Setting`` is switched on once a round, around its calls. ``between`` (untimed) runs before each round of each
    function, so that every round starts as the first after the bandwidth probe did (see ``evict``)."""
    runs = [[] for _ in fns]
    for fn in fns:
        fn(0)
    for _ in range(repeats):
        for fn, times in zip(fns, runs):
            if between is not None:
                between()
            times.append((fn.round(calls) if isinstance(fn, Setting) else plain_round(fn, calls)) / calls)
    return [statistics.median(times) for times in runs]


def evict(smoke: bool):
    """A sum over 256 MiB (eight times the last-level cache seen here; a smoke run: 8 MiB), to run before each
    function's round. Here a round read right after the probe's 1 GiB took ~9% longer than the same calls right
    after another function's round over the same experts (2-bit [5632, 1024]: the calls' first pass over the 64
    experts ~100 us a call, the second ~92; the experts' scales warmed first, or huge pages, changed nothing), so the
    first function of a round ran cold and the others warm: the 8-bit-input 2-bit row, timed first in its round, read
    0.81-0.89x the exact row's speed at 42-48 GB/s, 0.87-0.94x with every round after this sum (1.18-1.22x at 70-75
    GB/s, 1.07-1.11x before). Each share of the bandwidth stays that of a cold round, as a model larger than the
    cache reads its experts."""
    junk = torch.randn((2 if smoke else 64) * 2 ** 20)
    return lambda: junk.sum()


def plain_round(fn, calls: int) -> float:
    t = time.perf_counter()
    for i in range(calls):
        fn(i)
    return time.perf_counter() - t


class Setting:
    """fn run under the kernel's settings (instruction set, 8-bit inputs), restored after: a call runs one call under
    them; ``round`` runs ``calls`` calls under them and times those alone. Switched once a call, the settings' calls
    into the library (~3 us for both, against ~80 us for a 2-bit call) had counted against every row, and twice
    against the 8-bit-input rows."""

    def __init__(self, fn, isa: str, int8_inputs: bool = False):
        self.fn, self.isa, self.int8_inputs = fn, isa, int8_inputs

    def _enter(self):
        before = kernels.isa(), kernels.int8_inputs()
        try:
            kernels.isa(self.isa)
            if self.int8_inputs:
                kernels.int8_inputs(True)
        except BaseException:
            self._exit(before)
            raise
        return before

    def _exit(self, before):
        kernels.int8_inputs(False)
        kernels.isa(before[0])
        kernels.int8_inputs(before[1])

    def __call__(self, i):
        before = self._enter()
        try:
            return self.fn(i)
        finally:
            self._exit(before)

    def round(self, calls: int) -> float:
        before = self._enter()
        try:
            return plain_round(self.fn, calls)
        finally:
            self._exit(before)


def read_bandwidth(smoke: bool) -> tuple:
    """The machine's read bandwidth, GB/s, how it was read and the compiled sum's GB/s (0 in a smoke run): the faster
    of two sums over 1 GiB (far beyond the last-level cache), torch's eager fp32 sum and a compiled sum of bf16
    widened to fp32, at the start of the run (each row measures the eager sum again: sum_slices). Either alone can be
    bound by its own arithmetic: on an AVX2-only processor (AMD EPYC, Zen 3) the compiled sums read 13-14 GB/s where
    the eager fp32 sum reads 25 and the kernel's int8 rows 24. A smoke run sums 4 MiB eagerly (in the cache: a
    stand-in, not the machine's figure) and compiles nothing (a cold compile took ~7 s of the test suite's time)."""
    n = 2 ** 20 if smoke else 2 ** 28  # fp32 elements (bf16: twice as many)
    f32 = torch.randn(n)
    if smoke:
        eager = f32.nbytes / clock([lambda i: f32.sum()], 3)[0] / 1e9
        return eager, f"a smoke run's stand-in: an eager fp32 sum ({eager:.1f}) over {f32.nbytes >> 20} MiB", 0.0
    bf16 = torch.randn(2 * n).to(torch.bfloat16)
    compiled = torch.compile(lambda t: t.sum(dtype=torch.float32))
    t_eager, t_compiled = clock([lambda i: f32.sum(), lambda i: compiled(bf16)], 3)
    eager, comp = f32.nbytes / t_eager / 1e9, bf16.nbytes / t_compiled / 1e9
    how = f"best of an eager fp32 sum ({eager:.1f}) and a compiled bf16 sum ({comp:.1f}) over {f32.nbytes >> 20} MiB"
    return max(eager, comp), how, comp


def sum_slices(smoke: bool):
    """The read-bandwidth probe that runs beside the kernels, in each row's rounds: call i sums slice i % 64 of 1 GiB
    of fp32 (a smoke run: 4 MiB), so a slice is read from memory again only after the other 63, as the kernels' calls
    rotate through their stack. Returns (fn, bytes a call). A noisy machine's read speed drifts within a run (an eager
    sum over 1 GiB read 17 and 29 GB/s in two runs ten minutes apart here), so each row's share is of the bandwidth
    measured in its own rounds."""
    parts = torch.randn(2 ** 20 if smoke else 2 ** 28).view(64, -1)
    return (lambda i: parts[i % 64].sum()), parts[0].nbytes


def cpu_flags() -> str:
    """The processor's vector flags, as the kernel's choice depends on them."""
    try:
        line = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    except (OSError, StopIteration):
        import platform

        return platform.machine()
    keep = ("avx", "fma", "f16c", "amx", "neon", "asimd", "sve")
    return " ".join(sorted(f for f in line.split(":")[1].split() if f.startswith(keep)))


def with_isa(name, fn):
    """fn run with the kernel on instruction set ``name``."""
    return Setting(fn, name)


def stacks(S: int, N: int, K: int, group_size: int):
    """(label, bits, weight stack, scales, bytes of one expert) for every stored form, from one bf16 stack."""
    g = torch.Generator().manual_seed(0)
    dense = (torch.randn(S, N, K, generator=g) * 0.02).to(torch.bfloat16)
    out = [("bf16", 16, dense, None)]
    q8 = [quantize_int8(w) for w in dense]
    out.append(("int8", 8, torch.stack([q for q, _ in q8]), torch.stack([s for _, s in q8]).to(torch.bfloat16)))
    for bits in (4, 3, 2):
        q = [quantize_grouped(w, group_size, bits)[:2] for w in dense]
        out.append((f"int{bits}", bits, torch.stack([a for a, _ in q]), torch.stack([b for _, b in q])))
    return [(label, bits, w, s, w[0].nbytes + (0 if s is None else s[0].nbytes)) for label, bits, w, s in out]


def torch_row(label, w, s, group_size):
    """torch's own one-row kernel on expert e's view (what the zoo used before the kernel)."""
    if label == "bf16":
        return lambda x, e: torch.nn.functional.linear(x, w[e])
    if label == "int8":
        return lambda x, e: torch.ops.aten._weight_int8pack_mm(x, w[e], s[e])
    if label == "int4":  # torch's own layout of the pack on this processor (the stored one where they agree)
        k = w.shape[2] * 2
        native = w if torch_packs_int4_alike() else torch.stack(
            [torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4unpack(p, k), 1) for p in w])
        return lambda x, e: torch.ops.aten._weight_int4pack_mm_for_cpu(x, native[e], group_size, s[e])
    return None


def with_int8_inputs(isa, fn):
    """fn run on instruction set ``isa`` with int8 weights / 2/3/4-bit codes times 8-bit inputs (int8 dot products)."""
    return Setting(fn, isa, int8_inputs=True)


def int8_dot_row(isa, label, bits, group_size, x, picks, w, s, calls, per_expert, k, probe, columns):
    """The int8 or int2/3/4 row again with the inputs rounded to 8 bits (the kernel's option), interleaved with the
    plain path and the bandwidth probe, and the error that rounding adds: ||y8 - y|| / ||y|| over the calls'
    outputs."""
    plain = with_isa(isa, lambda i: kernels.moe_gemv(x, picks[i], w, s, bits, group_size))
    dot = with_int8_inputs(isa, lambda i: kernels.moe_gemv(x, picks[i], w, s, bits, group_size))
    t_dot, t_plain, t_sum = clock([dot, plain, probe[0]], calls, between=probe[3])
    bw = max(probe[1] / t_sum / 1e9, probe[2])
    y, y8 = torch.cat([plain(i).float() for i in range(calls)]), torch.cat([dot(i).float() for i in range(calls)])
    gbs = k * per_expert / t_dot / 1e9
    cells = f"{gbs:16.1f} {gbs / bw:6.2f} " + " ".join(f"{'-':>16} {'-':>6}" for _ in range(columns - 1))
    print(f"{label + ', x int8':12} {k * per_expert / 1e6:9.1f} {cells} {'-':>10} {'-':>10} {bw:7.1f}   "
          f"(8-bit inputs: {t_plain / t_dot:.2f}x the {label} row, error {float((y8 - y).norm() / y.norm()):.4f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not kernels.load():
        print(f"zoo::moe_gemv unavailable: {kernels.unavailable_reason()}")
        return
    H, I, k, group_size = (128, 256, 2, 64) if args.smoke else (1024, 2816, 2, 64)
    S = 8 if args.smoke else 64  # 64 bf16 experts of [2I, H]: 738 MB, beyond the 300 MB last-level cache
    calls = 8 if args.smoke else 64
    sum_gbs, how, compiled = read_bandwidth(args.smoke)
    # (fn, bytes a call, the compiled sum's GB/s: the floor of 'bw', the eviction before each round)
    probe = (*sum_slices(args.smoke), compiled, evict(args.smoke))
    x = torch.randn(1, H).to(torch.bfloat16)
    isas = list(kernels.ISAS[:kernels.ISAS.index(kernels.best_isa()) + 1][::-1])
    print(f"processor flags: {cpu_flags()}\nkernel instruction sets: {', '.join(isas)} (best first)")
    print(f"machine read bandwidth ({how}, {args.threads} threads): {sum_gbs:.1f} GB/s\n")
    head = f"{'stored form':12} {'MB / call':>9} " + " ".join(f"{n + ' GB/s':>16} {'of bw':>6}" for n in isas)
    head += f" {'torch GB/s':>10} {'best/torch':>10} {'bw GB/s':>7}"
    print(head + "\n" + "-" * len(head))
    for label, bits, w, s, per_expert in stacks(S, 2 * I, H, group_size):
        pick = lambda i: torch.tensor([[(2 * i) % S, (2 * i + 1) % S]])  # noqa: E731
        picks = [pick(i) for i in range(calls)]
        fns = [with_isa(n, lambda i: kernels.moe_gemv(x, picks[i], w, s, bits, group_size)) for n in isas]
        row = torch_row(label, w, s, group_size)
        if row is not None:
            fns.append(lambda i: [row(x, int(e)) for e in picks[i][0]])
        *times, t_sum = clock(fns + [probe[0]], calls, between=probe[3])
        bw = max(probe[1] / t_sum / 1e9, probe[2])
        gbs = [k * per_expert / t / 1e9 for t in times]
        cells = " ".join(f"{g:16.1f} {g / bw:6.2f}" for g in gbs[:len(isas)])
        torch_gbs = f"{gbs[-1]:10.1f} {times[-1] / times[0]:10.2f}" if row is not None else f"{'-':>10} {'-':>10}"
        print(f"{label:12} {k * per_expert / 1e6:9.1f} {cells} {torch_gbs} {bw:7.1f}")
        if label != "bf16" and isas[0] in kernels.INT8_DOT_ISAS:
            int8_dot_row(isas[0], label, bits, group_size, x, picks, w, s, calls, per_expert, k, probe, len(isas))
    print("\n(GB/s: bytes of the selected experts' stored weights and scales / time per call, bf16 inputs; 'of bw': "
          "the share of the machine's read bandwidth measured in the row's own rounds ('bw GB/s': an eager fp32 sum "
          "over 1 GiB (a smoke run: 4 MiB) in 64 slices, interleaved with the row's calls, or the compiled sum above "
          "where faster); torch: F.linear / _weight_int8pack_mm / _weight_int4pack_mm_for_cpu on each selected "
          "expert's view; 2/3 bits have no torch kernel; best/torch: the first instruction set's speed over torch's; "
          "'int8, x int8' / 'int4, x int8' ...: int8 weights / 2/3/4-bit codes times inputs rounded to 8 bits on int8 "
          "dot products, zoo.moe.kernels.int8_inputs(True))")


if __name__ == "__main__":
    main()
