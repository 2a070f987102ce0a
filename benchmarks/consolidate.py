"""Claim benchmark: ``zoo.consolidate`` (Imani et al., ICML 2025, arXiv:2505.06481) on fine-tunes of zoo-tiny-moe.

The paper serves several fine-tuned copies of one MoE by sharing the experts that stayed similar (one copy serves
them all) and keeping the dissimilar experts and the non-expert layers per model; it reports output quality
competitive with serving each model alone, at a much smaller memory footprint. Here:

1. fine-tunes: zoo-tiny-moe with ``zoo.training.finetune.finetune`` (lora-experts on every expert, merged), one on each
   domain of the zoo's corpus (``english``, ``code``) and a second ``code`` run with another seed;
2. thresholds: chosen from the measured similarities (cosine of each expert's flattened weights to the base's
   same expert, or between the fine-tunes' same expert), so that about 25/50/75/100% of them are at or above;
3. per threshold, on fresh copies: ``zoo.consolidate`` with the base (experts near the base share its copy) and
   without it (experts near each other share the first one's), the bytes of all models together before and
   after (each storage once), and each model's held-out perplexity on its own domain before and after;
4. a control: the same number of (model, expert) pairs, chosen at random instead of by similarity, replaced by
   the base's copy (mean perplexity over three draws): does choosing by similarity matter?

    python benchmarks/consolidate.py                  # 3 fine-tunes x 80 steps, a few CPU minutes
    python benchmarks/consolidate.py --steps 2 --windows 1 --no-record    # smoke
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
import time

import torch

QUANTILES = (0.25, 0.5, 0.75, 1.0)
RUNS = (("english", 0), ("code", 0), ("code", 1))  # (domain, seed) per fine-tune


def finetunes(base, steps: int, seq_len: int, lr: float):
    from zoo.training.finetune import finetune

    models = []
    for domain, seed in RUNS:
        t = time.perf_counter()
        result = finetune(copy.deepcopy(base), "lora-experts", {"r": 8}, domain=domain, steps=steps, lr=lr,
                          batch_size=8, seq_len=seq_len, windows=1, seed=seed, merge=True, progress=False)
        print(f"fine-tuned on {domain} (seed {seed}): {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
        models.append(result.model.eval())
    return models


def similarities(models, base=None) -> list[float]:
    """Per (layer, expert): each model's similarity to the base's copy (with ``base``), else every pair of models'."""
    from zoo.editing.consolidation import cosine, expert_vectors
    from zoo.moe.layout import moe_layers

    sims = []
    for j in range(len(moe_layers(models[0]))):
        vs = [expert_vectors(moe_layers(m)[j][1].experts) for m in models]
        if base is not None:
            bv = expert_vectors(moe_layers(base)[j][1].experts)
            sims += [cosine(v[e], bv[e]) for v in vs for e in range(len(bv))]
        else:
            sims += [cosine(vs[a][e], vs[b][e]) for a in range(len(vs)) for b in range(a + 1, len(vs))
                     for e in range(len(vs[a]))]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    import zoo
    from zoo.editing.consolidation import held_out_perplexity
    from zoo.io.loading import tokenizer_for

    base = zoo.load(args.model, dtype=torch.float32).eval()
    tokenizer = tokenizer_for(base, required=True)
    models = finetunes(base, args.steps, args.seq_len, args.lr)
    domains = [d for d, _ in RUNS]

    def ppl(ms):
        return [held_out_perplexity(m, tokenizer, d, args.seq_len, args.windows) for m, d in zip(ms, domains)]

    own = ppl(models)
    base_ppl = ppl([base] * len(models))
    sims = {True: similarities(models, base), False: similarities(models)}
    for with_base, s in sims.items():
        print(f"similarity {'to the base' if with_base else 'between fine-tunes'} over {len(s)} pairs: min "
              f"{s[-1]:.6f}, median {s[len(s) // 2]:.6f}, max {s[0]:.6f}")
    rows = []
    for q in QUANTILES:
        for with_base in (True, False):
            s = sims[with_base]
            threshold = s[max(0, round(q * len(s)) - 1)] if q < 1 else -1.0
            copies = [copy.deepcopy(m) for m in models]
            result = zoo.consolidate(copies, threshold=threshold, base=base if with_base else None,
                                     domains=domains, seq_len=args.seq_len, windows=args.windows, progress=False)
            assert result.perplexity["before"] == own
            row = {"sharing": f"~{int(q * 100)}% of similarities", "against": "base" if with_base else "each other",
                   "threshold": round(threshold, 6), "shared_pairs": result.shared_experts,
                   "MiB_before": round(result.bytes_before / 2**20, 2),
                   "MiB_after": round(result.bytes_after / 2**20, 2),
                   "saved_pct": round(100 * result.bytes_saved / result.bytes_before, 1)}
            for i, d in enumerate(domains):
                row[f"ppl{i}_{d}"] = f"{own[i]:.3f}->{result.perplexity['after'][i]:.3f}"
            if with_base:  # the mean over three random draws of as many (model, expert) pairs
                draws = [ppl(random_control(models, base, result.shared_experts, seed)) for seed in range(3)]
                for i, d in enumerate(domains):
                    row[f"random{i}"] = f"{sum(dr[i] for dr in draws) / len(draws):.3f}"
            rows.append(row)
            print(" | ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            del copies, result
    print("\nheld-out perplexity on each model's own domain: fine-tuned alone "
          + ", ".join(f"{d} {p:.3f}" for d, p in zip(domains, own)) + "; the base model "
          + ", ".join(f"{d} {p:.3f}" for d, p in zip(domains, base_ppl)))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    if not args.no_record:
        record(rows, own, base_ppl, domains, args)
    return 0


def record(rows, own, base_ppl, domains, args) -> None:
    from zoo.evaluation.claims import record as write

    half = next(r for r in rows if r["sharing"] == "~50% of similarities" and r["against"] == "base")

    def change(row, i):
        b, a = (float(x) for x in row[f"ppl{i}_{domains[i]}"].split("->"))
        return 100 * (a / b - 1)

    def control(row, i):
        return 100 * (float(row[f"random{i}"]) / own[i] - 1)

    worst = max(change(half, i) for i in range(len(domains)))
    better = sum(change(half, i) <= control(half, i) for i in range(len(domains)))
    gain = [100 * (1 - own[i] / base_ppl[i]) for i in range(len(domains))]
    verdict = "holds" if worst < 1.0 and better == len(domains) else (
        "holds in part" if worst < 3.0 or better else "does not hold")
    summary = (f"Three lora-experts fine-tunes of {args.model} ({args.steps} steps; own-domain perplexity "
               f"{', '.join(f'{g:.1f}%' for g in gain)} below the base). Sharing ~50% of the (model, expert) pairs "
               f"with the base's copy saves {half['saved_pct']}% of the bytes of all three models; own-domain "
               f"perplexity changes by at most {worst:+.2f}%, and by less than sharing as many random experts for "
               f"{better} of {len(domains)} models.")
    write("consolidate", "Similar experts shared across fine-tunes keep output quality competitive while the "
          "memory of serving several fine-tuned MoEs shrinks", verdict, summary,
          rows + [{"sharing": "none (each fine-tune alone)", **{f"ppl{i}_{d}": own[i] for i, d in enumerate(domains)}},
                  {"sharing": "the base model alone", **{f"ppl{i}_{d}": base_ppl[i] for i, d in enumerate(domains)}}],
          "python " + " ".join(sys.argv), args.model)


if __name__ == "__main__":
    raise SystemExit(main())
