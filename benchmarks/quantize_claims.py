"""The quantize allocations' claims on zoo-tiny-moe, in one run, recorded in docs/claims/quantize.json:

* PMQ (MC#): its calibrated allocation beats uniform and random allocations at the same average bits;
* AlphaQ: its calibration-free allocation (weight-spectrum alphas) beats uniform at the same average bits.

Quantization by rounding is deterministic, so the repeats are evaluation draws: ``--draws`` disjoint sets of
``--windows`` held-out windows per domain, the same for both arms (``zoo.evaluation.claims.judge(paired=True)``); the measure of
a draw is the geometric mean over domains of its perplexity. PMQ also varies with its calibration, so its repeat i is
calibrated on calibration draw i (``calibration.corpus(seed=i)``) and evaluated on evaluation draw i: the noise the
judge sees holds both. An arm that is the same model as its control (``zoo.evaluation.claims.same_weights``) is inconclusive.

The comparisons (widths 2/3/4 unless said): PMQ at 3 bits against uniform and random, at 2.5 bits against random
(uniform cannot make 2.5); AlphaQ at 3 bits against uniform, and, where its allocation has room to differ from one
width for all, at 2.5, 3.5 and 4.5 bits (widths 2/3/4/8) against the same exact program with every expert's importance
1 (``error-only``: what AlphaQ is without the spectra, the control that lacks only its mechanism, since uniform widths
cannot make a fractional average); AlphaQ against random at 2.5 bits is shown beside, not in the verdict.

    python benchmarks/quantize_claims.py                 # 4 draws x 16 windows x 256 tokens, 8192 calibration tokens
    python benchmarks/quantize_claims.py --no-record     # print only
    python benchmarks/quantize_claims.py --quick         # 2 draws x 2 windows, 3 bits, 512 tokens; records nothing
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import (claim_parser, draw_args, draw_geo, draws_geo, judgement_line, load_model,  # noqa: E402
                        show, verdict_parts)
import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation.claims import combine, judge, same_weights  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402

NARROW = [2, 3, 4]


def runs(quick: bool):
    """(label, options) of the deterministic runs (PMQ's are made per calibration draw)."""
    out = [("3b uniform", {"bits": 3}), ("3b random", {"bits": 3, "allocation": "random", "widths": NARROW}),
           ("3b alphaq", {"bits": 3, "allocation": "alphaq", "widths": NARROW})]
    if quick:
        return out
    out += [("2b uniform", {"bits": 2}), ("4b uniform", {"bits": 4}),  # the uniform widths around the budgets
            ("2.5b random", {"bits": 2.5, "allocation": "random", "widths": NARROW})]
    for bits, widths in ((2.5, NARROW), (3.5, NARROW), (4.5, [2, 3, 4, 8])):
        out += [(f"{bits}b alphaq", {"bits": bits, "allocation": "alphaq", "widths": widths}),
                (f"{bits}b error-only", {"bits": bits, "allocation": "alphaq", "widths": widths, "_equal": True})]
    return out


@contextlib.contextmanager
def equal_importance():
    """AlphaQ's program with every expert's alpha equal, so importance mean(alpha) / alpha_e is 1 for all: the widths
    are chosen by the quantization error alone (the compressor is not changed: its spectrum fit is swapped here)."""
    import zoo_compressors.quantize as q

    fitted = q.esd_alpha
    q.esd_alpha = lambda w, *a, **k: 1.0
    try:
        yield
    finally:
        q.esd_alpha = fitted


def main(argv=None):
    started = time.perf_counter()
    args = draw_args(claim_parser(__doc__.splitlines()[0], calibration_tokens=8192)).parse_args(argv)
    if args.quick:  # a smoke run of the whole path: 2 draws of 2 windows, the 3-bit budget only
        args.windows, args.draws, args.no_record = 2, min(args.draws, 2), True
        args.calibration_tokens = min(args.calibration_tokens, 512)
    torch.set_num_threads(args.threads)
    base = load_model(args.model)
    tok = zoo.load_tokenizer(args.model)
    geos, models, rows = {}, {}, []

    def widths_of(model):
        return [b for layer in model.config.zoo_recipe[-1]["results"]["bits"].values() for b in layer]

    def add_row(label, per_draw, ppl, bits, split_bits, mb):
        geos[label] = per_draw
        rows.append({"method": label, "avg bits": bits, "experts at 2/3/4/8 bits": split_bits,
                     **{f"ppl {d}": round(v, 3) for d, v in ppl.items()},
                     "ppl geo-mean": round(sum(per_draw) / len(per_draw), 3),
                     "geo-mean by draw": "/".join(f"{g:.3f}" for g in per_draw), "expert MB": mb})
        print(rows[-1], flush=True)

    def size(model):
        return round(sum(m.experts.nbytes() for _, m in moe_layers(model)) / 1e6, 3)

    def split(bits):
        return "/".join(str(bits.count(b)) for b in (2, 3, 4, 8))

    per_draw, ppl = draws_geo(base, tok, args.draws, args.windows)
    add_row("base (fp32)", per_draw, ppl, 32.0, "-", size(base))
    for label, options in runs(args.quick):
        options = dict(options)
        with equal_importance() if options.pop("_equal", False) else contextlib.nullcontext():
            model = zoo.apply(copy.deepcopy(base), "quantize", **options)
        bits = widths_of(model)
        per_draw, ppl = draws_geo(model, tok, args.draws, args.windows)
        models[label] = model
        add_row(label, per_draw, ppl, round(sum(bits) / len(bits), 3), split(bits), size(model))
    budgets = (3,) if args.quick else (3, 2.5)
    for bits in budgets:  # PMQ: calibration draw i, evaluated on evaluation draw i
        label, per, ppls, splits, avg, mb = f"{bits}b pmq", [], [], [], [], []
        models[label] = []
        for i in range(args.draws):
            cal = calibration.corpus("mixed", tokens=args.calibration_tokens, seed=i)
            model = zoo.apply(copy.deepcopy(base), "quantize", calibration=cal, bits=bits, allocation="pmq",
                              widths=NARROW)
            g, p = draw_geo(model, tok, i, args.windows)
            per.append(g)
            ppls.append(p)
            w = widths_of(model)
            splits.append(split(w))
            avg.append(round(sum(w) / len(w), 3))
            mb.append(size(model))
            models[label].append(model)
        pooled = {d: math.exp(sum(math.log(p[d]) for p in ppls) / len(ppls)) for d in ppls[0]}  # equal tokens
        add_row(label, per, pooled, avg[0] if len(set(avg)) == 1 else " ; ".join(map(str, avg)), " ; ".join(splits),
                mb[0] if len(set(mb)) == 1 else " ; ".join(map(str, mb)))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\nmodel {args.model}, {args.draws} draws x {args.windows} windows x 256 tokens per domain (held-out "
          f"split), calibration {args.calibration_tokens} mixed train tokens per draw (pmq), torch threads "
          f"{args.threads}")
    show([{k: r.get(k, "") for k in keys} for r in rows])

    def compare(mech, ctrl, why_same=""):
        arms = models[mech] if isinstance(models[mech], list) else [models[mech]]
        same = all(same_weights(m, models[ctrl]) for m in arms)
        return judge(geos[mech], geos[ctrl], paired=True, same_model=same, why_same=why_same if same else "")

    def one_width(label):
        arms = models[label] if isinstance(models[label], list) else [models[label]]
        ws = {b for m in arms for b in widths_of(m)}
        return f"the allocation gave every expert {ws.pop()} bits, which is the uniform run" if len(ws) == 1 else ""

    pmq_cmp = {"3b pmq vs 3b uniform": compare("3b pmq", "3b uniform", one_width("3b pmq")),
               "3b pmq vs 3b random": compare("3b pmq", "3b random", "the allocations agree")}
    alpha_cmp = {"3b alphaq vs 3b uniform": compare(
        "3b alphaq", "3b uniform", one_width("3b alphaq") + " (at a whole-number budget the exact program's best use "
        "of widths 2/3/4 is that width for every expert)")}
    context = {}
    if not args.quick:
        pmq_cmp["2.5b pmq vs 2.5b random"] = compare("2.5b pmq", "2.5b random", "the allocations agree")
        for bits in (2.5, 3.5, 4.5):
            alpha_cmp[f"{bits}b alphaq vs {bits}b error-only"] = compare(
                f"{bits}b alphaq", f"{bits}b error-only", "the spectra did not change any expert's width")
        context["2.5b alphaq vs 2.5b random (beside the claim, not in its verdict)"] = compare(
            "2.5b alphaq", "2.5b random", "the allocations agree")
    pmq_verdict = combine(j["verdict"] for j in pmq_cmp.values())
    alpha_verdict = combine(j["verdict"] for j in alpha_cmp.values())
    widths = {r["method"]: r["experts at 2/3/4/8 bits"] for r in rows}
    print("\nPMQ:", pmq_verdict)
    for name, j in pmq_cmp.items():
        print("  - " + judgement_line(name, j))
    print("AlphaQ:", alpha_verdict)
    for name, j in {**alpha_cmp, **context}.items():
        print("  - " + judgement_line(name, j))
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    command = "python benchmarks/quantize_claims.py"
    command += f" --draws {args.draws}" if args.draws != 4 else ""
    command += f" --windows {args.windows}" if args.windows != 16 else ""
    command += f" --calibration-tokens {args.calibration_tokens}" if args.calibration_tokens != 8192 else ""
    settings = (f"{args.model}, held-out split, {args.draws} disjoint evaluation draws of {args.windows} windows x 256 "
                f"tokens per domain, the same for both arms (paired); measure: geometric mean of the per-domain "
                f"perplexity; pmq's repeat i calibrated on {args.calibration_tokens} mixed train tokens of seed i; "
                f"one thread")

    alpha_widths = ", ".join(f"{b}b alphaq {widths[f'{b}b alphaq']} vs error-only {widths[f'{b}b error-only']}"
                             for b in (2.5, 3.5, 4.5))
    claims = [("PMQ (MC#): the calibrated per-expert bit allocation beats uniform and random allocations at equal "
               "average bits", pmq_verdict,
               f"{verdict_parts(pmq_cmp)} (experts at 2/3/4/8 bits per calibration draw: 3b pmq {widths['3b pmq']}; 2.5b pmq "
               f"{widths['2.5b pmq']}; random 3b {widths['3b random']}, 2.5b {widths['2.5b random']}). Settings: "
               f"{settings}.", pmq_cmp),
              ("AlphaQ: the calibration-free (weight-spectrum) allocation beats uniform at equal average bits",
               alpha_verdict,
               f"{verdict_parts(alpha_cmp)}. At 3 bits AlphaQ allocates exactly like uniform (experts at 2/3/4/8 bits: "
               f"{widths['3b alphaq']}), so that comparison is empty; at fractional budgets, where uniform widths "
               f"cannot go, the control is the same exact program with every expert's importance 1 (error-only: "
               f"AlphaQ without the spectra): {alpha_widths}. Beside the claim, "
               f"{verdict_parts(context)}. Settings: {settings}.", {**alpha_cmp, **context})]
    for claim, verdict, summary, judgements in claims:
        record("quantize", claim, verdict, summary, rows, command, args.model, judgements=judgements)


if __name__ == "__main__":
    main()
