"""Benchmark (issue #7, claim 2; ReMix's claim, recorded in docs/claims/remix.json under the one rule): does ReMix
keep every LoRA in use where a learned softmax router over the same LoRAs concentrates on one or two, and does it
fine-tune better?

Both arms, from each of ``--seeds`` seeds: zoo-tiny-moe (fp32 weights, bf16 autocast), mixture-of-loras on the
attention projections with the same LoRAs (count, rank, seed, so the same initial factors and router rows),
fine-tuned for the same steps on the same batches of the shipped corpus' code domain (train split, drawn from the
seed), same learning-rate schedule as ``moe-zoo finetune``; the arms differ only in the router:
- ``remix``: equal 1/k weights, the router trained with RLOO over ``num_samples`` draws per sequence (so a step
  costs ``num_samples`` forwards/backwards);
- ``learned``: softmax top-k with renormalised weights, trained by backprop on the LM loss (no balance loss).

Reported on held-out windows of both domains (validation split), at eval (deterministic top-k), per targeted
layer then averaged over the layers: the share of selections each LoRA gets and the share of routing-weight
mass, sorted from the most used LoRA down; their entropy in bits (max log2 N); the per-token entropy of the k
weights (max log2 k) and the effective number of LoRAs per token 1 / sum w^2 (max k); how many LoRAs hold at
least 1% of the weight mass; and held-out perplexity per domain before / after. The claim's two parts, each
judged paired by seed (``zoo.evaluation.claims.judge``): the weight-mass entropy (higher: more LoRAs in use) and
the fine-tuned domain's held-out perplexity.

    python benchmarks/mixture_of_loras.py                 # 3 seeds x 40 steps, batch 4 x 128, 1 thread; records
    python benchmarks/mixture_of_loras.py --no-record     # the same, records nothing
    python benchmarks/mixture_of_loras.py --quick         # 2 seeds x 2 tiny steps; records nothing
"""
from __future__ import annotations

import argparse
import math
import time

import torch

import zoo
from zoo.data.corpus import DOMAINS
from zoo.data.tokenizer import load_tokenizer
from zoo.data.tokens import eval_windows, token_stream, train_batch
from zoo.evaluation.eval import perplexity_and_usage
from zoo.training.precision import training_autocast
from zoo.evaluation.claims import judge, same_weights
from zoo.training.finetune import lr_at

# isort: split
# (after ``import zoo``: importing a plugin module first would run the plugin hooks on a half-imported module)
from zoo_adapters.mixture_of_loras import MixtureOfLoras, mixture_modules

from claim_args import conclude, seed_args, verdict_parts  # noqa: E402

ROUTERS = ("remix", "learned")


@torch.no_grad()
def lora_usage(model, tokenizer, seq_len: int, windows: int) -> dict:
    """Routing statistics of every mixture-of-loras layer on held-out windows of all domains, averaged over layers."""
    mods = [m for _, m in mixture_modules(model)]
    n, k = mods[0].num_loras, mods[0].router.top_k
    picks, mass = torch.zeros(len(mods), n), torch.zeros(len(mods), n)
    tok_entropy = ess = tokens = 0.0
    model.eval()
    for domain in DOMAINS:
        batches = eval_windows(token_stream(domain, "val", tokenizer), seq_len, windows)
        for i in range(0, len(batches), 8):
            model(input_ids=batches[i:i + 8])
            for j, m in enumerate(mods):
                idx, w = m.last_routing.indices.reshape(-1), m.last_routing.weights.float()
                picks[j] += torch.bincount(idx, minlength=n).float()
                mass[j].index_add_(0, idx, w.reshape(-1))
                tok_entropy += float(-(w * w.clamp(min=1e-12).log2()).sum())
                ess += float((1 / (w ** 2).sum(-1)).sum())
                tokens += w.shape[0]
    pick_share, mass_share = picks / picks.sum(1, keepdim=True), mass / mass.sum(1, keepdim=True)

    def entropy(p):
        return float((-(p * p.clamp(min=1e-12).log2()).sum(1)).mean())

    return {"pick_share": pick_share.sort(1, descending=True).values.mean(0).tolist(),
            "mass_share": mass_share.sort(1, descending=True).values.mean(0).tolist(),
            "pick_entropy": entropy(pick_share), "mass_entropy": entropy(mass_share),
            "token_entropy": tok_entropy / tokens, "ess": ess / tokens,
            "in_use": float((mass_share >= 0.01).sum(1).float().mean()), "n": n, "k": k}


def run(router: str, args, tokenizer, seed: int) -> dict:
    """One arm from ``seed``: {"before", "after" (perplexity per domain), "init", "trained" (``lora_usage``),
    "seconds", "params", "first_loss", "last_loss", "model"}."""
    torch.manual_seed(seed)
    model = zoo.load(args.model, dtype=torch.float32)
    ppl_before, _ = perplexity_and_usage(model, tokenizer, args.eval_len, args.windows)
    options = {"num_loras": args.num_loras, "r": args.r, "alpha": args.alpha, "router": router, "top_k": args.top_k,
               "num_samples": args.num_samples}
    torch.manual_seed(seed)  # same LoRA factors and router rows for both routers
    model = zoo.apply(model, "mixture-of-loras", **options)
    adapter = MixtureOfLoras(**options)
    usage_init = lora_usage(model, tokenizer, args.eval_len, args.windows)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    stream = token_stream(args.domain, "train", tokenizer)
    streams = {d: stream for d in DOMAINS}
    history, t0 = [], time.perf_counter()
    torch.manual_seed(seed + 1)  # the same remix draws from run to run
    for step in range(args.steps):
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args.lr, step, args.steps)
        ids = train_batch(streams, step, args.batch_size, args.seq_len, seed)
        with training_autocast():
            loss, lm = adapter.loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(lm.item())
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  {router} seed {seed} step {step + 1}/{args.steps} loss {sum(history[-10:]) / len(history[-10:]):.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    ppl_after, _ = perplexity_and_usage(model, tokenizer, args.eval_len, args.windows)
    return {"before": ppl_before, "after": ppl_after, "init": usage_init,
            "trained": lora_usage(model, tokenizer, args.eval_len, args.windows), "seconds": seconds,
            "params": sum(p.numel() for p in params), "first_loss": sum(history[:10]) / len(history[:10]),
            "last_loss": sum(history[-10:]) / len(history[-10:]), "model": model}


def table(results: dict, args) -> str:
    names = list(results)
    rows = []

    def add(label, fmt):
        rows.append((label, [fmt(results[n]) for n in names]))

    for d in DOMAINS:
        add(f"ppl {d} before -> after", lambda r, d=d: f"{r['before'][d]:.2f} -> {r['after'][d]:.2f}")
    add("train LM loss first 10 -> last 10", lambda r: f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    k, n = args.top_k, args.num_loras
    for when in ("init", "trained"):
        add(f"[{when}] selection share by rank", lambda r, w=when: " ".join(f"{s:.2f}" for s in r[w]["pick_share"]))
        add(f"[{when}] weight-mass share by rank", lambda r, w=when: " ".join(f"{s:.2f}" for s in r[w]["mass_share"]))
        add(f"[{when}] selection entropy (bits, max {math.log2(n):.2f})", lambda r, w=when: f"{r[w]['pick_entropy']:.2f}")
        add(f"[{when}] weight-mass entropy (bits, max {math.log2(n):.2f})",
            lambda r, w=when: f"{r[w]['mass_entropy']:.2f}")
        add(f"[{when}] per-token weight entropy (bits, max {math.log2(k):.2f})",
            lambda r, w=when: f"{r[w]['token_entropy']:.3f}")
        add(f"[{when}] effective LoRAs per token (1/sum w^2, max {k})", lambda r, w=when: f"{r[w]['ess']:.3f}")
        add(f"[{when}] LoRAs with >= 1% of the weight mass (of {n})", lambda r, w=when: f"{r[w]['in_use']:.2f}")
    add("trainable params", lambda r: f"{r['params']:,}")
    add("training seconds", lambda r: f"{r['seconds']:.0f}")
    width = max(len(label) for label, _ in rows)
    cols = [max(len(n), max(len(v[i]) for _, v in rows)) for i, n in enumerate(names)]
    lines = [" " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols))]
    lines += [label.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols)) for label, vals in rows]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="zoo-tiny-moe")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--num-loras", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--num-samples", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--domain", default="code", choices=DOMAINS)
    p.add_argument("--eval-len", type=int, default=256)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-record", action="store_true", help="print the verdict, record nothing")
    seed_args(p)
    args = p.parse_args()
    if args.quick:  # the whole path at a tiny budget: 2 seeds x 2 steps of 2 x 32 tokens, 2 windows of 32
        args.seeds, args.steps, args.batch_size, args.seq_len, args.eval_len, args.windows = \
            min(args.seeds, 2), 2, 2, 32, 32, 2
        args.no_record = True
    if args.seeds < 2:
        p.error("--seeds must be at least 2: one run has no noise to compare against")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer = load_tokenizer()
    print(f"{args.model}: mixture-of-loras N={args.num_loras} r={args.r} top-{args.top_k} on q/k/v/o, {args.steps} "
          f"steps of {args.batch_size} x {args.seq_len} {args.domain} tokens, lr {args.lr}, remix num_samples="
          f"{args.num_samples}, seeds {', '.join(map(str, range(args.seeds)))}, {args.threads} thread(s)", flush=True)
    results, same = {router: [] for router in ROUTERS}, True
    for seed in range(args.seeds):
        seeded = {router: run(router, args, tokenizer, seed) for router in ROUTERS}
        print(f"seed {seed}\n{table(seeded, args)}", flush=True)
        same = same and same_weights(seeded["remix"].pop("model"), seeded["learned"].pop("model"))
        for router, r in seeded.items():
            results[router].append(r)
    judgements = judged(results, args, same)
    verdict = conclude(f"remix: {CLAIM}", judgements, "seeds, paired by seed")
    print(f"{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if not args.no_record:
        record(results, args, judgements, verdict)


CLAIM = "RL-trained routing keeps every LoRA in use where a learned router collapses, and fine-tunes better"


def judged(results: dict, args, same: bool) -> dict:
    """The claim's two parts, remix vs learned, paired by seed: LoRAs in use (weight-mass entropy, higher is better)
    and the fine-tuned domain's held-out perplexity (lower is better)."""
    remix, learned = results["remix"], results["learned"]
    why = "both routers trained to bit-identical weights"
    entropy = lambda runs: [r["trained"]["mass_entropy"] for r in runs]  # noqa: E731
    ppl = lambda runs: [r["after"][args.domain] for r in runs]  # noqa: E731
    return {f"weight-mass entropy over the {args.num_loras} LoRAs (bits), remix vs learned":
            judge(entropy(remix), entropy(learned), lower_is_better=False, paired=True, same_model=same, why_same=why),
            f"held-out {args.domain} perplexity, remix vs learned":
            judge(ppl(remix), ppl(learned), lower_is_better=True, paired=True, same_model=same, why_same=why)}


def record(results: dict, args, judgements: dict, verdict: str) -> None:
    """ReMix's claim: routing weights of a learned router collapse onto a few LoRAs; RL routing with equal weights
    keeps them all in use and fine-tunes better. Verdict: ``judged``'s parts, combined."""
    from zoo.evaluation.claims import record as record_claim

    rows = []
    for router, runs in results.items():
        for seed, r in enumerate(runs):
            row = {"router": router, "seed": seed}
            for d in DOMAINS:
                row[f"ppl {d} before"] = round(r["before"][d], 2)
                row[f"ppl {d} after"] = round(r["after"][d], 2)
            row.update({"weight-mass entropy (bits)": round(r["trained"]["mass_entropy"], 3),
                        f"LoRAs >= 1% of mass (of {args.num_loras})": round(r["trained"]["in_use"], 2),
                        "effective LoRAs/token": round(r["trained"]["ess"], 3)})
            rows.append(row)
    mean = lambda router, f: sum(f(r) for r in results[router]) / len(results[router])  # noqa: E731
    entropy, in_use = (lambda r: r["trained"]["mass_entropy"]), (lambda r: r["trained"]["in_use"])
    ppl = lambda r: r["after"][args.domain]  # noqa: E731
    summary = (f"{verdict_parts(judgements)}. {args.steps} steps of {args.batch_size} x {args.seq_len} {args.domain} "
               f"tokens from seeds {', '.join(map(str, range(args.seeds)))} (both routers of a seed: the same LoRAs "
               f"and router rows, the same batches; judged paired by seed), N={args.num_loras}, r={args.r}, "
               f"top-{args.top_k}, lr {args.lr}, remix num_samples={args.num_samples}, one thread; {args.windows} "
               f"held-out windows x {args.eval_len} tokens per domain. Means, remix vs learned: weight-mass entropy "
               f"{mean('remix', entropy):.2f} vs {mean('learned', entropy):.2f} bits of "
               f"{math.log2(args.num_loras):.0f}; LoRAs holding >= 1% of the mass {mean('remix', in_use):.2f} vs "
               f"{mean('learned', in_use):.2f}; {args.domain} perplexity {mean('remix', ppl):.2f} vs "
               f"{mean('learned', ppl):.2f} (before {results['remix'][0]['before'][args.domain]:.2f}). Remix costs "
               f"{args.num_samples} forwards per step. The paper fine-tunes LLMs, far larger and for far longer.")
    command = (f"python benchmarks/mixture_of_loras.py --steps {args.steps} --seeds {args.seeds} --batch-size "
               f"{args.batch_size} --windows {args.windows}")
    path = record_claim("remix", CLAIM, verdict, summary, rows, command, args.model, judgements=judgements)
    print(f"recorded: {verdict} -> {path}")


if __name__ == "__main__":
    main()
