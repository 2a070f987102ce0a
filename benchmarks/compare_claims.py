"""MoEXBench's findings on the zoo's shipped models: stacked compression (expert pruning x weight quantization x
key/value cache precision) cannot be predicted from each technique alone, and expert pruning is the dominant source
of degradation.

Cells per model: the base; half the experts pruned by REAP (``prune-reap``, ``num_experts`` = half); int4 experts
(``quantize``, bits=4); an int4 key/value cache (``zoo.runtime.kv_cache``); and every composition of the three.
Repeat i calibrates REAP on calibration draw i and evaluates every cell on held-out draw i (the same windows for all
cells: paired), each window fed 32 tokens at a time through the cache (``kv_perplexity``); the measure is the
geometric mean over domains of perplexity.

- Predictability: a composition's log perplexity against the sum of its parts' changes (log base + the parts'
  log-ratios to the base), judged by ``zoo.evaluation.claims.judge_differs`` (holds when they are apart by more
  than the noise).
- Dominance: the pruned cell's perplexity against the int4-weights cell's and the int4-cache cell's (holds when
  pruning is worse by more than the noise).

    python benchmarks/compare_claims.py           # both shipped models, 4 draws x 8 windows
    python benchmarks/compare_claims.py --quick   # zoo-tiny-moe, 2 draws x 1 window; records nothing
"""
from __future__ import annotations

import copy
import itertools
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zoo  # noqa: E402
from claim_args import claim_parser, conclude, draw_args, draw_windows, load_model, show, verdict_parts  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.evaluation.claims import judge, judge_differs, record  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402
from zoo.runtime.kv_cache import kv_perplexity  # noqa: E402

PARTS = ("prune", "int4 weights", "int4 cache")
CLAIMS = {
    "predictable": "MoEXBench: stacked compression (expert pruning x weight quantization x KV-cache precision) cannot "
                   "be predicted from each technique alone",
    "dominant": "MoEXBench: expert pruning is the dominant source of degradation",
}


def cell_model(base, parts, half, cal):
    model = copy.deepcopy(base)
    if "prune" in parts:
        model = zoo.apply(model, "prune-reap", calibration=cal, num_experts=half)
    if "int4 weights" in parts:
        model = zoo.apply(model, "quantize", bits=4)
    return model


def geo_on_draw(model, tok, draw, windows, precision, seq_len=256) -> float:
    ppl = [kv_perplexity(model, ids, precision)[0] for ids in draw_windows(tok, draw, windows, seq_len).values()]
    return math.exp(sum(math.log(p) for p in ppl) / len(ppl))


def main(argv=None):
    started = time.perf_counter()
    ap = draw_args(claim_parser(__doc__.splitlines()[0], calibration_tokens=4096), draws=4, windows=8)
    ap.add_argument("--models", nargs="+", default=["zoo-tiny-moe", "zoo-tiny-upcycled"])
    args = ap.parse_args(argv)
    args.seq_len = 256
    if args.quick:  # the whole path on short windows: 2 draws of 1 window of 64 tokens
        args.windows, args.draws, args.no_record, args.seq_len = 1, 2, True, 64
        args.calibration_tokens, args.models = 256, ["zoo-tiny-moe"]
    torch.set_num_threads(args.threads)
    cells = [c for n in range(len(PARTS) + 1) for c in itertools.combinations(PARTS, n)]
    rows, predictable, dominant = [], {}, {}
    for name in args.models:
        base, tok = load_model(name), zoo.load_tokenizer(name)
        half = max(moe.num_experts for _, moe in moe_layers(base)) // 2
        geos = {c: [] for c in cells}
        for i in range(args.draws):
            cal = calibration.corpus("mixed", tokens=args.calibration_tokens, seq_len=args.seq_len, seed=i)
            for weights in {tuple(p for p in c if p != "int4 cache") for c in cells}:
                model = cell_model(base, weights, half, cal)
                for c in (weights, (*weights, "int4 cache")):
                    geos[c].append(geo_on_draw(model, tok, i, args.windows, "int4" if "int4 cache" in c else "full",
                                                  args.seq_len))
        for c in cells:
            rows.append({"model": name, "cell": " + ".join(c) or "base",
                         "ppl geo-mean": round(sum(geos[c]) / len(geos[c]), 3),
                         "by draw": "/".join(f"{g:.3f}" for g in geos[c])})
            print(rows[-1], flush=True)
        log = {c: [math.log(g) for g in geos[c]] for c in cells}
        for c in cells:
            if len(c) < 2:
                continue
            predicted = [log[()][i] + sum(log[(p,)][i] - log[()][i] for p in c) for i in range(args.draws)]
            predictable[f"{name} {' + '.join(c)}: log ppl vs its parts' sum"] = judge_differs(log[c], predicted)
        for other in PARTS[1:]:
            j = judge(geos[("prune",)], geos[(other,)], lower_is_better=False, paired=True)
            j["reason"] = j["reason"].replace("better by", "the pruned perplexity higher by").replace(
                "worse by", "the pruned perplexity lower by")
            dominant[f"{name} prune vs {other}"] = j
    show(rows)
    print()
    verdicts = {"predictable": conclude("composition is not what its parts predict", predictable),
                "dominant": conclude("pruning degrades the most", dominant)}
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    settings = (f"Settings: {', '.join(args.models)}; prune = prune-reap to half the experts (repeat i calibrated on "
                f"{args.calibration_tokens} mixed train tokens of seed i), int4 weights = quantize bits=4 on the "
                f"experts, int4 cache = the zoo's int4 key/value codes; {args.draws} held-out draws of {args.windows} "
                f"windows x 256 tokens per domain, each fed 32 tokens at a time through the cache, the same for every "
                f"cell (paired); measure: geometric mean of the per-domain perplexity; one thread. MoEXBench measured "
                f"Mixtral/Qwen/DeepSeek-class models on downstream tasks.")
    command = "python benchmarks/compare_claims.py" + (f" --draws {args.draws}" if args.draws != 4 else "")
    for key, parts in (("predictable", predictable), ("dominant", dominant)):
        record("compare", CLAIMS[key], verdicts[key], f"{verdict_parts(parts)}. {settings}", rows, command,
               " and ".join(args.models), judgements=parts)


if __name__ == "__main__":
    main()
