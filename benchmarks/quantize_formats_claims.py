"""The quantize formats' claims on zoo-tiny-moe, in one run, recorded in docs/claims/quantize.json:

* FineQuant (group_size="adaptive"): per-matrix group sizes chosen by the error they cause beat uniform group sizes
  at no more bytes;
* BitMoD (dtype="bitmod"): each group's choice among FP types with special values beats one type for all groups
  (plain FP, dtype="fp") and the integer grid (dtype="int") at the same group size and about the same bytes.

Bytes are the experts' stored bytes (codes, bf16 scales and zeros, BitMoD's 2-bit type id per group), as
``nbytes()`` counts them; perplexity is ``zoo.eval``'s held-out perplexity per domain, on one thread; the weight
error (sum ||W - Q(W)||^2 / sum ||W||^2 over all experts) is the quantity both methods minimise, shown beside it.

    python benchmarks/quantize_formats_claims.py                 # 8 windows x 256 tokens per domain
    python benchmarks/quantize_formats_claims.py --no-record     # print only
"""
from __future__ import annotations

import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import claim_parser, geo, show  # noqa: E402
import zoo  # noqa: E402
from zoo.eval import perplexity_and_usage  # noqa: E402
from zoo.layout import moe_layers  # noqa: E402

ALPHAS = (0.3, 0.6, 1.0)  # FineQuant bounds: how much more error than group 32 a coarser group may cost
GROUP = 64  # BitMoD's comparisons: one group size for every data type


def runs():
    out = []
    for bits in (4, 3):
        out += [(f"{bits}b int g{g}", {"bits": bits, "group_size": g}) for g in (256, 128, 64, 32)]
        out += [(f"{bits}b adaptive a={a}", {"bits": bits, "group_size": "adaptive", "group_alpha": a}) for a in ALPHAS]
        out += [(f"{bits}b {d} g{GROUP}", {"bits": bits, "dtype": d, "group_size": GROUP}) for d in ("fp", "bitmod")]
    return out


def main(argv=None):
    args = claim_parser(__doc__.splitlines()[0], calibration_tokens=0).parse_args(argv)
    torch.set_num_threads(args.threads)
    base = zoo.load(args.model).eval()
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

    def row(label, model, extra=None):
        with torch.no_grad():
            ppl, _ = perplexity_and_usage(model, tok, max_windows=args.windows)
            werr = weight_error(model)
        nbytes = sum(m.experts.nbytes() for _, m in moe_layers(model))
        r = {"method": label, "bits per weight": round(8 * nbytes / weights, 4), "expert MB": round(nbytes / 1e6, 4),
             "weight error": round(werr, 5), **{f"ppl {d}": round(v, 3) for d, v in ppl.items()},
             "ppl geo-mean": round(geo(ppl), 3), **(extra or {})}
        print(r, flush=True)
        return r, ppl

    rows, ppl = [], {}
    r, _ = row("base (fp32)", base)
    rows.append(r)
    for label, options in runs():
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
        r, ppl[label] = row(label, model, extra)
        rows.append(r)
    print(f"\nmodel {args.model}, {args.windows} windows x 256 tokens per domain (held-out split), experts only, "
          f"torch threads {args.threads}")
    show(rows)

    domains = list(ppl[rows[1]["method"]])
    bpw = {r["method"]: r["bits per weight"] for r in rows}

    def beats(a, b):  # per domain: "yes" (a's perplexity lower), "no", or "tie" (the same numbers: the same codes)
        return ["tie" if ppl[a][d] == ppl[b][d] else "yes" if ppl[a][d] < ppl[b][d] else "no" for d in domains]

    fine = {}
    for bits in (4, 3):
        for a in ALPHAS:
            label = f"{bits}b adaptive a={a}"
            # against the uniform group with the fewest bytes that still has at least as many as the adaptive row
            peers = [f"{bits}b int g{g}" for g in (256, 128, 64, 32) if bpw[f"{bits}b int g{g}"] >= bpw[label] - 1e-9]
            fine[f"{label} ({bpw[label]} b/w) < {peers[0]} ({bpw[peers[0]]} b/w)"] = beats(label, peers[0])
    mod, werr = {}, {r["method"]: r["weight error"] for r in rows}
    mod_error = []
    for bits in (4, 3):
        for other in ("fp", "int"):
            a, b = f"{bits}b bitmod g{GROUP}", f"{bits}b {other} g{GROUP}"
            mod[f"{a} ({bpw[a]} b/w) < {b} ({bpw[b]} b/w)"] = beats(a, b)
            mod_error.append(f"{a} {werr[a]} vs {b} {werr[b]}")
    groups = {r["method"]: r.get("groups (gate_up+down stacks)") for r in rows if "adaptive" in r["method"]}

    def verdict(cmp):
        wins = [w == "yes" for v in cmp.values() for w in v]
        return "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"

    def describe(cmp):
        return "; ".join(f"{k}: " + ", ".join(f"{d} {w}" for d, w in zip(domains, v)) for k, v in cmp.items())
    settings = (f"{args.model}, held-out split, {args.windows} windows x 256 tokens per domain, experts only, "
                f"one thread; bytes per weight count codes, bf16 scales/zeros and BitMoD's 2-bit type ids")
    chosen = ", ".join(f"{k}: {v}" for k, v in groups.items())
    if all(" " not in v for v in groups.values()):  # one size per run: the adaptive run is a uniform run
        fine_note = (f"the rule gave every projection stack of a run the same group size ({chosen}): the experts' "
                     "error curves over group sizes are alike (near-Gaussian weights without outlier columns), so "
                     "there is nothing for a per-matrix choice to adapt to")
    else:
        fine_note = f"group sizes chosen per projection stack: {chosen}"
    mod_note = "weight error (what the per-group choice minimises): " + "; ".join(mod_error)
    print("\nFineQuant:", verdict(fine), "-", describe(fine), "-", fine_note)
    print("BitMoD:", verdict(mod), "-", describe(mod), "-", mod_note)
    if args.no_record:
        return
    from zoo.claims import record

    command = "python benchmarks/quantize_formats_claims.py"
    command += f" --windows {args.windows}" if args.windows != 8 else ""
    record("quantize", "FineQuant (group_size='adaptive'): group sizes chosen per matrix by the error they cause beat "
           "uniform group sizes at no more bytes", verdict(fine),
           f"{describe(fine)}. Why: {fine_note}. Settings: {settings}.", rows, command, args.model)
    record("quantize", "BitMoD (dtype='bitmod'): a per-group choice among FP types with special values beats a single "
           "type and the integer grid at the same group size", verdict(mod),
           f"{describe(mod)}. The {mod_note}. Settings: {settings}.",
           rows, command, args.model)


if __name__ == "__main__":
    main()
