"""The kernel's 8-bit-input option (``zoo.moe.kernels.int8_inputs(True)``: int8 weights and int4 codes times inputs
rounded to 8 bits, one absmax scale per input row, on int8 dot products) against the exact path, in one run:

- decode speed: compiled greedy decode of the 304M benchmark model with int8 experts (and with every linear layer
  int8), then the same with int4, the two settings taking turns over the same compiled step;
- prefill speed: a 256-token prompt through the same models, beside transformers' own bf16 model (eager), taking
  turns: exact inputs (each int8 / int4 matrix widened tile by tile in the cache, ``kernels.lowbit_gemm``), the
  same widened whole before a bf16 matmul (the path before the tiles), and 8-bit inputs (int4: the experts on the
  kernel's int8 dot products, up to ``kernels.INT4_DOT_PAIRS`` pairs per expert);
- accuracy: the held-out English split scored token by token through the compiled decode step (where the kernel
  reads every int8 / int4 matrix) by zoo-tiny-moe with int8 (then int4) experts and layers: mean negative
  log-likelihood and the share of positions whose top-1 prediction changes; and the same split scored in windows
  of 256 tokens (the prefill path).

    python benchmarks/int8_inputs.py            # needs a processor with AVX512-VNNI and AVX512-BF16
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def decode_speed(model, rounds: int, new_tokens: int) -> dict:
    from zoo.moe import kernels
    from zoo.runtime.decode import greedy

    ids = torch.tensor([list(range(5, 21))])
    speeds, tokens = {False: [], True: []}, {}
    with torch.no_grad():
        greedy(model, ids, new_tokens)  # compiles the step once: the setting is read by the kernel at run time
        for _ in range(rounds):
            for on in (False, True):
                kernels.int8_inputs(on)
                t = time.perf_counter()
                out = greedy(model, ids, new_tokens)
                speeds[on].append(new_tokens / (time.perf_counter() - t))
                tokens[on] = out[0, ids.shape[1]:].tolist()
    kernels.int8_inputs(False)
    return {"exact": speeds[False], "int8": speeds[True],
            "same_tokens": sum(a == b for a, b in zip(tokens[False], tokens[True]))}


def token_by_token(model, ids: torch.Tensor, step) -> tuple[list[float], list[int]]:
    """Negative log-likelihood of each next token and the top-1 prediction, each position through the compiled
    decode step (where the kernel reads every int8 matrix), fed the held-out tokens."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=len(ids))
    nll, top = [], []
    with torch.no_grad():
        logits = model(input_ids=ids[None, :1], past_key_values=cache, cache_position=torch.arange(1), use_cache=True,
                       logits_to_keep=1).logits
        for i in range(1, len(ids)):
            last = logits[0, -1].float()
            nll.append(float(-torch.log_softmax(last, -1)[ids[i]]))
            top.append(int(last.argmax()))
            if i + 1 < len(ids):
                logits = step(ids[i].view(1, 1), i, cache)
    return nll, top


def prefill_speed(models: dict, tokens: int, rounds: int) -> dict:
    """tok/s of one forward over a ``tokens``-long prompt for each (label: (model, mode)), taking turns. mode:
    "exact" (bf16 inputs; int8/int4 matrices through ``kernels.lowbit_gemm``'s tiles widened in the cache), "8-bit"
    (``int8_inputs(True)``) or "widened" (exact, without the tiles: each matrix widened whole to bf16, then torch's
    bf16 matmul, the path before them)."""
    from zoo.moe import kernels

    ids = torch.randint(3, 8192, (1, tokens), generator=torch.Generator().manual_seed(1))
    speeds = {label: [] for label in models}
    fits = kernels.lowbit_gemm_fits
    with torch.no_grad():
        for model, _ in models.values():
            model(input_ids=ids)
        for _ in range(rounds):
            for label, (model, mode) in models.items():
                kernels.int8_inputs(mode == "8-bit")
                kernels.lowbit_gemm_fits = fits if mode != "widened" else (lambda *a: False)
                t = time.perf_counter()
                model(input_ids=ids)
                speeds[label].append(tokens / (time.perf_counter() - t))
    kernels.int8_inputs(False)
    kernels.lowbit_gemm_fits = fits
    return speeds


def windowed_nll(model, ids: torch.Tensor, width: int) -> float:
    """Mean next-token NLL over consecutive windows of ``width`` tokens, each one forward (prefill)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, width):
            window = ids[start:start + width + 1]
            logits = model(input_ids=window[None, :-1]).logits[0].float()
            total += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
            count += len(window) - 1
    return total / count


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512, help="held-out tokens scored")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--parts", default="decode,prefill,accuracy", help="which of decode, prefill, accuracy to run")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    torch.set_num_threads(args.threads)

    import zoo
    from decode import mixtral_shaped
    from zoo.moe import kernels

    if not kernels.load() or kernels.best_isa() not in kernels.INT8_DOT_ISAS:
        print(f"8-bit inputs need int8 dot products, the {' or '.join(kernels.INT8_DOT_ISAS)} set "
              f"(kernel: {kernels.unavailable_reason() or kernels.isa()})")
        return
    base = zoo.convert(mixtral_shaped(False)).eval()
    if "decode" in parts:
        decode_rows(base, args)
    if "prefill" in parts:
        prefill_rows(base, args)
    if "accuracy" in parts:
        accuracy_rows(args)


def decode_rows(base, args):
    import zoo

    print(f"decode, 304M benchmark model, {args.new_tokens} greedy tokens, {args.threads} threads, compiled step, "
          f"{args.rounds} rounds taking turns")
    for bits in (8, 4):
        for targets in ("experts", "all"):
            model = zoo.apply(copy.deepcopy(base), "quantize", bits=bits,
                              **({"targets": "all"} if targets == "all" else {}))
            r = decode_speed(model, args.rounds, args.new_tokens)
            ratio = statistics.median(r["int8"]) / statistics.median(r["exact"])
            print(f"  int{bits} {targets:8} exact inputs {' '.join(f'{v:6.1f}' for v in r['exact'])} tok/s | 8-bit "
                  f"inputs {' '.join(f'{v:6.1f}' for v in r['int8'])} tok/s | ratio of medians {ratio:.2f} | greedy "
                  f"tokens equal {r['same_tokens']}/{args.new_tokens} (random weights: near-tied logits)")
            del model


def prefill_rows(base, args):
    import zoo
    from decode import mixtral_shaped

    native = mixtral_shaped(False).eval()
    models = {"transformers bf16 (eager)": (native, "exact"), "zoo bf16": (base, "exact")}
    for bits in (8, 4):
        for targets in ("experts", "all"):
            model = zoo.apply(copy.deepcopy(base), "quantize", bits=bits,
                              **({"targets": "all"} if targets == "all" else {}))
            models[f"int{bits} {targets}, exact inputs"] = (model, "exact")
            models[f"int{bits} {targets}, exact, widened"] = (model, "widened")
            models[f"int{bits} {targets}, 8-bit inputs"] = (model, "8-bit")
    speeds = prefill_speed(models, args.prefill, args.rounds)
    ref = statistics.median(speeds["transformers bf16 (eager)"])
    print(f"\nprefill, {args.prefill}-token prompt, one forward, {args.rounds} rounds taking turns:")
    for label, v in speeds.items():
        print(f"  {label:28} {' '.join(f'{t:7.0f}' for t in v)} tok/s | {statistics.median(v) / ref:.2f}x transformers")


def accuracy_rows(args):
    import zoo
    from zoo.data.tokens import token_stream
    from zoo.moe import kernels
    from zoo.moe.kernels.linear import read_linears_with_kernel
    from zoo.runtime.decode import ahead_of_time_step

    ids = token_stream("english", "val", zoo.load_tokenizer("zoo-tiny-moe"))[:args.tokens].long()
    for bits in (8, 4):
        tiny = zoo.apply(zoo.load("zoo-tiny-moe").eval(), "quantize", bits=bits, targets="all")
        read_linears_with_kernel(tiny)
        step = ahead_of_time_step(tiny, 1, len(ids))
        runs = {}
        for on in (False, True):
            kernels.int8_inputs(on)
            runs[on] = token_by_token(tiny, ids, step)
        kernels.int8_inputs(False)
        (nll0, top0), (nll1, top1) = runs[False], runs[True]
        changed = sum(a != b for a, b in zip(top0, top1)) / len(top0)
        print(f"\naccuracy, zoo-tiny-moe (int{bits} experts and layers), {len(nll0)} held-out English tokens, one a "
              f"step:")
        print(f"  mean NLL exact inputs {statistics.mean(nll0):.4f} (ppl {math.exp(statistics.mean(nll0)):.2f}) | "
              f"8-bit inputs {statistics.mean(nll1):.4f} (ppl {math.exp(statistics.mean(nll1)):.2f}) | top-1 changed "
              f"at {changed:.1%} of positions")
        nll = {}
        for on in (False, True):
            kernels.int8_inputs(on)
            nll[on] = windowed_nll(tiny, ids, 256)
        kernels.int8_inputs(False)
        print(f"  the same tokens in windows of 256 (prefill): mean NLL exact inputs {nll[False]:.4f} | 8-bit inputs "
              f"{nll[True]:.4f}")


if __name__ == "__main__":
    main()
