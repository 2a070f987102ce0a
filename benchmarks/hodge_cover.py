"""HodgeCover's claims on one of the zoo's MoEs, in one run, recorded in docs/claims/hodge-cover.json:

1. expert reduction: hodge-cover matches the best learning-free baseline (prune-reap, hc-smoe, sub-moe) at equal
   expert count;
2. the hybrid (HodgeCover+Wanda) leads the hybrid axis at aggressive compression: at the 50% parameter budget it
   keeps 6 experts and Wanda-prunes them to the same count of nonzero expert weights.

Each claim is judged by the one rule (``zoo.evaluation.claims.judge``) against a control that lacks only the
mechanism, the cover's choice of experts: the same hodge-cover run (same barriers, same frequency-weighted merge
into the lowest-barrier survivor, same Wanda pruning for the hybrid) with the kept experts chosen by routing
frequency, and (claim 1) at random. The claims' own baselines (prune-reap, hc-smoe; REAP+Wanda, HC-SMoE+Wanda,
Wanda alone on all 8 experts) are judged beside, not in the verdicts; sub-moe, the third baseline of claim 1, is
left out for time (its SVD costs as much as two hodge-cover runs per draw). hodge-cover is calibrated, so
the repeats are calibration draws: repeat i of every arm is calibrated on calibration seed i (the random choice
drawn with seed i) and evaluated on disjoint evaluation draw i (paired); the measure of a draw is the geometric
mean over the held-out domains of its perplexity.

    python benchmarks/hodge_cover.py                          # zoo-tiny-moe, 3 draws x 8 windows, 1024 tokens
    python benchmarks/hodge_cover.py --model zoo-tiny-upcycled
    python benchmarks/hodge_cover.py --quick                  # 2 draws x 2 windows, claim 1 vs frequency only
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import claim_parser, conclude, draw_args, draw_geo, load_model, show, verdict_parts  # noqa: E402
from merging import expert_cosine  # noqa: E402  (the merging benchmark's harness)

import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation import claims  # noqa: E402

TOTAL = 8
CLAIM_1 = "expert reduction: HodgeCover matches the best learning-free baseline (prune-reap, hc-smoe, sub-moe) at " \
          "equal expert count"
CLAIM_2 = "hybrid: HodgeCover+Wanda leads the hybrid axis at aggressive compression (50% of the expert weights)"


@contextlib.contextmanager
def choice(kind: str, seed: int = 0):
    """hodge-cover with its cover swapped for another choice of the kept experts: ``frequency`` (the most routed,
    which is the greedy cover with nothing to cover: its tiebreak) or ``random`` (seeded); ``cover``: unchanged."""
    import zoo_compressors.hodge_cover as hc

    cover, rng = hc.greedy_cover, random.Random(seed)
    if kind == "frequency":
        hc.greedy_cover = lambda n, keep, edges, triangles, counts: cover(n, keep, {}, {}, counts)
    elif kind == "random":
        hc.greedy_cover = lambda n, keep, edges, triangles, counts: rng.sample(range(n), keep)
    try:
        yield
    finally:
        hc.greedy_cover = cover


def runs(n: int, quick: bool) -> list[tuple[str, str, list[tuple[str, dict]], int]]:
    """(label, hodge-cover's choice, steps, experts kept) at a budget of ``n`` of ``TOTAL`` experts' weights."""
    wider = min(TOTAL, n + 2)  # the hybrids keep more experts, then prune weights to the same count
    hybrid = [("hodge-cover", {"num_experts": wider, "sparsity": round(1 - n / wider, 4)})]

    def alone(experts):  # Wanda alone: hodge-cover keeping every expert prunes their weights to the budget
        return "hodge-cover", {"num_experts": experts, "sparsity": round(1 - n / experts, 4)}

    out = [(f"hodge-cover {n}/8", "cover", [("hodge-cover", {"num_experts": n})], n),
           (f"frequency choice {n}/8", "frequency", [("hodge-cover", {"num_experts": n})], n)]
    if quick:
        return out
    return out + [
        (f"random choice {n}/8", "random", [("hodge-cover", {"num_experts": n})], n),
        (f"prune-reap {n}/8", "cover", [("prune-reap", {"num_experts": n})], n),
        (f"hc-smoe map {n}/8", "cover", [("hc-smoe", {"num_experts": n})], n),
        (f"hodge-cover+wanda {n}/8", "cover", hybrid, wider),
        (f"frequency choice+wanda {n}/8", "frequency", hybrid, wider),
        (f"prune-reap+wanda {n}/8", "cover", [("prune-reap", {"num_experts": wider}), alone(wider)], wider),
        (f"hc-smoe+wanda {n}/8", "cover", [("hc-smoe", {"num_experts": wider}), alone(wider)], wider),
        (f"wanda {n}/8", "cover", [alone(TOTAL)], TOTAL),
    ]


def main(argv=None):
    started = time.perf_counter()
    ap = draw_args(claim_parser(__doc__.splitlines()[0], calibration_tokens=1024), draws=3, windows=8)
    ap.add_argument("--size", type=int, default=4, help="experts kept of 8 (the hybrids: their weights' worth)")
    args = ap.parse_args(argv)
    if args.quick:  # claim 1 against the frequency choice only: 2 draws of 2 windows, 256 calibration tokens
        args.windows, args.draws, args.no_record = 2, min(args.draws, 2), True
        args.calibration_tokens = min(args.calibration_tokens, 256)
    domain = "code" if args.quick else "mixed"  # quick: one domain's train split to tokenize, not two
    torch.set_num_threads(args.threads)
    base = load_model(args.model)
    tok = zoo.load_tokenizer(args.model)
    n, plan = args.size, runs(args.size, args.quick)
    geos, ppls, harmonic, same = {}, {}, [], {}

    def evaluate(label, model, i):
        g, p = draw_geo(model, tok, i, args.windows)
        geos.setdefault(label, []).append(g)
        ppls.setdefault(label, []).append(p)

    for i in range(args.draws):  # repeat i: calibration seed i (and random choice seed i), evaluation draw i
        cal = calibration.corpus(domain, tokens=args.calibration_tokens, seed=i)
        evaluate("base", base, i)
        models = {}
        for label, kind, steps, _ in plan:
            model = copy.deepcopy(base)
            with choice(kind, seed=i):
                for name, options in steps:
                    model = zoo.apply(model, name, calibration=cal, **options)
            hodge = model.config.zoo_recipe[-1].get("results", {}).get("hodge") if label.startswith("hodge") else None
            if hodge and "+" not in label:  # the harmonic share of the barrier signal's energy, mean over layers
                harmonic.append(sum(h["energy"]["harmonic"] for h in hodge.values()) / len(hodge))
            evaluate(label, model, i)
            models[label] = model
            print(f"draw {i} {label}: geo-mean {geos[label][-1]:.3f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        for a, b in ((f"hodge-cover {n}/8", f"frequency choice {n}/8"), (f"hodge-cover {n}/8", f"random choice {n}/8"),
                     (f"hodge-cover+wanda {n}/8", f"frequency choice+wanda {n}/8")):
            if a in models and b in models:  # the same weights in every draw: one model
                same[a, b] = same.get((a, b), True) and claims.same_weights(models[a], models[b])
        del models

    kept = {label: k for label, _, _, k in plan}
    rows = []
    for label, per in geos.items():
        pooled = {d: math.exp(sum(math.log(p[d]) for p in ppls[label]) / len(per)) for d in ppls[label][0]}
        rows.append({"method": label, "experts": kept.get(label, TOTAL),
                     **{f"ppl {d}": round(v, 3) for d, v in pooled.items()},
                     "ppl geo-mean": round(sum(per) / len(per), 3),
                     "geo-mean by draw": "/".join(f"{g:.3f}" for g in per)})
    cosine = expert_cosine(base)
    settings = (f"{args.model}, held-out split, {args.draws} disjoint evaluation draws of {args.windows} windows x 256 "
                f"tokens per domain (paired), repeat i calibrated on {args.calibration_tokens} {domain} train tokens "
                f"of seed i; measure: geometric mean of the per-domain perplexity; one thread")
    print(f"\n{settings}\nmean |cosine| between two experts' weights in a layer: {cosine:.4f}")
    show(rows)

    def compare(a, b, why=""):
        s = same.get((a, b), False)
        return claims.judge(geos[a], geos[b], paired=True, same_model=s, why_same=why if s else "")

    cover = f"hodge-cover {n}/8"
    claim1 = {f"{cover} vs frequency choice {n}/8 (same merge)": compare(
        cover, f"frequency choice {n}/8", "the cover kept the most routed experts")}
    beside1, beside2, claim2 = {}, {}, {}
    if not args.quick:
        claim1[f"{cover} vs random choice {n}/8 (same merge)"] = compare(
            cover, f"random choice {n}/8", "the random draw kept the cover's experts")
        beside1 = {f"{cover} vs {b} {n}/8 (beside the claim, not in its verdict)": compare(cover, f"{b} {n}/8")
                   for b in ("prune-reap", "hc-smoe map")}
        hybrid = f"hodge-cover+wanda {n}/8"
        claim2 = {f"{hybrid} vs frequency choice+wanda {n}/8 (same recipe)": compare(
            hybrid, f"frequency choice+wanda {n}/8", "the cover kept the most routed experts")}
        beside2 = {f"{hybrid} vs {b} {n}/8 (beside the claim, not in its verdict)": compare(hybrid, f"{b} {n}/8")
                   for b in ("prune-reap+wanda", "hc-smoe+wanda", "wanda", "prune-reap")}
    verdicts = [(CLAIM_1, conclude(CLAIM_1, claim1, "paired draws"), claim1, beside1)]
    if claim2:
        verdicts.append((CLAIM_2, conclude(CLAIM_2, claim2, "paired draws"), claim2, beside2))
    for name, j in {**beside1, **beside2}.items():
        print(f"  (beside) {name}: {j['verdict']}, margin {j['margin']:.4g} vs noise {j['noise']:.4g}")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return rows

    suffix = "" if args.model == "zoo-tiny-moe" else f" (on {args.model})"
    command = "python benchmarks/hodge_cover.py" + (f" --model {args.model}" if args.model != "zoo-tiny-moe" else "")
    command += f" --draws {args.draws}" if args.draws != 3 else ""
    command += f" --windows {args.windows}" if args.windows != 8 else ""
    command += f" --calibration-tokens {args.calibration_tokens}" if args.calibration_tokens != 1024 else ""
    command += f" --size {n}" if n != 4 else ""
    context = (f"Mean |cosine| of two experts' weights in a layer: {cosine:.3f}; harmonic share of the barrier "
               f"signal's energy, mean over layers and draws: {sum(harmonic) / max(1, len(harmonic)):.2f}. "
               f"Settings: {settings}.")
    what = {CLAIM_1: f"At {n}/8 experts the control is the same hodge-cover run with the kept experts chosen by "
                     f"routing frequency or at random (same barriers, same frequency-weighted merge into the "
                     f"lowest-barrier survivor): it lacks only the cover. Beside the claim, against its baselines "
                     f"(sub-moe left out for time): ",
            CLAIM_2: f"At {n}/8 of the expert weights the hybrids keep {n + 2} experts and Wanda-prune them to the "
                     f"same count of nonzero expert weights ('wanda': all 8 experts pruned to it; stored dense here, "
                     f"so the bytes do not shrink without a sparse format); the control is the same recipe on the "
                     f"{n + 2} most routed experts (it lacks only the cover). Beside the claim, the hybrid axis and "
                     f"REAP's expert reduction: "}
    for claim, verdict, judgements, beside in verdicts:
        summary = f"{verdict_parts(judgements)}. {what[claim]}{verdict_parts(beside)}. {context}"
        claims.record("hodge-cover", claim + suffix, verdict, summary, rows, command, args.model,
                      judgements={**judgements, **beside})
    return rows


if __name__ == "__main__":
    main()
