"""Merging against pruning on the zoo's own MoE, at 25% and 50% fewer experts, each paper's claim decided by the one
rule (``zoo.evaluation.claims.judge``) against the control arm that lacks only its mechanism:

* hc-smoe: merging (output-based hierarchical clusters, frequency-weighted averages) beats pruning: against frequency
  pruning at the same count (the paper's baseline); REAP pruning beside it;
* prune-reap: REAP's saliency (gate value x output norm) keeps better experts than routing frequency at the same
  count; pruning by it beats merging (hc-smoe, sub-moe) at the same count; calibrating on code alone keeps code
  perplexity better than mixed calibration (Half the Experts, All the Code; measure: code perplexity);
* sub-moe: its subspace merge (output-cosine clusters, shared U, frequency-merged V) beats plain averaging of the same
  clusters (the same pipeline with the subspace merge swapped for the frequency-weighted average) and hc-smoe. At the
  default full rank the subspace merge is that average (sub-moe takes it without the SVD), so that comparison is of
  one model; the truncated merge (rank_ratio 0.5, stored dense: no bytes saved) is shown beside it;
* prune-frequency: a baseline with no claim of its own (untestable here), its place among the others shown.

Every method here is deterministic given its calibration, so the repeats are draws: repeat i of every arm is
calibrated on calibration seed i (``calibration.corpus(seed=i)``) and evaluated on held-out evaluation draw i
(``claim_args.draw_geo``), paired across arms; the measure is the geometric mean over domains of the perplexity (code
perplexity for the code-calibration claim). Arms that are the same model (``same_weights``; for the subspace merge
and its average, the same clusters and weights equal to ``ROUNDING``) are inconclusive and say why.

    python benchmarks/merging.py                                # 3 draws x 16 windows, 4096 calibration tokens
    python benchmarks/merging.py --model zoo-tiny-upcycled      # the same on the upcycled model (its own entries)
    python benchmarks/merging.py --quick                        # 2 draws x 2 windows, 4/8 only; records nothing
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
from claim_args import (claim_parser, conclude, draw_args, draw_geo, judgement_line, load_model, show,  # noqa: E402
                        verdict_parts)
import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation import claims  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402


def arms(quick: bool) -> list[tuple[str, str, dict, str]]:
    """(label, component, options, calibration domain) of every arm at one expert count."""
    out = [("prune-frequency", "prune-frequency", {}, "mixed"),
           ("prune-reap", "prune-reap", {}, "mixed"),
           ("prune-reap code-cal", "prune-reap", {}, "code"),
           ("hc-smoe", "hc-smoe", {}, "mixed"),
           ("sub-moe", "sub-moe", {}, "mixed"),
           ("plain average", "sub-moe", {"_average": True}, "mixed")]  # sub-moe's clusters, averaged
    return out if quick else out + [("sub-moe rank 0.5", "sub-moe", {"rank_ratio": 0.5}, "mixed")]


@contextlib.contextmanager
def plain_average():
    """Sub-MoE's pipeline (its calibration, clusters and router) with its subspace merge swapped for the
    frequency-weighted average of each cluster's weights at every rank: the control that lacks only the shared
    subspace. The compressor is not changed: its ``merge_cluster`` is swapped here."""
    import zoo_compressors.sub_moe as sub

    merge = sub.merge_cluster

    def average(weights, freq, rank_ratio):
        f = freq.double() / freq.double().sum()
        return sum(w.double() * x for w, x in zip(weights, f)), weights[0].numel()

    sub.merge_cluster = average
    try:
        yield
    finally:
        sub.merge_cluster = merge


@torch.no_grad()
def rounding_apart(a, b) -> float | None:
    """The largest difference between two models' tensors relative to each tensor's largest magnitude, or None
    when they differ in names or shapes (not one model up to rounding)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or any(sa[k].shape != sb[k].shape for k in sa):
        return None
    worst = 0.0
    for k in sa:
        if sa[k].is_floating_point():
            scale = sa[k].abs().max().clamp(min=1e-30)
            worst = max(worst, float((sa[k].double() - sb[k].double()).abs().max() / scale))
        elif not torch.equal(sa[k], sb[k]):
            return None
    return worst


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


def expert_mb(model) -> float:
    return round(sum(m.experts.nbytes() for _, m in moe_layers(model)) / 1e6, 3)


RANKED = ("prune-frequency", "prune-reap", "hc-smoe", "sub-moe")  # prune-frequency's place among these
ROUNDING = 1e-5  # the subspace merge and its average are one model when every tensor agrees to this share of its scale


def main(argv=None):
    started = time.perf_counter()
    ap = claim_parser(__doc__.splitlines()[0], calibration_tokens=4096)
    ap.add_argument("--sizes", type=int, nargs="+", default=[6, 4], help="experts kept per layer (of 8)")
    args = draw_args(ap, draws=3).parse_args(argv)
    if args.quick:  # a smoke run of the whole path: 2 draws of 2 windows, 4/8 only, no truncated sub-moe
        args.windows, args.draws, args.sizes, args.no_record = 2, min(args.draws, 2), [min(args.sizes)], True
        args.calibration_tokens = min(args.calibration_tokens, 512)
    torch.set_num_threads(args.threads)
    base = load_model(args.model)
    tok = zoo.load_tokenizer(args.model)
    total = moe_layers(base)[0][1].num_experts
    labels = [a[0] for a in arms(args.quick)]
    geo = {(lab, n): [] for n in args.sizes for lab in labels}  # per draw
    ppl = {(lab, n): [] for n in args.sizes for lab in labels}  # per draw: {domain: perplexity}
    mb = {}
    same = {}  # (mechanism, control, n): [same model at draw i]
    apart = {}  # (n): [relative difference of sub-moe and its plain average at draw i]
    base_geo, base_ppl = [], []
    for i in range(args.draws):
        cals = {d: calibration.corpus(d, tokens=args.calibration_tokens, seed=i) for d in ("mixed", "code")}
        g, p = draw_geo(base, tok, i, args.windows)
        base_geo.append(g)
        base_ppl.append(p)
        for n in args.sizes:
            models = {}
            for label, name, options, cal in arms(args.quick):
                t = time.perf_counter()
                options = dict(options)
                with plain_average() if options.pop("_average", False) else contextlib.nullcontext():
                    model = zoo.apply(copy.deepcopy(base), name, calibration=cals[cal], num_experts=n, **options)
                g, p = draw_geo(model, tok, i, args.windows)
                geo[label, n].append(g)
                ppl[label, n].append(p)
                mb[label, n] = expert_mb(model)
                models[label] = model
                print(f"  draw {i} {label} {n}/{total}: geo {g:.3f} ({time.perf_counter() - t:.0f} s)", file=sys.stderr,
                      flush=True)
            for mech, ctrl in (("prune-reap", "prune-frequency"), ("prune-reap code-cal", "prune-reap")):
                same.setdefault((mech, ctrl, n), []).append(claims.same_weights(models[mech], models[ctrl]))
            clusters = [m.config.zoo_recipe[-1]["results"]["clusters"] for m in (models["sub-moe"],
                                                                                   models["plain average"])]
            off = rounding_apart(models["sub-moe"], models["plain average"]) if clusters[0] == clusters[1] else None
            apart.setdefault(n, []).append(off)
            del models
    cosine = expert_cosine(base)

    def pooled(per):  # the draws hold the same number of tokens: the pooled perplexity is the geometric mean
        return {d: math.exp(sum(math.log(p[d]) for p in per) / len(per)) for d in per[0]}

    def row(label, n, per_geo, per_ppl, size):
        return {"method": label, "experts": n, **{f"ppl {d}": round(v, 3) for d, v in pooled(per_ppl).items()},
                "ppl geo-mean": round(sum(per_geo) / len(per_geo), 3),
                "geo-mean by draw": "/".join(f"{g:.3f}" for g in per_geo), "expert MB": size}

    base_row = row("base", total, base_geo, base_ppl, expert_mb(base))
    rows = {(lab, n): row(lab, n, geo[lab, n], ppl[lab, n], mb[lab, n]) for n in args.sizes for lab in labels}
    settings = (f"{args.model}, {args.draws} calibration draws of {args.calibration_tokens} train tokens (mixed, or code "
                f"only for 'code-cal'; draw i on seed i) each evaluated on held-out evaluation draw i of {args.windows} "
                f"windows x 256 tokens per domain (paired); measure: geometric mean over domains of the perplexity; "
                f"torch threads {args.threads}")
    print(f"\n{settings}")
    print(f"mean |cosine| between two experts' weights in a layer: {cosine:.4f} (near 0: experts trained apart, the "
          "least favourable case for merging; near 1: copies of one FFN, as after upcycling)")
    show([base_row, *rows.values()])

    def compare(mech, ctrl, n, measure="geo"):
        m, c = ((geo[mech, n], geo[ctrl, n]) if measure == "geo" else
                ([p[measure] for p in ppl[mech, n]], [p[measure] for p in ppl[ctrl, n]]))
        key = (mech, ctrl, n)
        is_same = bool(same.get(key)) and all(same[key])
        why = ""
        if is_same:
            why = ("both kept the same experts in every layer" if mech != "prune-reap code-cal" else
                   "code and mixed calibration kept the same experts in every layer")
        if (mech, ctrl) == ("sub-moe", "plain average"):  # the truncated merge is judged on its numbers
            is_same = all(a is not None and a <= ROUNDING for a in apart[n])
            if is_same:
                why = (f"at full rank the shared basis is complete, so the subspace merge is the frequency-weighted "
                       f"average of the same clusters (every draw: the same clusters, weights within "
                       f"{max(apart[n]):.1e} of their scale; sub-moe takes that average without its SVD at full "
                       f"rank)")
        return claims.judge(m, c, paired=True, same_model=is_same, why_same=why)

    sizes = args.sizes
    parts = {
        "hc-smoe": {f"hc-smoe {n}/{total} vs prune-frequency {n}/{total}": compare("hc-smoe", "prune-frequency", n)
                    for n in sizes},
        "reap-saliency": {f"prune-reap {n}/{total} vs prune-frequency {n}/{total}":
                          compare("prune-reap", "prune-frequency", n) for n in sizes},
        "reap-merging": {f"prune-reap {n}/{total} vs {m} {n}/{total}": compare("prune-reap", m, n)
                         for n in sizes for m in ("hc-smoe", "sub-moe")},
        "reap-code": {f"code perplexity, prune-reap code-cal {n}/{total} vs prune-reap {n}/{total}":
                      compare("prune-reap code-cal", "prune-reap", n, "code") for n in sizes},
        "sub-moe": {**{f"sub-moe {n}/{total} vs plain average of its clusters {n}/{total}":
                       compare("sub-moe", "plain average", n) for n in sizes},
                    **{f"sub-moe {n}/{total} vs hc-smoe {n}/{total}": compare("sub-moe", "hc-smoe", n) for n in sizes}},
    }
    aside = " (beside the claim, not in its verdict)"
    beside = {
        "hc-smoe": {f"hc-smoe {n}/{total} vs prune-reap {n}/{total}{aside}": compare("hc-smoe", "prune-reap", n)
                    for n in sizes},
        "sub-moe": {} if args.quick else {
            f"sub-moe rank 0.5 (truncated, stored dense) {n}/{total} vs plain average {n}/{total}{aside}":
            compare("sub-moe rank 0.5", "plain average", n) for n in sizes},
    }
    texts = {
        "hc-smoe": ("hc-smoe", "merging experts (hierarchical clustering, frequency-weighted) beats pruning at equal "
                    "expert count"),
        "reap-saliency": ("prune-reap", "REAP's saliency (gate value x expert output norm) keeps better experts than "
                          "routing frequency at equal expert count"),
        "reap-merging": ("prune-reap", "pruning (REAP saliency) beats merging on generative quality at equal expert "
                         "count"),
        "reap-code": ("prune-reap", "Half the Experts, All the Code: pruning calibrated on one domain (code) keeps that "
                      "domain's quality better than general (mixed) calibration"),
        "sub-moe": ("sub-moe", "subspace expert merging (output-cosine clusters, shared U, frequency-merged V) beats "
                    "plain averaging of the same clusters and other merges (HC-SMoE) at equal expert count"),
    }
    verdicts = {}
    for key, (component, text) in texts.items():
        print()
        verdicts[key] = conclude(f"{component}: {text}", parts[key])
        if beside.get(key):
            print("  beside the claim, not in its verdict:")
            for name, j in beside[key].items():
                print("    " + judgement_line(name, j))
    place = {n: sorted(RANKED, key=lambda lab: sum(geo[lab, n])).index("prune-frequency") + 1 for n in sizes}
    print(f"\nprune-frequency's place among {', '.join(RANKED)} (1 = lowest geo-mean perplexity): {place}")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return rows

    command = "python benchmarks/merging.py"
    command += f" --model {args.model}" if args.model != "zoo-tiny-moe" else ""
    command += f" --draws {args.draws}" if args.draws != 3 else ""
    command += f" --windows {args.windows}" if args.windows != 16 else ""
    command += f" --calibration-tokens {args.calibration_tokens}" if args.calibration_tokens != 4096 else ""
    command += f" --sizes {' '.join(map(str, sizes))}" if sizes != [6, 4] else ""
    model_note = (f"{args.model} was trained from scratch and its experts are nearly orthogonal (mean |cosine| of two "
                  f"experts' weights {cosine:.3f}), the least favourable case for merging" if cosine < 0.2 else
                  f"mean |cosine| of two experts' weights in a layer {cosine:.3f}")
    tail = f" {model_note}. Settings: {settings}."

    def pick(*labs):
        return [base_row, *(rows[lab, n] for n in sizes for lab in labs)]

    def claim_on(key, summary, numbers, judgements=None, verdict=None):  # a second model's run keeps the first's
        component, text = texts.get(key, key)
        text = text if args.model == "zoo-tiny-moe" else f"{text} (on {args.model})"
        claims.record(component, text, verdict or verdicts[key], summary, numbers, command, args.model,
                      judgements=judgements)

    claim_on("hc-smoe", f"{verdict_parts(parts['hc-smoe'])}. Against frequency pruning (the paper's baseline) at the "
             f"same count, router keeping all its rows (the paper's expert map). Beside the claim: "
             f"{verdict_parts(beside['hc-smoe'])}. The paper merges 8B-47B models (Qwen, Mixtral) on zero-shot tasks."
             + tail, pick("prune-frequency", "prune-reap", "hc-smoe"), {**parts["hc-smoe"], **beside["hc-smoe"]})
    claim_on("reap-saliency", f"{verdict_parts(parts['reap-saliency'])}. Both prune on the same calibration draw "
             f"and differ only in the score that ranks the experts." + tail,
             pick("prune-frequency", "prune-reap"), parts["reap-saliency"])
    claim_on("reap-merging", f"{verdict_parts(parts['reap-merging'])}. Perplexity being generative quality; the "
             f"merges keep all router rows (expert map)." + tail,
             pick("prune-reap", "prune-frequency", "hc-smoe", "sub-moe"), parts["reap-merging"])
    cost = {n: round(math.exp(sum(math.log(a["english"] / b["english"]) for a, b in
                                  zip(ppl["prune-reap code-cal", n], ppl["prune-reap", n])) / args.draws), 3)
            for n in sizes}
    claim_on("reap-code", f"{verdict_parts(parts['reap-code'])} (measure: code perplexity per draw). English "
             f"perplexity code-cal / mixed, by expert count: {cost}." + tail,
             pick("prune-reap", "prune-reap code-cal"), parts["reap-code"])
    trunc = "" if not beside["sub-moe"] else (
        f" Beside the claim, the truncated merge (rank_ratio 0.5, the paper's intra-expert compression, stored dense "
        f"here so it saves no bytes: expert MB {', '.join(str(mb['sub-moe rank 0.5', n]) for n in sizes)} vs "
        f"{', '.join(str(mb['plain average', n]) for n in sizes)}): {verdict_parts(beside['sub-moe'])}.")
    claim_on("sub-moe", f"{verdict_parts(parts['sub-moe'])}. sub-moe at its default full rank against the same "
             f"pipeline with each cluster's frequency-weighted average in place of the subspace merge, and against "
             f"hc-smoe (the other merge: hierarchical clusters of mean outputs, the same averaging and router)." + trunc
             + " The paper merges Mixtral/DeepSeek/Qwen models and truncates ranks to save parameters." + tail,
             pick("sub-moe", "plain average", *([] if args.quick else ["sub-moe rank 0.5"]), "hc-smoe"),
             {**parts["sub-moe"], **beside["sub-moe"]})
    claim_on(("prune-frequency", "none of its own: the frequency-pruning baseline of HC-SMoE and NAEE"),
             f"No paper claims anything for frequency pruning itself; it is the baseline the merging papers beat (and "
             f"the control of hc-smoe's and prune-reap's saliency claims here). Its place among {', '.join(RANKED)} "
             f"by geo-mean perplexity (1 = best), by expert count: {place}." + tail,
             pick(*RANKED), verdict="untestable here")
    return rows


if __name__ == "__main__":
    main()
