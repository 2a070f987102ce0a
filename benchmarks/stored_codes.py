"""2/3-bit experts read by the kernel in their stored form against their int4 working copy, in one run: what
``zoo.moe.kernels.STORED_CODES`` (the settings where the kernel reads the stored codes) rests on.

The 304M benchmark model (``benchmarks/decode.py``) with its experts at 2 or 3 bits (everything else bf16), on exact
inputs and, where the processor has int8 dot products, on 8-bit ones. Per setting, two copies of the model: one whose
kernel calls read the stored codes, one the working copy (the table set for each copy's calls), taking turns over the
rounds: greedy decode (``zoo.runtime.decode.greedy``, a 16-token prompt and 48 new tokens, as a user runs it: both
steps compiled ahead of time, the "AOT" column says), milliseconds a token with the prefill in; the prompt's prefill
alone at 16, 128, 256 and 512 tokens (across the kernel's limits, past which each expert is dequantised per call, from
its stored codes or from the copy); whether the greedy tokens agree; and the memory the working copy adds.

    python benchmarks/stored_codes.py              # ~5 minutes on 2 cores
    python benchmarks/stored_codes.py --smoke      # a miniature model, eager decode, one round (seconds)
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


@contextlib.contextmanager
def stored_codes(bits: int, int8_inputs: bool, on: bool):
    """The kernel reads ``bits``-wide experts' stored codes (on) or their int4 working copy (off) for a while."""
    from zoo.moe import kernels

    before = kernels.STORED_CODES
    kernels.STORED_CODES = {kernels.isa(): {(bits, int8_inputs)}} if on else {}
    try:
        yield
    finally:
        kernels.STORED_CODES = before


def copy_bytes(model) -> int:
    """The int4 working copies the model's expert modules hold now."""
    return sum(t.nbytes for m in model.modules() for t in getattr(m, "_kernel_cache", {}).values())


def ahead_of_time(model, prompt: int, new_tokens: int) -> bool:
    from zoo.runtime import decode

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the refusal's warning: reported as "no" in the table
        return decode.ahead_of_time_step(model, 1, decode.cache_length(model, prompt + new_tokens)) is not None


def prompt_lengths(smoke: bool) -> tuple:
    """Prefill lengths: a short prompt and longer ones (8 experts, top-2: 32 / 64 / 128 pairs per expert at 128 / 256
    / 512 tokens, 80 at the smoke run's 320), across the kernel's limits (``PAIRS_PER_EXPERT``, ``STORED_PAIRS_AVX2``),
    past which each selected expert is dequantised per call, from its stored codes or from the copy."""
    return (16, 320) if smoke else (16, 128, 256, 512)


@torch.no_grad()
def measure(base, bits: int, int8_inputs: bool, args) -> dict:
    """One setting: both arms, taking turns; medians over the rounds."""
    from zoo.moe import kernels
    from zoo.runtime import decode

    torch._dynamo.reset()  # each setting compiles its own steps
    kernels.int8_inputs(int8_inputs)
    arms = {True: base, False: copy.deepcopy(base)}
    for m in arms.values():
        for module in m.modules():
            getattr(module, "_kernel_cache", {}).clear()
    prompts = {n: torch.randint(3, base.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
               for n in prompt_lengths(args.smoke)}
    ids = prompts[16]
    compile_step = not args.smoke
    tokens, out = {}, {"decode": {}, "prefill": {p: {} for p in prompts}}
    for on, m in arms.items():  # warm-up: compiles each arm's step
        with stored_codes(bits, int8_inputs, on), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens[on] = decode.greedy(m, ids, args.new_tokens, compile=compile_step)
        out.setdefault("aot", {})[on] = compile_step and ahead_of_time(m, ids.shape[1], args.new_tokens)
    out["copy_mib"] = copy_bytes(arms[False]) / 2**20
    out["stored_mib"] = sum(b.nbytes for n, b in base.named_buffers() if f"_int{bits}" in n and "scale" not in n) / 2**20
    out["same"] = torch.equal(tokens[True], tokens[False])
    times = {on: [] for on in arms}
    pre = {p: {on: [] for on in arms} for p in prompts}
    for _ in range(args.rounds):
        for on, m in arms.items():
            with stored_codes(bits, int8_inputs, on), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = time.perf_counter()
                decode.greedy(m, ids, args.new_tokens, compile=compile_step)
                times[on].append((time.perf_counter() - t) / args.new_tokens)
                for p, x in prompts.items():
                    t = time.perf_counter()
                    m(input_ids=x, logits_to_keep=1)
                    pre[p][on].append(time.perf_counter() - t)
    out["decode"] = {on: statistics.median(v) * 1e3 for on, v in times.items()}
    out["prefill"] = {p: {on: statistics.median(v) * 1e3 for on, v in d.items()} for p, d in pre.items()}
    kernels.int8_inputs(False)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.smoke else 4)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 48)
    torch.set_num_threads(args.threads)
    import zoo
    from zoo.moe import kernels

    if not kernels.load():
        print(f"zoo's CPU kernel is unavailable ({kernels.unavailable_reason()}): nothing to compare")
        return
    from decode import mixtral_shaped
    from moe_gemv import cpu_flags

    dot = kernels.isa() in kernels.INT8_DOT_ISAS
    print(f"processor flags: {cpu_flags()}")
    print(f"instruction set {kernels.isa()}; {args.threads} threads; STORED_CODES lists {kernels.STORED_CODES}")
    print("stored codes against the int4 working copy: speed = copy time / stored time (> 1: stored faster)")
    lengths = prompt_lengths(args.smoke)
    print(f"{'bits':>4} {'inputs':>6} | {'decode ms/token stored / copy':>30} {'speed':>5} | "
          + " | ".join(f"{f'prefill ms {n} tok':>17} {'speed':>5}" for n in lengths)
          + f" | same | AOT s/c | {'MiB copy / codes':>16} | listed")
    for bits in (2, 3):
        base = zoo.apply(zoo.convert(mixtral_shaped(args.smoke)).eval(), "quantize", bits=bits, targets="experts")
        for int8_inputs in (False, True) if dot else (False,):
            r = measure(base, bits, int8_inputs, args)
            d, p = r["decode"], r["prefill"]
            cells = [f"{bits:>4} {'int8' if int8_inputs else 'exact':>6}",
                     f"{d[True]:>14.2f} / {d[False]:<13.2f} {d[False] / d[True]:>5.2f}",
                     *(f"{p[n][True]:>8.1f} / {p[n][False]:<6.1f} {p[n][False] / p[n][True]:>5.2f}" for n in lengths),
                     f"{'yes' if r['same'] else 'no':>4}",
                     f"{'yes' if r['aot'][True] else 'no':>3}/{'yes' if r['aot'][False] else 'no':<3}",
                     f"{r['copy_mib']:>7.1f} / {r['stored_mib']:<6.1f}",
                     "yes" if (bits, int8_inputs) in kernels.STORED_CODES.get(kernels.isa(), ()) else "no"]
            print(" | ".join(cells), flush=True)
    print("MiB: the working copy's memory (int4 codes) beside the stored codes'; listed: in STORED_CODES now")


if __name__ == "__main__":
    main()
