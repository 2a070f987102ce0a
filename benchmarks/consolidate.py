"""Claim benchmark: ``zoo.consolidate`` (Imani et al., ICML 2025, arXiv:2505.06481) on fine-tunes of zoo-tiny-moe.

The paper serves several fine-tuned copies of one MoE by sharing the experts that stayed similar (one copy serves
them all) and keeping the dissimilar experts and the non-expert layers per model; it reports output quality
competitive with serving each model alone, at a much smaller memory footprint. Here:

1. fine-tunes: zoo-tiny-moe with ``zoo.training.finetune.finetune`` (lora-experts on every expert, merged), one on each
   domain of the zoo's corpus (``english``, ``code``) and a second ``code`` run with another seed;
2. thresholds: chosen from the measured similarities (cosine of each expert's flattened weights to the base's
   same expert, or between the fine-tunes' same expert), so that about 25/50/75/100% of them are at or above;
3. per threshold, on fresh copies: ``zoo.consolidate`` with the base (experts near the base share its copy), the
   bytes of all models together before and after (each storage once), and each model's held-out perplexity on
   its own domain;
4. the control, which lacks only the mechanism (choosing the shared experts by similarity): as many (model, expert)
   pairs chosen at random, replaced by the base's copy.

The one rule (``zoo.evaluation.claims.judge``) decides each threshold's comparison. The measure is the geometric
mean over the three models of each one's perplexity on its own domain. Fine-tuning the three models again per
seed is beyond this benchmark's budget, so the fine-tunes are made once and the repeats are draws: repeat i of
both arms is evaluated on disjoint held-out evaluation draw i (``--windows`` windows of ``--seq-len`` tokens), and
the random control of repeat i is drawn with seed i (paired). The fine-tunes' own seed-to-seed noise is not in the
repeats, and the entry says so.

    python benchmarks/consolidate.py                  # 3 fine-tunes x 80 steps, 3 draws x 8 windows
    python benchmarks/consolidate.py --quick          # 2 code fine-tunes x 2 steps, 2 draws x 2 windows, ~50%
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, draw_windows, verdict_parts  # noqa: E402

QUANTILES = (0.25, 0.5, 0.75)
RUNS = (("english", 0), ("code", 0), ("code", 1))  # (domain, seed) per fine-tune


def finetunes(base, steps: int, seq_len: int, lr: float, runs=RUNS):
    from zoo.training.finetune import finetune

    models = []
    for domain, seed in runs:
        t = time.perf_counter()
        result = finetune(copy.deepcopy(base), "lora-experts", {"r": 8}, domain=domain, steps=steps, lr=lr,
                          batch_size=8, seq_len=seq_len, windows=1, seed=seed, merge=True, progress=False)
        print(f"fine-tuned on {domain} (seed {seed}): {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
        models.append(result.model.eval())
    return models


CLAIM = ("Similar experts shared across fine-tunes keep output quality competitive while the memory of serving several "
         "fine-tuned MoEs shrinks")


def similarities(models, base) -> list[float]:
    """Per (model, layer, expert): the model's expert's similarity to the base's copy, highest first."""
    from zoo.editing.consolidation import cosine, expert_vectors
    from zoo.moe.layout import moe_layers

    sims = []
    for j in range(len(moe_layers(models[0]))):
        vs = [expert_vectors(moe_layers(m)[j][1].experts) for m in models]
        bv = expert_vectors(moe_layers(base)[j][1].experts)
        sims += [cosine(v[e], bv[e]) for v in vs for e in range(len(bv))]
    return sorted(sims, reverse=True)


def random_control(models, base, count: int, seed: int = 0) -> list:
    """Copies of the models with ``count`` random (model, layer, expert) pairs replaced by the base's expert."""
    from zoo.moe.layout import moe_layers

    copies = [copy.deepcopy(m) for m in models]
    pairs = [(i, j, e) for i, m in enumerate(copies) for j, (_, moe) in enumerate(moe_layers(m))
             for e in range(moe.experts.num_experts)]
    with torch.no_grad():
        for i, j, e in random.Random(seed).sample(pairs, count):
            own, ref = moe_layers(copies[i])[j][1].experts, moe_layers(base)[j][1].experts
            for name, t in own.state_dict().items():
                t[e] = ref.state_dict()[name][e]
    return copies


def own_domain(models, domains, tokenizer, draw: int, windows: int, seq_len: int) -> list[float]:
    """Each model's perplexity on its own domain's evaluation draw ``draw`` (held-out windows, disjoint per draw)."""
    ppl = []
    with torch.no_grad():
        for model, domain in zip(models, domains):
            ids_all, total, count = draw_windows(tokenizer, draw, windows, seq_len)[domain], 0.0, 0.0
            model.eval()
            for i in range(0, len(ids_all), 8):
                ids = ids_all[i:i + 8]
                n = ids.numel() - ids.shape[0]
                total, count = total + model(input_ids=ids, labels=ids).loss.float().item() * n, count + n
            ppl.append(math.exp(total / count))
    return ppl


def geo(values) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def main(argv=None) -> int:
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per draw and domain")
    ap.add_argument("--draws", type=int, default=3, help="disjoint evaluation draws (the repeats)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="2 code fine-tunes x 2 steps, 2 draws x 2 windows, ~50%% only; records nothing")
    args = ap.parse_args(argv)
    quantiles, runs = QUANTILES, RUNS
    if args.quick:  # the two code fine-tunes only (one train split to tokenize), ~50% sharing
        args.steps, args.windows, args.draws, args.no_record, quantiles = 2, 2, min(args.draws, 2), True, (0.5,)
        runs = RUNS[1:]
    torch.set_num_threads(args.threads)

    import zoo
    from zoo.io.loading import tokenizer_for

    base = zoo.load(args.model, dtype=torch.float32).eval()
    tokenizer = tokenizer_for(base, required=True)
    models = finetunes(base, args.steps, args.seq_len, args.lr, runs)
    domains = [d for d, _ in runs]

    def measure(ms):  # [per draw: [per model: own-domain perplexity]]
        return [own_domain(ms, domains, tokenizer, i, args.windows, args.seq_len) for i in range(args.draws)]

    own, base_ppl = measure(models), measure([base] * len(models))
    sims = similarities(models, base)
    print(f"similarity to the base over {len(sims)} (model, layer, expert) pairs: min {sims[-1]:.6f}, median "
          f"{sims[len(sims) // 2]:.6f}, max {sims[0]:.6f}")
    rows, arms = [], {}
    for q in quantiles:
        threshold = sims[max(0, round(q * len(sims)) - 1)]
        copies = [copy.deepcopy(m) for m in models]
        result = zoo.consolidate(copies, threshold=threshold, base=base, progress=False)
        similar, count = measure(copies), result.shared_experts
        # the control of repeat i: as many pairs at random (seed i), evaluated on draw i
        chance = [own_domain(random_control(models, base, count, seed=i), domains, tokenizer, i, args.windows,
                             args.seq_len) for i in range(args.draws)]
        arms[q] = (similar, chance)
        row = {"sharing": f"~{int(q * 100)}% of similarities", "threshold": round(threshold, 6),
               "shared_pairs": count, "MiB_before": round(result.bytes_before / 2**20, 2),
               "MiB_after": round(result.bytes_after / 2**20, 2),
               "saved_pct": round(100 * result.bytes_saved / result.bytes_before, 1)}
        for k, d in enumerate(domains):
            row[f"ppl{k}_{d}"] = round(geo([p[k] for p in similar]), 3)
            row[f"random{k}"] = round(geo([p[k] for p in chance]), 3)
        row["geo similar by draw"] = "/".join(f"{geo(p):.3f}" for p in similar)
        row["geo random by draw"] = "/".join(f"{geo(p):.3f}" for p in chance)
        rows.append(row)
        print(" | ".join(f"{k}={v}" for k, v in row.items()), f"({time.perf_counter() - started:.0f} s)", flush=True)
        del copies, result
    alone = {"sharing": "none (each fine-tune alone)",
             **{f"ppl{k}_{d}": round(geo([p[k] for p in own]), 3) for k, d in enumerate(domains)}}
    only_base = {"sharing": "the base model alone",
                 **{f"ppl{k}_{d}": round(geo([p[k] for p in base_ppl]), 3) for k, d in enumerate(domains)}}
    rows += [alone, only_base]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(f"\n{args.model}, {len(runs)} lora-experts fine-tunes x {args.steps} steps; {args.draws} disjoint held-out "
          f"draws of {args.windows} windows x {args.seq_len} tokens of each model's own domain")
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    from zoo.evaluation.claims import judge

    judgements = {f"~{int(q * 100)}% shared by similarity vs as many at random": judge(
        [geo(p) for p in similar], [geo(p) for p in chance], paired=True) for q, (similar, chance) in arms.items()}
    half = arms.get(0.5, next(iter(arms.values())))
    beside = {f"~50% shared, the {d} fine-tune (seed {s}) (beside the claim, not in its verdict)": judge(
        [p[k] for p in half[0]], [p[k] for p in half[1]], paired=True) for k, (d, s) in enumerate(runs)}
    verdict = conclude(CLAIM, judgements, "paired draws")
    for name, j in beside.items():
        print(f"  (beside) {name}: {j['verdict']}, margin {j['margin']:.4g} vs noise {j['noise']:.4g}")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if not args.no_record:
        record(rows, own, base_ppl, domains, args, verdict, judgements, beside)
    return 0


def record(rows, own, base_ppl, domains, args, verdict, judgements, beside) -> None:
    from zoo.evaluation.claims import record as write

    half = next(r for r in rows if r["sharing"] == "~50% of similarities")
    alone = [geo([p[k] for p in own]) for k in range(len(domains))]
    gain = [100 * (1 - alone[k] / geo([p[k] for p in base_ppl])) for k in range(len(domains))]
    change = [100 * (half[f"ppl{k}_{d}"] / alone[k] - 1) for k, d in enumerate(domains)]
    summary = (f"{verdict_parts(judgements)}. Three lora-experts fine-tunes of {args.model} ({args.steps} steps; "
               f"own-domain perplexity {', '.join(f'{g:.1f}%' for g in gain)} below the base). Sharing ~50% of the "
               f"(model, expert) pairs with the base's copy saves {half['saved_pct']}% of the bytes of all three "
               f"models and changes own-domain perplexity by {', '.join(f'{c:+.2f}%' for c in change)}; the control "
               f"shares as many pairs chosen at random. Per model at ~50%, beside the verdict: "
               f"{verdict_parts(beside)}. Settings: measure the geometric mean over the three models of each one's "
               f"held-out perplexity on its own domain, {args.draws} disjoint evaluation draws of {args.windows} "
               f"windows x {args.seq_len} tokens (paired; the random control of repeat i drawn with seed i); the "
               f"fine-tunes are made once (one seed each), so their seed-to-seed noise is not in the repeats; one "
               f"thread.")
    command = "python benchmarks/consolidate.py" + "".join(
        f" --{k} {v}" for k, v, d in (("steps", args.steps, 80), ("windows", args.windows, 8),
                                       ("draws", args.draws, 3)) if v != d)
    write("consolidate", CLAIM, verdict, summary, rows, command, args.model, judgements={**judgements, **beside})


if __name__ == "__main__":
    raise SystemExit(main())
