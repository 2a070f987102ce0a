"""Every compressor at two strengths on zoo-tiny-moe, in one run: expert bytes, total bytes, perplexity per
domain (and its ratio to the base), and the MoE block's decode time at T=1 and T=16 as a ratio to the
uncompressed block measured in the same run.

    python benchmarks/compression.py                 # full table (a few minutes on 2 cores)
    python benchmarks/compression.py --windows 4     # fewer held-out windows, faster
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import zoo
from zoo.editing import calibration
from zoo.evaluation.eval import perplexity_and_usage, sizes
from zoo.moe.layout import moe_layers

RUNS = [  # (label, component, options): 25% and 50% fewer expert bytes, or 8 / 4 / 3-bit average
    ("prune-frequency 6/8", "prune-frequency", {"num_experts": 6}),
    ("prune-frequency 4/8", "prune-frequency", {"num_experts": 4}),
    ("prune-reap 6/8", "prune-reap", {"num_experts": 6}),
    ("prune-reap 4/8", "prune-reap", {"num_experts": 4}),
    ("hc-smoe 6/8", "hc-smoe", {"num_experts": 6}),
    ("hc-smoe 4/8", "hc-smoe", {"num_experts": 4}),
    ("sub-moe 6/8", "sub-moe", {"num_experts": 6}),
    ("sub-moe 4/8", "sub-moe", {"num_experts": 4}),
    ("moe-svd 0.75", "moe-svd", {"ratio": 0.75}),
    ("moe-svd 0.5", "moe-svd", {"ratio": 0.5}),
    ("quantize int8", "quantize", {"bits": 8}),
    ("quantize int4", "quantize", {"bits": 4}),
    ("quantize 3b uniform", "quantize", {"bits": 3}),
    ("quantize 3b random", "quantize", {"bits": 3, "allocation": "random", "widths": [2, 3, 4]}),
    ("quantize 3b pmq", "quantize", {"bits": 3, "allocation": "pmq", "widths": [2, 3, 4]}),
    ("quantize 3b alphaq", "quantize", {"bits": 3, "allocation": "alphaq", "widths": [2, 3, 4]}),
    ("quantize 2b uniform", "quantize", {"bits": 2}),  # below 3 bits the allocations start to matter
    ("quantize 2.5b random", "quantize", {"bits": 2.5, "allocation": "random", "widths": [2, 3, 4]}),
    ("quantize 2.5b pmq", "quantize", {"bits": 2.5, "allocation": "pmq", "widths": [2, 3, 4]}),
    ("quantize 2.5b alphaq", "quantize", {"bits": 2.5, "allocation": "alphaq", "widths": [2, 3, 4]}),
    ("channel-topk 0.5", "channel-topk", {"budget": 0.5}),
    ("channel-topk 0.25", "channel-topk", {"budget": 0.25}),
]


@torch.no_grad()
def per_expert_svd(model, data, keep: float):
    """Baseline for MoE-SVD's claim: every expert gets its *own* scaled truncated SVD (no shared V), at the
    rank that keeps the same number of expert parameters as moe-svd with ``ratio=keep`` decomposing every
    layer. The low-rank product is written back into the dense weights (quality only, not speed). Runs on the
    layer-at-a-time engine, so its calibration inputs come through the already factored layers, as moe-svd's."""
    from zoo.editing.layerwise import InMemory, calibration_inputs, run
    from zoo_compressors.moe_svd import layer_grams

    class PerExpertSvd:
        name, inputs_for = "per-expert-svd", ("compress",)

        def compress_layer(self, index, moe, x):
            factor_each(moe, layer_grams(moe, x), keep)
            return moe

    step = PerExpertSvd()
    run(InMemory(model), [step], calibration_inputs(model, [step], data))
    return model


@torch.no_grad()
def factor_each(moe, st, keep: float):
    """Each expert's scaled SVD truncated to the rank of the budget, written back in place."""
    from zoo_compressors.moe_svd import cholesky_scale

    ex = moe.experts
    E, H, I = ex.num_experts, ex.hidden_size, ex.intermediate_size
    rank = max(1, int(keep * E * 3 * H * I // (E * ((2 * I + H) + (H + I)))))
    s_in = cholesky_scale(st["input"])
    for e in range(E):
        for weight, scale in ((ex.gate_up_proj, s_in), (ex.down_proj, cholesky_scale(st["inter"][e]))):
            u, sv, vh = torch.linalg.svd(weight[e].double() @ scale, full_matrices=False)
            low = (u[:, :rank] * sv[:rank]) @ torch.linalg.solve_triangular(scale, vh[:rank], upper=False, left=False)
            weight[e] = low.to(weight.dtype)


@torch.no_grad()
def block_ms(moe, tokens: int, hidden: int, dtype, repeats: int = 30) -> float:
    x = torch.randn(1, tokens, hidden, dtype=dtype, generator=torch.Generator().manual_seed(tokens))
    for _ in range(3):
        moe(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        moe(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(model, tok, windows: int, base_blocks=None) -> dict:
    ppl, _ = perplexity_and_usage(model, tok, max_windows=windows)
    blocks = [m for _, m in moe_layers(model)]
    expert_bytes = sum(m.experts.nbytes() for m in blocks)
    dtype = next(model.parameters()).dtype
    hidden = blocks[0].router.hidden_size
    timing = {t: block_ms(blocks[0], t, hidden, dtype) for t in (1, 16)}
    if base_blocks is not None:  # the uncompressed block, timed again now, for a same-moment ratio
        timing = {t: timing[t] / block_ms(base_blocks[0], t, hidden, dtype) for t in (1, 16)}
    return {"ppl": ppl, "expert_bytes": expert_bytes, "bytes": sizes(model)["bytes"], "block": timing}


def kernel_speed(hidden: int, inter: int, experts: int = 8, k: int = 2) -> dict:
    """The quantized block against bf16 at T=1 on a larger, Mixtral-shaped block (random weights), where
    weight reads rather than per-call overhead dominate: the shape the speed targets were measured on."""
    from zoo.moe import SparseMoE, SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts
    from zoo_routers.topk_softmax import TopKSoftmax

    torch.manual_seed(0)
    dense = SwiGLUExperts(experts, hidden, inter)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.02)
    router = TopKSoftmax(hidden, experts, k)
    blocks = {"bf16": SparseMoE(router, dense).to(torch.bfloat16).eval()}
    for bits in (8, 4, 3):
        blocks[f"{bits}-bit"] = SparseMoE(router, QuantizedExperts.from_dense(dense, bits, 64)).to(torch.bfloat16).eval()
    ratios = {name: [] for name in blocks if name != "bf16"}
    for _ in range(5):  # interleaved rounds: a noisy machine slows both sides of each ratio alike
        base = block_ms(blocks["bf16"], 1, hidden, torch.bfloat16, repeats=10)
        for name, got in ratios.items():
            got.append(base / block_ms(blocks[name], 1, hidden, torch.bfloat16, repeats=10))
    return {name: statistics.median(r) for name, r in ratios.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens per domain")
    ap.add_argument("--calibration-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel-shape", type=int, nargs=2, default=(1024, 2816), metavar=("HIDDEN", "INTER"),
                    help="also time the quantized block at this size (0 0 to skip)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = zoo.load(args.model).eval()
    tok = zoo.load_tokenizer(args.model)
    cal = calibration.corpus("mixed", tokens=args.calibration_tokens)
    ref = measure(base, tok, args.windows)
    base_blocks = [m for _, m in moe_layers(base)]
    rows = [("base", ref, {1: 1.0, 16: 1.0})]
    for label, name, options in RUNS:
        model = zoo.apply(copy.deepcopy(base), name, calibration=cal, **options)
        r = measure(model, tok, args.windows, base_blocks)
        rows.append((label, r, r["block"]))
    for keep in (0.5,):  # MoE-SVD's claim: its shared V beats per-expert SVD at equal parameters
        model = per_expert_svd(copy.deepcopy(base), cal, keep)
        r = measure(model, tok, args.windows, base_blocks)
        r["expert_bytes"] *= keep  # parameters a factored store would keep (stored dense here)
        rows.append((f"per-expert svd {keep} *", r, {1: float("nan"), 16: float("nan")}))
    domains = list(ref["ppl"])
    head = (f"{'method':22} {'expert MB':>9} {'total MB':>8} " + " ".join(f"{'ppl ' + d:>11} {'ratio':>6}" for d in domains)
            + f" {'block T=1':>9} {'block T=16':>10}")
    print(f"model {args.model}, {args.windows} windows x 256 tokens per domain, calibration {args.calibration_tokens} "
          f"train tokens (mixed), torch threads {args.threads}; block times are ratios to the uncompressed block")
    print(head)
    print("-" * len(head))
    for label, r, block in rows:
        cells = " ".join(f"{r['ppl'][d]:11.3f} {r['ppl'][d] / ref['ppl'][d]:6.3f}" for d in domains)
        print(f"{label:22} {r['expert_bytes'] / 1e6:9.2f} {r['bytes'] / 1e6:8.2f} {cells} {block[1]:9.2f} {block[16]:10.2f}")
    print(f"(base block: T=1 {ref['block'][1]:.3f} ms, T=16 {ref['block'][16]:.3f} ms)")
    print("* baseline, not a component: per-expert scaled SVD at moe-svd 0.5's parameter count, stored dense")
    if all(args.kernel_shape):
        h, i = args.kernel_shape
        speed = kernel_speed(h, i)
        print(f"\nMoE block speed-up over bf16 at T=1, hidden {h}, intermediate {i}, 8 experts top-2 (random weights): "
              + ", ".join(f"{name} {x:.2f}x" for name, x in speed.items()))


if __name__ == "__main__":
    main()
