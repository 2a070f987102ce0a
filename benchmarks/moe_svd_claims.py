"""MoE-SVD's claims on zoo-tiny-moe, in one run, recorded in docs/claims/moe-svd.json:

1. sharing one V per layer (with each expert's own U) beats per-expert SVD at equal parameters (the baseline is
   benchmarks/compression.py's ``per_expert_svd``: each expert's own scaled truncated SVD at the same count);
2. U-matrix trimming (top-k U selection, ``u_keep=0.5``) beats keeping every U at equal parameters (the kept
   budget goes to a higher rank);
3. selective decomposition (the paper's sensitivity score picks the layers) beats decomposing every layer at the
   same total parameters; the zoo's own energy score is judged beside it, not in the verdict.

Each claim is one comparison with a control that lacks only the mechanism, decided by the one rule
(``zoo.evaluation.claims.judge``). The method is calibrated, so the repeats are calibration draws: repeat i of every
arm is calibrated on calibration seed i and evaluated on disjoint evaluation draw i (paired); the measure of a
draw is the geometric mean over domains of its held-out perplexity.

    python benchmarks/moe_svd_claims.py                # 3 draws x 8 windows x 256 tokens, 4096 calibration tokens
    python benchmarks/moe_svd_claims.py --no-record
    python benchmarks/moe_svd_claims.py --quick        # 2 draws x 2 windows, claim 2 on one layer; records nothing
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression import per_expert_svd  # noqa: E402  (the per-expert SVD baseline)

from claim_args import claim_parser, conclude, draw_args, draw_geo, load_model, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation.claims import judge, same_weights  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402

PER_EXPERT = "per-expert SVD, all layers 0.5"
RUNS = [  # (label, options); every layer at 0.5 (layer_ratio 1.0) for the equal-parameter comparisons
    ("shared V, all layers 0.5", {"ratio": 0.5, "layer_ratio": 1.0}),
    ("shared V + U-trim 0.5, all layers 0.5", {"ratio": 0.5, "layer_ratio": 1.0, "u_keep": 0.5}),
    ("all layers 0.75", {"ratio": 0.75, "layer_ratio": 1.0}),
    ("selective (paper score) 0.75", {"ratio": 0.75, "layer_ratio": 0.5, "sensitivity": "paper"}),
    ("selective (energy score) 0.75", {"ratio": 0.75, "layer_ratio": 0.5, "sensitivity": "energy"}),
]
CLAIMS = [  # (claim, mechanism arm, control arm lacking only the mechanism, why the two could be one model)
    ("Sharing one V per layer beats per-expert SVD at equal parameters",
     "shared V, all layers 0.5", PER_EXPERT, ""),
    ("U-matrix trimming (top-k U selection) beats keeping every U at equal parameters",
     "shared V + U-trim 0.5, all layers 0.5", "shared V, all layers 0.5", "trimming changed no factor"),
    ("Selective decomposition by the paper's sensitivity score beats decomposing every layer at equal parameters",
     "selective (paper score) 0.75", "all layers 0.75", "the score picked every layer"),
]
BESIDE = ("selective (paper score) 0.75", "selective (energy score) 0.75", "the two scores picked the same layers")


def main(argv=None):
    started = time.perf_counter()
    args = draw_args(claim_parser(__doc__.splitlines()[0], calibration_tokens=4096), draws=3, windows=8)\
        .parse_args(argv)
    claims, beside, runs = CLAIMS, BESIDE, RUNS + [(PER_EXPERT, None)]
    if args.quick:  # the whole path on claim 2's two arms, one layer factored (to 0.5): 2 draws of 2 windows
        args.windows, args.draws, args.no_record = 2, min(args.draws, 2), True
        args.calibration_tokens = min(args.calibration_tokens, 256)
        claims, beside = CLAIMS[1:2], None
        runs = [(label, {**options, "ratio": 0.95, "layer_ratio": 0.5}) for label, options in RUNS[:2]]
    domain = "code" if args.quick else "mixed"  # quick: one domain's train split to tokenize, not two
    torch.set_num_threads(args.threads)
    base = load_model(args.model)
    tok = zoo.load_tokenizer(args.model)
    dense_params = sum(m.experts.num_parameters() for _, m in moe_layers(base))
    geos = {label: [] for label, _ in [("base", None), *runs]}
    ppls = {label: [] for label in geos}
    extra, same = {}, {}

    def evaluate(label, model, i):
        g, p = draw_geo(model, tok, i, args.windows)
        geos[label].append(g)
        ppls[label].append(p)

    for i in range(args.draws):  # repeat i: calibration seed i, evaluation draw i
        evaluate("base", base, i)
        cal = calibration.corpus(domain, tokens=args.calibration_tokens, seed=i)
        models = {}
        for label, options in runs:
            if options is None:  # stored dense; counts what a factored store keeps
                model = per_expert_svd(copy.deepcopy(base), cal, 0.5)
                extra.setdefault(label, {"expert params kept": 0.5, "layers factored": "all", "rank": "per expert"})
            else:
                model = zoo.apply(copy.deepcopy(base), "moe-svd", calibration=cal, **options)
                res = model.config.zoo_recipe[-1]["results"]
                params = sum(m.experts.num_parameters() for _, m in moe_layers(model))
                extra.setdefault(label, {"expert params kept": round(params / dense_params, 3),
                                         "layers factored": ",".join(map(str, res["decomposed"])),
                                         "rank": ",".join(map(str, res["rank"].values()))})
            evaluate(label, model, i)
            models[label] = model
            print(f"draw {i} {label}: geo-mean {geos[label][-1]:.3f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
        for a, b in [c[1:3] for c in claims] + ([beside[:2]] if beside else []):  # the same weights in every draw
            same[(a, b)] = same.get((a, b), True) and same_weights(models[a], models[b])
        del models

    rows = []
    for label in geos:
        pooled = {d: math.exp(sum(math.log(p[d]) for p in ppls[label]) / len(ppls[label])) for d in ppls[label][0]}
        rows.append({"method": label, **extra.get(label, {"expert params kept": 1.0}),
                     **{f"ppl {d}": round(v, 3) for d, v in pooled.items()},
                     "ppl geo-mean": round(sum(geos[label]) / len(geos[label]), 3),
                     "geo-mean by draw": "/".join(f"{g:.3f}" for g in geos[label])})
    settings = (f"{args.model}, held-out split, {args.draws} disjoint evaluation draws of {args.windows} windows x 256 "
                f"tokens per domain (paired), repeat i calibrated on {args.calibration_tokens} {domain} train tokens "
                f"of seed i; measure: geometric mean of the per-domain perplexity; one thread")
    print(f"\n{settings}")
    show(rows)

    def compare(a, b, why):
        return judge(geos[a], geos[b], paired=True, same_model=same[(a, b)], why_same=why if same[(a, b)] else "")

    verdicts = []
    for claim, a, b, why in claims:
        judgements = {f"{a} vs {b}": compare(a, b, why)}
        if beside and claim.startswith("Selective"):
            judgements[f"{beside[0]} vs {beside[1]} (beside the claim, not in its verdict)"] = compare(*beside)
        verdict = conclude(claim, {k: j for k, j in judgements.items() if "beside" not in k}, "paired draws")
        for name, j in judgements.items():
            if "beside" in name:
                print(f"  (beside) {name}: {j['verdict']}, margin {j['margin']:.4g} vs noise {j['noise']:.4g}")
        verdicts.append((claim, verdict, judgements))
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    command = "python benchmarks/moe_svd_claims.py"
    command += f" --draws {args.draws}" if args.draws != 3 else ""
    command += f" --windows {args.windows}" if args.windows != 8 else ""
    command += f" --calibration-tokens {args.calibration_tokens}" if args.calibration_tokens != 4096 else ""
    by = {r["method"]: r for r in rows}
    for claim, verdict, judgements in verdicts:
        a, b = next((a, b) for c, a, b, _ in claims if c == claim)
        summary = (f"{verdict_parts(judgements)}. Geometric-mean perplexity {by[a]['ppl geo-mean']} ({a}) vs "
                   f"{by[b]['ppl geo-mean']} ({b}), base {by['base']['ppl geo-mean']}. Settings: {settings}.")
        record("moe-svd", claim, verdict, summary, rows, command, args.model, judgements=judgements)


if __name__ == "__main__":
    main()
