"""Merging against pruning on the zoo's own MoE, in one run: prune-frequency, prune-reap (mixed and code-only
calibration), hc-smoe (the paper's expert map and the zoo's cut router) and sub-moe (the paper's cosine
clustering with rank truncation, plain averaging of the same clusters, and the zoo's old Euclidean settings), at
25% and 50% fewer experts, perplexity per domain side by side; then each paper's claim is recorded in
docs/claims/<component>.json (zoo.evaluation.claims.record).

    python benchmarks/merging.py                       # a few minutes on one thread
    python benchmarks/merging.py --windows 4 --no-record
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch

import zoo
from zoo.editing import calibration
from zoo.evaluation import claims
from zoo.evaluation.eval import perplexity_and_usage
from zoo.moe.layout import moe_layers

PAPER = "the paper's"


def runs(n: int) -> list[tuple[str, str, dict, str]]:
    """(label, component, options, calibration domain) at ``n`` experts per layer."""
    return [
        (f"prune-frequency {n}/8", "prune-frequency", {"num_experts": n}, "mixed"),
        (f"prune-reap {n}/8", "prune-reap", {"num_experts": n}, "mixed"),
        (f"prune-reap code-cal {n}/8", "prune-reap", {"num_experts": n}, "code"),
        (f"hc-smoe map {n}/8", "hc-smoe", {"num_experts": n}, "mixed"),
        (f"hc-smoe cut {n}/8", "hc-smoe", {"num_experts": n, "router": "cut"}, "mixed"),
        (f"sub-moe {n}/8", "sub-moe", {"num_experts": n}, "mixed"),
        (f"sub-moe rank 1.0 {n}/8", "sub-moe", {"num_experts": n, "rank_ratio": 1.0}, "mixed"),
        (f"sub-moe old {n}/8", "sub-moe", {"num_experts": n, "rank_ratio": 1.0, "clustering": "euclidean",
                                           "router": "cut"}, "mixed"),
    ]


@torch.no_grad()
def expert_cosine(model) -> float:
    """Mean |cosine| between the flattened weights of two different experts of a layer, over layers and pairs."""
    values = []
    for _, moe in moe_layers(model):
        w = torch.cat([moe.experts.gate_up_proj.flatten(1), moe.experts.down_proj.flatten(1)], 1).double()
        w = w / w.norm(dim=1, keepdim=True)
        c = w @ w.T
        off = ~torch.eye(len(c), dtype=torch.bool)
        values.append(c[off].abs().mean())
    return float(torch.stack(values).mean())


def measure(model, tok, windows: int) -> dict:
    ppl = {}
    for split in ("val", "ood"):
        try:
            got, _ = perplexity_and_usage(model, tok, max_windows=windows, split=split)
        except (TypeError, ValueError, FileNotFoundError, KeyError):  # a corpus without the out-of-domain split
            continue
        ppl.update({(d if split == "val" else f"{d} ood"): round(float(v), 3) for d, v in got.items()})
    return ppl


def score(ppl: dict) -> float:
    """Mean log perplexity over the held-out (in-distribution) domains: lower is better."""
    held = [v for k, v in ppl.items() if k not in ("method", "experts") and "ood" not in k]
    return sum(math.log(v) for v in held) / len(held)


def verdict(wins: list[bool]) -> str:
    return "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--windows", type=int, default=8, help="windows of 256 tokens per domain and split")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", type=int, nargs="+", default=[6, 4])
    ap.add_argument("--no-record", action="store_true", help="print only; write no claims file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/merging.py " + " ".join(argv if argv is not None else sys.argv[1:])
    base = zoo.load(args.model).eval()
    tok = zoo.load_tokenizer(args.model)
    cals = {d: calibration.corpus(d, tokens=args.calibration_tokens) for d in ("mixed", "code")}
    cosine = expert_cosine(base)
    rows = [{"method": "base", "experts": 8, **measure(base, tok, args.windows)}]
    by, factored = {}, {}
    for n in args.sizes:
        for label, name, options, cal in runs(n):
            t = time.perf_counter()
            model = zoo.apply(copy.deepcopy(base), name, calibration=cals[cal], **options)
            row = {"method": label, "experts": n, **measure(model, tok, args.windows)}
            params = model.config.zoo_recipe[-1].get("results", {}).get("parameters")
            if params:  # sub-moe: its merged experts' parameters, dense and in factored form at the kept rank
                factored[label] = sum(p["factored_at_rank"] for p in params.values()) / sum(
                    p["dense"] for p in params.values())
            rows.append(row)
            by[label] = row
            print(f"  {label}: {time.perf_counter() - t:.0f} s", file=sys.stderr)
    keys = [k for k in rows[0] if k not in ("method", "experts")]
    settings = (f"{args.model}, calibration {args.calibration_tokens} tokens of the train split (mixed, or code only "
                f"where named), perplexity on {args.windows} windows x 256 tokens per domain (held-out split"
                f"{' and out-of-domain split' if any('ood' in k for k in keys) else ''}), one torch thread")
    print(settings)
    print(f"mean |cosine| between two experts' weights in a layer: {cosine:.4f} (near 0: experts trained apart from "
          "scratch, the least favourable case for merging; near 1: copies of one FFN, as after upcycling)")
    head = f"{'method':28} " + " ".join(f"{k:>13}" for k in keys)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['method']:28} " + " ".join(f"{r[k]:13.3f}" for k in keys))
    if args.no_record:
        return rows

    def pick(*labels):
        return [by[f"{lab} {n}/8"] for n in args.sizes for lab in labels]

    if args.model == "zoo-tiny-moe":
        orth = (f"zoo-tiny-moe was trained from scratch and its experts are nearly orthogonal (mean |cosine| of two "
                f"experts' weights {cosine:.3f}), the least favourable case for merging; settings: {settings}.")
    else:
        orth = f"Mean |cosine| of two experts' weights in a layer: {cosine:.3f}; settings: {settings}."
    record = claims.record

    def claim_on(component, claim, *rest):  # one entry per model: a second model's run keeps the first's
        record(component, claim if args.model == "zoo-tiny-moe" else f"{claim} (on {args.model})", *rest)
    base_row = rows[0]
    # HC-SMoE: merging (its expert map, the paper's router) beats pruning at equal expert count
    wins = [score(by[f"hc-smoe map {n}/8"]) < min(score(by[f"prune-frequency {n}/8"]), score(by[f"prune-reap {n}/8"]))
            for n in args.sizes]
    wins_freq = [score(by[f"hc-smoe map {n}/8"]) < score(by[f"prune-frequency {n}/8"]) for n in args.sizes]
    map_vs_cut = [score(by[f"hc-smoe map {n}/8"]) < score(by[f"hc-smoe cut {n}/8"]) for n in args.sizes]
    claim_on(
        "hc-smoe", "merging experts (hierarchical clustering, frequency-weighted) beats pruning at equal expert count",
        verdict(wins),
        f"hc-smoe (expert map, the paper's) against prune-frequency and prune-reap at {args.sizes} of 8 experts: "
        f"beats both at {sum(wins)} of {len(wins)} sizes, frequency pruning (the paper's baseline) at "
        f"{sum(wins_freq)} of {len(wins_freq)} (mean log perplexity over the held-out domains). The paper's router "
        f"(all rows kept, expert map) beats the zoo's old cut router (row 'hc-smoe cut') at {sum(map_vs_cut)} of "
        f"{len(map_vs_cut)} sizes; neither beats pruning. " + orth,
        [base_row, *pick("prune-frequency", "prune-reap", "hc-smoe map", "hc-smoe cut")], command, args.model)
    # REAP: pruning beats merging on generative quality (perplexity)
    merges = ("hc-smoe map", "hc-smoe cut", "sub-moe")
    wins = [score(by[f"prune-reap {n}/8"]) < min(score(by[f"{m} {n}/8"]) for m in merges) for n in args.sizes]
    claim_on(
        "prune-reap", "pruning (REAP saliency) beats merging on generative quality at equal expert count",
        verdict(wins),
        f"prune-reap against hc-smoe (map and cut) and sub-moe at {args.sizes} of 8 experts, perplexity being "
        f"generative: better than every merge at {sum(wins)} of {len(wins)} sizes. " + orth,
        [base_row, *pick("prune-reap", "prune-frequency", *merges)], command, args.model)
    # Half the Experts, All the Code: calibrating on code keeps code quality
    wins = [by[f"prune-reap code-cal {n}/8"]["code"] < by[f"prune-reap {n}/8"]["code"] for n in args.sizes]
    cost = [round(by[f"prune-reap code-cal {n}/8"]["english"] / by[f"prune-reap {n}/8"]["english"], 3)
            for n in args.sizes]
    claim_on(
        "prune-reap", "Half the Experts, All the Code: pruning calibrated on one domain (code) keeps that domain's "
        "quality better than general (mixed) calibration", verdict(wins),
        f"prune-reap calibrated on code only against mixed calibration at {args.sizes} of 8 experts: lower code "
        f"perplexity at {sum(wins)} of {len(wins)} sizes; English perplexity code-only / mixed = {cost}. " + orth,
        [base_row, *pick("prune-reap", "prune-reap code-cal")], command, args.model)
    # Sub-MoE: subspace merging beats plain averaging and other merges at equal size
    wins_avg = [score(by[f"sub-moe {n}/8"]) < score(by[f"sub-moe rank 1.0 {n}/8"]) for n in args.sizes]
    saved = ", ".join(f"{factored['sub-moe %d/8' % n]:.0%} at {n}/8" for n in args.sizes)
    wins_hc = [score(by[f"sub-moe {n}/8"]) < score(by[f"hc-smoe map {n}/8"]) for n in args.sizes]
    claim_on(
        "sub-moe", "subspace expert merging (shared U, merged V, truncated rank) beats plain averaging and other "
        "merges at equal expert count", verdict([a and b for a, b in zip(wins_avg, wins_hc)]),
        f"sub-moe (the paper's: cosine clustering, rank_ratio 0.5) against the frequency-weighted average of the "
        f"same clusters (rank_ratio 1.0) better at {sum(wins_avg)} of {len(wins_avg)} sizes, against hc-smoe at "
        f"{sum(wins_hc)} of {len(wins_hc)}; in factored form the truncated merged experts would hold "
        f"{saved} of the dense merged experts' "
        f"parameters (kept dense here). 'sub-moe old' is the zoo's previous settings (Euclidean K-means, "
        f"full rank, cut router). " + orth,
        [base_row, *pick("sub-moe", "sub-moe rank 1.0", "sub-moe old", "hc-smoe map")], command, args.model)
    # prune-frequency: a baseline, no claim of its own
    ranks = {n: sorted((score(by[f"{lab} {n}/8"]), lab) for lab in ("prune-frequency", "prune-reap", "hc-smoe map",
                                                                      "sub-moe")) for n in args.sizes}
    place = {n: [lab for _, lab in r].index("prune-frequency") + 1 for n, r in ranks.items()}
    claim_on(
        "prune-frequency", "none of its own: the frequency-pruning baseline of HC-SMoE and NAEE", "untestable here",
        f"No paper claims anything for frequency pruning itself; it is the baseline the merging papers beat. Here "
        f"it ranks {place} (experts: place among prune-frequency, prune-reap, hc-smoe, sub-moe; 1 = best mean log "
        f"perplexity). " + orth,
        [base_row, *pick("prune-frequency", "prune-reap", "hc-smoe map", "sub-moe")], command, args.model)
    return rows


if __name__ == "__main__":
    main()
