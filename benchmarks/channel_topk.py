"""channel-topk's claims on zoo-tiny-moe, in one run: held-out perplexity and the expert bytes each token reads
(weights gathered, plus the selector's own sketch, norms, thresholds), counted by the experts while they run, for
the sketch and WINA selectors at budgets 0.25 and 0.5 with the paper's top-k rule and with the
calibrated-threshold baseline (thresholds set per expert and matrix on the shipped corpus' train split, so that
its tokens keep the budget on average; the fraction measured on held-out text is reported beside it).

Claims recorded (docs/claims/channel-topk.json), each part decided by the one rule (``zoo.evaluation.claims.judge``):
- top-k (no calibration data) against the calibrated threshold, the same selector at the same budget (the control
  lacks only the top-k rule);
- the paper's weight-only reader (ternary sketch + low-rank recovery) against WINA, both top-k at the same budget.

Both claims are of parity ("matches", "as well as"): under the rule a difference within the noise is inconclusive,
and only a win beyond it holds. Top-k is deterministic, so the repeats are disjoint evaluation draws shared by every
arm (paired); the threshold of repeat i is calibrated on calibration seed i, so its calibration noise is in the
repeats too. The measure of a draw is the geometric mean over domains of its perplexity.

    python benchmarks/channel_topk.py                  # 3 draws x 8 windows x 256 tokens, 8192 calibration tokens
    python benchmarks/channel_topk.py --no-record      # print only
    python benchmarks/channel_topk.py --quick          # 2 draws x 2 windows, budget 0.5; records nothing
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import claim_parser, conclude, draw_args, draw_geo, load_model, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation import claims  # noqa: E402
from zoo.moe.channel_topk import ReadCounter  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402

BUDGETS = (0.25, 0.5)
CONFIGS = [  # (label, options besides budget)
    ("sketch top-k (paper)", {"selector": "sketch"}),
    ("sketch threshold", {"selector": "sketch", "rule": "threshold"}),
    ("wina top-k", {"selector": "wina"}),
    ("wina threshold", {"selector": "wina", "rule": "threshold"}),
]
CLAIM_1 = ("Top-k channel selection needs no calibration data: at equal average budget it matches a calibrated "
           "threshold")
CLAIM_2 = ("A weight-only reader (ternary sketch of the weights, low-rank recovery of skipped channels) selects "
           "channels before reading them as well as WINA's activation-informed scores, at the same budget")


def counting(model) -> list:
    """Fresh read counters on every channel-topk expert module of ``model`` (none for dense experts)."""
    out = []
    for _, moe in moe_layers(model):
        if hasattr(moe.experts, "counter"):
            moe.experts.counter = ReadCounter()
            out.append(moe.experts)
    return out


def reads(experts) -> dict:
    """What a (token, expert) pair read over the counted passes, as a share of one expert's weight bytes."""
    pairs = sum(ex.counter.pairs for ex in experts)
    weights = sum(ex.counter.weights for ex in experts)
    selector = sum(ex.counter.selector for ex in experts)
    expert_bytes = experts[0].expert_weight_bytes()
    for ex in experts:
        ex.counter = None
    return {"weights read / expert": round(weights / pairs / expert_bytes, 4),
            "total read / expert": round((weights + selector) / pairs / expert_bytes, 4)}


def main(argv=None):
    started = time.perf_counter()
    args = draw_args(claim_parser(__doc__.splitlines()[0], calibration_tokens=8192), draws=3, windows=8)\
        .parse_args(argv)
    budgets, configs, selectors = BUDGETS, CONFIGS, ("sketch", "wina")
    if args.quick:  # the whole path at one budget, no wina threshold: 2 draws of 2 windows, 512 calibration tokens
        args.windows, args.draws, args.no_record = 2, min(args.draws, 2), True
        args.calibration_tokens, budgets = min(args.calibration_tokens, 512), (0.5,)
        configs, selectors = CONFIGS[:3], ("sketch",)
    domain = "code" if args.quick else "mixed"  # quick: one domain's train split to tokenize, not two
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = load_model(args.model)
    tok = zoo.load_tokenizer(args.model)
    dtype = next(base.parameters()).dtype
    geos, ppls, counted = {}, {}, {}

    def evaluate(key, model, i):
        experts = counting(model)
        g, p = draw_geo(model, tok, i, args.windows)
        geos.setdefault(key, []).append(g)
        ppls.setdefault(key, []).append(p)
        if experts:  # summed over the draws: every draw holds as many tokens
            got = reads(experts)
            counted.setdefault(key, []).append(got)

    def build(options, budget, cal):
        return zoo.apply(load_model(args.model), "channel-topk", budget=budget, calibration=cal, **options)

    for i in range(0 if args.quick else args.draws):
        evaluate(("dense experts", 1.0), base, i)
    for budget in budgets:
        for label, options in configs:
            if options.get("rule") != "threshold":  # top-k: no calibration, one model for every draw
                model = build(options, budget, None)
            for i in range(args.draws):
                if options.get("rule") == "threshold":  # repeat i: calibration seed i, evaluation draw i
                    cal = calibration.corpus(domain, tokens=args.calibration_tokens, seed=i)
                    model = build(options, budget, cal)
                evaluate((label, budget), model, i)
            print(f"{label} b={budget}: geo-mean by draw {'/'.join(f'{g:.3f}' for g in geos[label, budget])} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            del model

    rows = []
    for (label, budget), per in geos.items():
        pooled = {d: math.exp(sum(math.log(p[d]) for p in ppls[label, budget]) / len(per))
                  for d in ppls[label, budget][0]}
        read = counted.get((label, budget))
        read = ({k: round(sum(r[k] for r in read) / len(read), 4) for k in read[0]} if read
                else {"weights read / expert": 1.0, "total read / expert": 1.0})
        rows.append({"config": label, "budget": budget, **{f"ppl {d}": round(v, 3) for d, v in pooled.items()},
                     "ppl geo-mean": round(sum(per) / len(per), 3),
                     "geo-mean by draw": "/".join(f"{g:.3f}" for g in per), **read})
    settings = (f"{args.model} ({dtype} as shipped), held-out split, {args.draws} disjoint evaluation draws of "
                f"{args.windows} windows x 256 tokens per domain (paired); thresholds of repeat i calibrated per "
                f"expert and matrix on {args.calibration_tokens} {domain} train tokens of seed i; measure: geometric "
                f"mean of the per-domain perplexity; bytes counted by the experts while they ran (mean over the "
                f"draws); one thread")
    print(f"\n{settings}")
    show(rows)

    def compare(a, b):
        return claims.judge(geos[a], geos[b], paired=True)

    top_vs_threshold = {f"{sel} top-k vs {sel} threshold, b={b}": compare(
        ("sketch top-k (paper)" if sel == "sketch" else "wina top-k", b), (f"{sel} threshold", b))
        for sel in selectors for b in budgets}
    sketch_vs_wina = {f"sketch top-k vs wina top-k, b={b}": compare(("sketch top-k (paper)", b), ("wina top-k", b))
                      for b in budgets}
    v1 = conclude(CLAIM_1, top_vs_threshold, "paired draws")
    v2 = conclude(CLAIM_2, sketch_vs_wina, "paired draws")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    by = {(r["config"], r["budget"]): r for r in rows}
    command = "python benchmarks/channel_topk.py"
    command += f" --draws {args.draws}" if args.draws != 3 else ""
    command += f" --windows {args.windows}" if args.windows != 8 else ""
    command += f" --calibration-tokens {args.calibration_tokens}" if args.calibration_tokens != 8192 else ""
    parity = ("The claim is one of parity; under the rule a difference within the noise is inconclusive and only a "
              "win beyond it holds. ")
    reads1 = "; ".join(f"{sel} threshold b={b} read {by[f'{sel} threshold', b]['weights read / expert']} of the "
                       f"weights on held-out text" for sel in ("sketch", "wina") for b in budgets)
    reads2 = "; ".join(f"b={b}: sketch read {by['sketch top-k (paper)', b]['total read / expert']} of the expert "
                       f"bytes (sketch included), wina {by['wina top-k', b]['total read / expert']}" for b in budgets)
    claims.record("channel-topk", CLAIM_1, v1, f"{verdict_parts(top_vs_threshold)}. {parity}({reads1}.) Settings: "
                  f"{settings}.", rows, command, args.model, judgements=top_vs_threshold)
    claims.record("channel-topk", CLAIM_2, v2, f"{verdict_parts(sketch_vs_wina)}. {parity}At the same budget the "
                  f"sketch reads more bytes than WINA ({reads2}). Settings: {settings}.", rows, command, args.model,
                  judgements=sketch_vs_wina)


if __name__ == "__main__":
    main()
