"""MoE-SVD's claims on zoo-tiny-moe, in one run, recorded in docs/claims/moe-svd.json:

1. sharing one V per layer (with each expert's own U) beats per-expert SVD at equal parameters (the baseline is
   benchmarks/compression.py's ``per_expert_svd``: each expert's own scaled truncated SVD at the same count);
2. U-matrix trimming (top-k U selection, ``u_keep=0.5``) beats keeping every U at equal parameters (the kept
   budget goes to a higher rank);
3. selective decomposition (the paper's sensitivity score picks the layers) beats decomposing every layer at the
   same total parameters; the zoo's own energy score is measured beside it.

    python benchmarks/moe_svd_claims.py                # 8 windows x 256 tokens per domain, 4096 calibration tokens
    python benchmarks/moe_svd_claims.py --no-record
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression import per_expert_svd  # noqa: E402  (the per-expert SVD baseline)

from claim_args import claim_parser, geo  # noqa: E402
import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation.eval import perplexity_and_usage  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402

RUNS = [  # (label, options); every layer at 0.5 (layer_ratio 1.0) for the equal-parameter comparisons
    ("shared V, all layers 0.5", {"ratio": 0.5, "layer_ratio": 1.0}),
    ("shared V + U-trim 0.5, all layers 0.5", {"ratio": 0.5, "layer_ratio": 1.0, "u_keep": 0.5}),
    ("all layers 0.75", {"ratio": 0.75, "layer_ratio": 1.0}),
    ("selective (paper score) 0.75", {"ratio": 0.75, "layer_ratio": 0.5, "sensitivity": "paper"}),
    ("selective (energy score) 0.75", {"ratio": 0.75, "layer_ratio": 0.5, "sensitivity": "energy"}),
    ("selective (paper) + U-trim 0.75", {"ratio": 0.75, "layer_ratio": 0.5, "u_keep": 0.5}),
]


def main(argv=None):
    args = claim_parser(__doc__.splitlines()[0], calibration_tokens=4096).parse_args(argv)
    torch.set_num_threads(args.threads)
    base = zoo.load(args.model).eval()
    tok = zoo.load_tokenizer(args.model)
    cal = calibration.corpus("mixed", tokens=args.calibration_tokens)
    dense_params = sum(m.experts.num_parameters() for _, m in moe_layers(base))

    def row(label, model, params=None, extra=None):
        with torch.no_grad():
            ppl, _ = perplexity_and_usage(model, tok, max_windows=args.windows)
        params = params if params is not None else sum(m.experts.num_parameters() for _, m in moe_layers(model))
        r = {"method": label, "expert params kept": round(params / dense_params, 3),
             **{f"ppl {d}": round(v, 3) for d, v in ppl.items()}, "ppl geo-mean": round(geo(ppl), 3), **(extra or {})}
        print(r, flush=True)
        return r

    rows = [row("base", base)]
    for label, options in RUNS:
        model = zoo.apply(copy.deepcopy(base), "moe-svd", calibration=cal, **options)
        res = model.config.zoo_recipe[-1]["results"]
        rows.append(row(label, model, extra={"layers factored": ",".join(map(str, res["decomposed"])),
                                             "rank": ",".join(map(str, res["rank"].values()))}))
    model = per_expert_svd(copy.deepcopy(base), cal, 0.5)  # stored dense; counts what a factored store keeps
    rows.append(row("per-expert SVD, all layers 0.5", model, params=0.5 * dense_params,
                    extra={"layers factored": "all", "rank": "per expert"}))
    by = {r["method"]: r for r in rows}
    domains = [k.removeprefix("ppl ") for k in rows[0] if k.startswith("ppl ") and k != "ppl geo-mean"]

    def cmp(a, b):
        return {d: by[a][f"ppl {d}"] < by[b][f"ppl {d}"] for d in domains}

    def verdict(c):
        wins = list(c.values())
        return "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"

    def say(a, b, c):
        return f"{a} vs {b}: " + ", ".join(f"{d} {by[a]['ppl ' + d]:.2f} vs {by[b]['ppl ' + d]:.2f} "
                                           f"({'better' if w else 'not better'})" for d, w in c.items())

    claims = [
        ("Sharing one V per layer beats per-expert SVD at equal parameters",
         "shared V, all layers 0.5", "per-expert SVD, all layers 0.5"),
        ("U-matrix trimming (top-k U selection) beats keeping every U at equal parameters",
         "shared V + U-trim 0.5, all layers 0.5", "shared V, all layers 0.5"),
        ("Selective decomposition by the paper's sensitivity score beats decomposing every layer at equal parameters",
         "selective (paper score) 0.75", "all layers 0.75"),
    ]
    settings = (f"{args.model}, held-out split, {args.windows} windows x 256 tokens per domain, calibration "
                f"{args.calibration_tokens} mixed train tokens, one thread")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\n{settings}")
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    for claim, a, b in claims:
        c = cmp(a, b)
        print(f"{claim}: {verdict(c)} - {say(a, b, c)}")
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    energy = cmp("selective (paper score) 0.75", "selective (energy score) 0.75")
    command = "python benchmarks/moe_svd_claims.py"
    for claim, a, b in claims:
        c = cmp(a, b)
        note = (f" Paper score vs the zoo's energy score at 0.75: "
                + ", ".join(f"{d} {'better' if w else 'not better'}" for d, w in energy.items()) + "."
                if "Selective" in claim else "")
        record("moe-svd", claim, verdict(c), f"{say(a, b, c)}.{note} Settings: {settings}.", rows, command, args.model)


if __name__ == "__main__":
    main()
