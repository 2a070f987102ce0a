"""The quantize formats' claims on zoo-tiny-moe, in one run, recorded in docs/claims/quantize.json:

* FineQuant (group_size="adaptive"): per-matrix group sizes chosen by the error they cause beat uniform group sizes
  at no more bytes;
* BitMoD (dtype="bitmod"): each group's choice among FP types with special values beats one type for all groups
  (plain FP, dtype="fp") and the integer grid (dtype="int") at the same group size and about the same bytes.

Rounding is deterministic, so the repeats are evaluation draws: ``--draws`` disjoint sets of ``--windows`` held-out
windows per domain, the same for every arm. The measure of a draw is the geometric mean over domains of its
perplexity; ``zoo.evaluation.claims.judge`` (paired) decides each comparison against the spread of the per-draw differences,
an arm that is the same model as its control (``zoo.evaluation.claims.same_weights``) is inconclusive, and ``combine`` gives
each claim's verdict. Bytes are the experts' stored bytes (codes, bf16 scales and zeros, BitMoD's 2-bit type id per
group), as ``nbytes()`` counts them; the weight error (sum ||W - Q(W)||^2 / sum ||W||^2 over all experts), the
quantity both methods minimise, is shown beside it.

    python benchmarks/quantize_formats_claims.py                 # 4 draws x 16 windows x 256 tokens per domain
    python benchmarks/quantize_formats_claims.py --no-record     # print only
    python benchmarks/quantize_formats_claims.py --quick         # 2 draws x 2 windows, 4 bits; records nothing
"""
from __future__ import annotations

import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import claim_parser, draw_args, draws_geo, judgement_line, load_model, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.evaluation.claims import combine, judge, same_weights  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402

ALPHAS = (0.3, 0.6, 1.0)  # FineQuant bounds: how much more error than group 32 a coarser group may cost
GROUP = 64  # BitMoD's comparisons: one group size for every data type
UNIFORM = (256, 128, 64, 32)


def runs(widths, alphas=ALPHAS, uniform=UNIFORM):
    out = []
    for bits in widths:
        out += [(f"{bits}b int g{g}", {"bits": bits, "group_size": g}) for g in uniform]
        out += [(f"{bits}b adaptive a={a}", {"bits": bits, "group_size": "adaptive", "group_alpha": a}) for a in alphas]
        out += [(f"{bits}b {d} g{GROUP}", {"bits": bits, "dtype": d, "group_size": GROUP}) for d in ("fp", "bitmod")]
    return out


def main(argv=None):
    started = time.perf_counter()
    args = draw_args(claim_parser(__doc__.splitlines()[0], calibration_tokens=0)).parse_args(argv)
    if args.quick:  # a smoke run of the whole path: 2 draws of 2 windows, 4 bits, one FineQuant bound
        args.windows, args.draws, args.no_record = 2, min(args.draws, 2), True
    # quick: the uniform run FineQuant's bound 0.6 and BitMoD are compared with (g64) is the only one
    widths, alphas, uniform = ((4,), (0.6,), (GROUP,)) if args.quick else ((4, 3), ALPHAS, UNIFORM)
    torch.set_num_threads(args.threads)
    base = load_model(args.model)
    tok = zoo.load_tokenizer(args.model)
    weights = sum(m.experts.num_parameters() for _, m in moe_layers(base))

    def weight_error(model) -> float:
        err = norm = 0.0
        for (_, dense), (_, moe) in zip(moe_layers(base), moe_layers(model)):
            for e in range(dense.num_experts):
                ref = (dense.experts.gate_up_proj[e].detach(), dense.experts.down_proj[e].detach())
                got = moe.experts.dequantized(e) if hasattr(moe.experts, "dequantized") else ref
                err += sum(float((w - q).pow(2).sum()) for w, q in zip(ref, got))
                norm += sum(float(w.pow(2).sum()) for w in ref)
        return err / norm

    geos, models = {}, {}

    def row(label, model, extra=None):
        with torch.no_grad():
            geos[label], ppl = draws_geo(model, tok, args.draws, args.windows)
            werr = None if args.quick else weight_error(model)  # slow (int4 dequantized through the kernel): full runs
        nbytes = sum(m.experts.nbytes() for _, m in moe_layers(model))
        r = {"method": label, "bits per weight": round(8 * nbytes / weights, 4), "expert MB": round(nbytes / 1e6, 4),
             **({} if werr is None else {"weight error": round(werr, 5)}),
             **{f"ppl {d}": round(v, 3) for d, v in ppl.items()},
             "ppl geo-mean": round(sum(geos[label]) / len(geos[label]), 3),
             "geo-mean by draw": "/".join(f"{g:.3f}" for g in geos[label]), **(extra or {})}
        print(r, flush=True)
        return r

    rows = [row("base (fp32)", base)]
    for label, options in runs(widths, alphas, uniform):
        model = zoo.apply(copy.deepcopy(base), "quantize", **options)
        res = model.config.zoo_recipe[-1]["results"]
        extra = {}
        if options.get("group_size") == "adaptive":
            sizes = [g for layer in res["group_size"].values() for g in layer.values()]
            extra["groups (gate_up+down stacks)"] = " ".join(f"{g}x{sizes.count(g)}" for g in sorted(set(sizes)))
        if options.get("dtype") == "bitmod":
            totals = {}
            for layer in res["types"].values():
                for t, n in layer.items():
                    totals[t] = totals.get(t, 0) + n
            extra["types er+/er-/ea+/ea-"] = "/".join(str(totals[t]) for t in ("er+", "er-", "ea+", "ea-"))
        models[label] = model
        rows.append(row(label, model, extra))
    print(f"\nmodel {args.model}, {args.draws} draws x {args.windows} windows x 256 tokens per domain (held-out split), "
          f"experts only, torch threads {args.threads}")
    show(rows)

    bpw = {r["method"]: r["bits per weight"] for r in rows}
    werr = {r["method"]: r.get("weight error", "-") for r in rows}
    groups = {r["method"]: r.get("groups (gate_up+down stacks)") for r in rows if "adaptive" in r["method"]}

    def compare(mech, ctrl, why_same=""):
        same = same_weights(models[mech], models[ctrl])
        return judge(geos[mech], geos[ctrl], paired=True, same_model=same, why_same=why_same if same else "")

    fine = {}
    for bits in widths:
        for a in alphas:
            label = f"{bits}b adaptive a={a}"
            # against the uniform group with the fewest bytes that still has at least as many as the adaptive row
            peer = next(f"{bits}b int g{g}" for g in uniform if bpw[f"{bits}b int g{g}"] >= bpw[label] - 1e-9)
            why = (f"the rule gave every projection stack group size {peer.rsplit('g', 1)[1]} ({groups[label]}), "
                   f"which is the uniform run")
            fine[f"{label} ({bpw[label]} b/w) vs {peer} ({bpw[peer]} b/w)"] = compare(label, peer, why)
    mod = {}
    for bits in widths:
        for other in ("fp", "int"):
            a, b = f"{bits}b bitmod g{GROUP}", f"{bits}b {other} g{GROUP}"
            mod[f"{a} ({bpw[a]} b/w) vs {b} ({bpw[b]} b/w)"] = compare(a, b)
    fine_verdict = combine(j["verdict"] for j in fine.values())
    mod_verdict = combine(j["verdict"] for j in mod.values())

    chosen = ", ".join(f"{k}: {v}" for k, v in groups.items())
    if all(" " not in v for v in groups.values()):  # one size per run: every adaptive run is a uniform run
        fine_note = (f"the rule gave every projection stack of a run the same group size ({chosen}): the experts' "
                     "error curves over group sizes are alike (near-Gaussian weights without outlier columns), so "
                     "there is nothing for a per-matrix choice to adapt to, and each adaptive run is the uniform run "
                     "of that size")
    else:
        fine_note = f"group sizes chosen per projection stack: {chosen}"
    mod_note = "weight error (what the per-group choice minimises): " + "; ".join(
        f"{bits}b bitmod {werr[f'{bits}b bitmod g{GROUP}']} vs fp {werr[f'{bits}b fp g{GROUP}']} vs int "
        f"{werr[f'{bits}b int g{GROUP}']}" for bits in widths)
    if args.quick:
        mod_note = "weight error not measured in a quick run"
    print(f"\nFineQuant: {fine_verdict} ({fine_note})")
    for name, j in fine.items():
        print("  - " + judgement_line(name, j))
    print(f"BitMoD: {mod_verdict} ({mod_note}; FP4 types: E2M1 with -0 as +-5 or +-8)")
    for name, j in mod.items():
        print("  - " + judgement_line(name, j))
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    command = "python benchmarks/quantize_formats_claims.py"
    command += f" --draws {args.draws}" if args.draws != 4 else ""
    command += f" --windows {args.windows}" if args.windows != 16 else ""
    settings = (f"{args.model}, held-out split, {args.draws} disjoint evaluation draws of {args.windows} windows x 256 "
                f"tokens per domain, the same for every arm (paired); measure: geometric mean of the per-domain "
                f"perplexity; experts only, one thread; bytes per weight count codes, bf16 scales/zeros and BitMoD's "
                f"2-bit type ids")

    claims = [("FineQuant (group_size='adaptive'): group sizes chosen per matrix by the error they cause beat uniform "
               "group sizes at no more bytes", fine_verdict, f"{verdict_parts(fine)}. Why: {fine_note}. Settings: {settings}.",
               fine),
              ("BitMoD (dtype='bitmod'): a per-group choice among FP types with special values beats a single type and "
               "the integer grid at the same group size", mod_verdict,
               f"{verdict_parts(mod)}. FP4's types are E2M1 with its second zero as +-5 (extra resolution) or +-8 (extra "
               f"asymmetry). The {mod_note}. Settings: {settings}.", mod)]
    for claim, verdict, summary, judgements in claims:
        record("quantize", claim, verdict, summary, rows, command, args.model, judgements=judgements)


if __name__ == "__main__":
    main()
