"""The quantize allocations' claims on zoo-tiny-moe, in one run, recorded in docs/claims/quantize.json:

* PMQ (MC#): its calibrated allocation beats uniform and random allocations at the same average bits;
* AlphaQ: its calibration-free allocation (weight-spectrum alphas) beats uniform at the same average bits.

The rows are benchmarks/compression.py's quantize rows (3 bits: uniform / random / pmq / alphaq with widths
2, 3, 4; 2.5 bits: random / pmq / alphaq, where uniform brackets it at 2 and 3 bits), measured with its
``measure``-style held-out perplexity per domain (``zoo.eval``), on one thread.

    python benchmarks/quantize_claims.py                 # 8 windows x 256 tokens per domain, 8192 calibration tokens
    python benchmarks/quantize_claims.py --no-record     # print only
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compression import RUNS  # noqa: E402  (the quantize rows of the compression table)

from claim_args import claim_parser, geo  # noqa: E402
import zoo  # noqa: E402
from zoo import calibration  # noqa: E402
from zoo.eval import perplexity_and_usage  # noqa: E402
from zoo.layout import moe_layers  # noqa: E402


def quantize_rows():
    keep = ("quantize 3b", "quantize 2b uniform", "quantize 2.5b")
    return [(label.removeprefix("quantize "), options) for label, name, options in RUNS
            if name == "quantize" and label.startswith(keep)]


def main(argv=None):
    args = claim_parser(__doc__.splitlines()[0], calibration_tokens=8192).parse_args(argv)
    torch.set_num_threads(args.threads)
    base = zoo.load(args.model).eval()
    tok = zoo.load_tokenizer(args.model)
    cal = calibration.corpus("mixed", tokens=args.calibration_tokens)
    with torch.no_grad():
        ref, _ = perplexity_and_usage(base, tok, max_windows=args.windows)
    rows = [{"method": "base (fp32)", "avg bits": 32.0, "experts at 2/3/4/8 bits": "-", **{f"ppl {d}": round(v, 3) for d, v in ref.items()},
             "ppl geo-mean": round(geo(ref), 3), "expert MB": round(sum(m.experts.nbytes() for _, m in moe_layers(base)) / 1e6, 3)}]
    results = {}
    for label, options in quantize_rows():
        model = zoo.apply(copy.deepcopy(base), "quantize", calibration=cal, **options)
        with torch.no_grad():
            ppl, _ = perplexity_and_usage(model, tok, max_windows=args.windows)
        bits = [b for layer in model.config.zoo_recipe[-1]["results"]["bits"].values() for b in layer]
        results[label] = ppl
        rows.append({"method": label, "avg bits": round(sum(bits) / len(bits), 3),
                     "experts at 2/3/4/8 bits": "/".join(str(bits.count(b)) for b in (2, 3, 4, 8)),
                     **{f"ppl {d}": round(v, 3) for d, v in ppl.items()}, "ppl geo-mean": round(geo(ppl), 3),
                     "expert MB": round(sum(m.experts.nbytes() for _, m in moe_layers(model)) / 1e6, 3)})
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print(f"\nmodel {args.model}, {args.windows} windows x 256 tokens per domain (held-out split), calibration "
          f"{args.calibration_tokens} mixed train tokens, torch threads {args.threads}")
    print(" | ".join(f"{k:>14}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>14}" if isinstance(r[k], str) else f"{r[k]:14.3f}" for k in keys))

    domains = list(ref)
    def beats(a, b):  # per domain: a's perplexity below b's
        return [results[a][d] < results[b][d] for d in domains]
    pmq_cmp = {"3b pmq < 3b uniform": beats("3b pmq", "3b uniform"), "3b pmq < 3b random": beats("3b pmq", "3b random"),
               "2.5b pmq < 2.5b random": beats("2.5b pmq", "2.5b random")}
    alpha_cmp = {"3b alphaq < 3b uniform": beats("3b alphaq", "3b uniform")}  # the claim: against uniform
    alpha_extra = {"2.5b alphaq < 2.5b random": beats("2.5b alphaq", "2.5b random")}
    widths = {r["method"]: r["experts at 2/3/4/8 bits"] for r in rows}

    def verdict(cmp):
        wins = [w for v in cmp.values() for w in v]
        return "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"

    def describe(cmp):
        return "; ".join(f"{k}: " + ", ".join(f"{d} {'yes' if w else 'no'}" for d, w in zip(domains, v))
                         for k, v in cmp.items())
    settings = (f"zoo-tiny-moe, held-out split, {args.windows} windows x 256 tokens per domain, calibration "
                f"{args.calibration_tokens} mixed train tokens (pmq only), widths 2/3/4, one thread")
    print("\nPMQ:", verdict(pmq_cmp), "-", describe(pmq_cmp))
    print("AlphaQ:", verdict(alpha_cmp), "-", describe(alpha_cmp), "; also", describe(alpha_extra))
    if args.no_record:
        return
    from zoo.claims import record

    command = "python benchmarks/quantize_claims.py" + (f" --windows {args.windows}" if args.windows != 8 else "")
    record("quantize", "PMQ (MC#): the calibrated per-expert bit allocation beats uniform and random allocations at "
           "equal average bits", verdict(pmq_cmp), f"{describe(pmq_cmp)}. Settings: {settings}.", rows, command,
           args.model)
    record("quantize", "AlphaQ: the calibration-free (weight-spectrum) allocation beats uniform at equal average bits",
           verdict(alpha_cmp), f"{describe(alpha_cmp)} (experts at 2/3/4/8 bits: alphaq {widths['3b alphaq']}, uniform "
           f"{widths['3b uniform']}). Uniform cannot make 2.5 bits; there, against random: {describe(alpha_extra)} "
           f"(uniform 2 and 3 bits bracket it). Settings: {settings}.", rows, command, args.model)


if __name__ == "__main__":
    main()
