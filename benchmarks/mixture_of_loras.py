"""Benchmark (issue #7, claim 2): does ReMix keep every LoRA in use where a learned softmax router over the same
LoRAs concentrates on one or two?

Both runs: zoo-tiny-moe (fp32 weights, bf16 autocast), mixture-of-loras on the attention projections with the
same LoRAs (count, rank, seed, so the same initial factors and router rows), fine-tuned for the same steps on the
same batches of the shipped corpus' code domain (train split), same learning-rate schedule as ``moe-zoo finetune``.
- ``remix``: equal 1/k weights, the router trained with RLOO over ``num_samples`` draws per sequence (so a step
  costs ``num_samples`` forwards/backwards);
- ``learned``: softmax top-k with renormalised weights, trained by backprop on the LM loss (no balance loss).

Reported on held-out windows of both domains (validation split), at eval (deterministic top-k), per targeted
layer then averaged over the layers: the share of selections each LoRA gets and the share of routing-weight
mass, sorted from the most used LoRA down; their entropy in bits (max log2 N); the per-token entropy of the k
weights (max log2 k) and the effective number of LoRAs per token 1 / sum w^2 (max k); how many LoRAs hold at
least 1% of the weight mass; and held-out perplexity per domain before / after.

    python benchmarks/mixture_of_loras.py                 # 150 steps, batch 4 x 128, 1 thread (~12 min)
    python benchmarks/mixture_of_loras.py --routers learned --steps 600   # learned at remix's compute
    python benchmarks/mixture_of_loras.py --smoke         # a few seconds
    python benchmarks/mixture_of_loras.py --steps 40 --windows 6 --record   # records remix's verdict
                                                          # in docs/claims/remix.json (zoo.evaluation.claims)
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
from zoo.training.finetune import lr_at

# isort: split
# (after ``import zoo``: importing a plugin module first would run the plugin hooks on a half-imported module)
from zoo_adapters.mixture_of_loras import MixtureOfLoras, mixture_modules

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


def run(router: str, args, tokenizer) -> dict:
    torch.manual_seed(args.seed)
    model = zoo.load(args.model, dtype=torch.float32)
    ppl_before, _ = perplexity_and_usage(model, tokenizer, args.eval_len, args.windows)
    options = {"num_loras": args.num_loras, "r": args.r, "alpha": args.alpha, "router": router, "top_k": args.top_k,
               "num_samples": args.num_samples}
    torch.manual_seed(args.seed)  # same LoRA factors and router rows for both routers
    model = zoo.apply(model, "mixture-of-loras", **options)
    adapter = MixtureOfLoras(**options)
    usage_init = lora_usage(model, tokenizer, args.eval_len, args.windows)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    stream = token_stream(args.domain, "train", tokenizer)
    streams = {d: stream for d in DOMAINS}
    history, t0 = [], time.perf_counter()
    torch.manual_seed(args.seed + 1)  # the same remix draws from run to run
    for step in range(args.steps):
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args.lr, step, args.steps)
        ids = train_batch(streams, step, args.batch_size, args.seq_len, args.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, lm = adapter.loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(lm.item())
        if (step + 1) % max(1, args.steps // 10) == 0:
            print(f"  {router} step {step + 1}/{args.steps} loss {sum(history[-10:]) / len(history[-10:]):.3f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    ppl_after, _ = perplexity_and_usage(model, tokenizer, args.eval_len, args.windows)
    return {"before": ppl_before, "after": ppl_after, "init": usage_init,
            "trained": lora_usage(model, tokenizer, args.eval_len, args.windows), "seconds": seconds,
            "params": sum(p.numel() for p in params), "first_loss": sum(history[:10]) / len(history[:10]),
            "last_loss": sum(history[-10:]) / len(history[-10:])}


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
    p.add_argument("--steps", type=int, default=150)
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
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--routers", default=",".join(ROUTERS), help="comma list of: remix, learned")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: check that it runs")
    p.add_argument("--record", action="store_true",
                   help="record ReMix's claim from this run in docs/claims/remix.json (needs both routers)")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.batch_size, args.seq_len, args.eval_len, args.windows = 2, 2, 32, 32, 2
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    print(f"{args.model}: mixture-of-loras N={args.num_loras} r={args.r} top-{args.top_k} on q/k/v/o, {args.steps} "
          f"steps of {args.batch_size} x {args.seq_len} {args.domain} tokens, lr {args.lr}, remix num_samples="
          f"{args.num_samples}, seed {args.seed}, {args.threads} thread(s)", flush=True)
    routers = [r for r in args.routers.split(",") if r]
    if not routers or set(routers) - set(ROUTERS):
        p.error(f"--routers must be a comma list of {', '.join(ROUTERS)}")
    if args.record and set(routers) != set(ROUTERS):
        p.error("--record compares remix with learned: run both routers")
    results = {router: run(router, args, tokenizer) for router in routers}
    print(table(results, args))
    if args.record:
        record(results, args)


def record(results: dict, args) -> None:
    """ReMix's claim: routing weights of a learned router collapse onto a few LoRAs; RL routing with equal weights
    keeps them all in use and fine-tunes better. Verdict from the run just measured."""
    from zoo.evaluation.claims import record as record_claim

    rows = []
    for router, r in results.items():
        row = {"router": router}
        for d in DOMAINS:
            row[f"ppl {d} before"] = round(r["before"][d], 2)
            row[f"ppl {d} after"] = round(r["after"][d], 2)
        row.update({"weight-mass entropy (bits)": round(r["trained"]["mass_entropy"], 3),
                    f"LoRAs >= 1% of mass (of {args.num_loras})": round(r["trained"]["in_use"], 2),
                    "effective LoRAs/token": round(r["trained"]["ess"], 3)})
        rows.append(row)
    remix, learned = results["remix"], results["learned"]
    spread = (remix["trained"]["mass_entropy"] > learned["trained"]["mass_entropy"]
              and remix["trained"]["in_use"] >= learned["trained"]["in_use"])
    better = remix["after"][args.domain] < learned["after"][args.domain]
    verdict = "holds" if spread and better else "holds in part" if spread or better else "does not hold"
    summary = (f"After {args.steps} steps of {args.batch_size} x {args.seq_len} {args.domain} tokens (same LoRAs, "
               f"N={args.num_loras}, r={args.r}, top-{args.top_k}, remix num_samples={args.num_samples}, one thread; "
               f"{args.windows} held-out windows x {args.eval_len} tokens per domain): the remix router "
               f"{'keeps more LoRAs in use' if spread else 'does not keep more LoRAs in use'} than the learned softmax "
               f"router (weight-mass entropy {remix['trained']['mass_entropy']:.2f} vs "
               f"{learned['trained']['mass_entropy']:.2f} bits of {math.log2(args.num_loras):.0f}; LoRAs holding >= 1% of "
               f"the mass {remix['trained']['in_use']:.2f} vs {learned['trained']['in_use']:.2f}) and its {args.domain} "
               f"perplexity is "
               f"{'lower' if better else 'not lower'} ({remix['after'][args.domain]:.2f} vs "
               f"{learned['after'][args.domain]:.2f}). Remix costs {args.num_samples} forwards per step.")
    command = (f"python benchmarks/mixture_of_loras.py --steps {args.steps} --batch-size {args.batch_size} "
               f"--windows {args.windows} --record")
    path = record_claim("remix", "RL-trained routing keeps every LoRA in use where a learned router collapses, "
                        "and fine-tunes better", verdict, summary, rows, command, args.model)
    print(f"recorded: {verdict} -> {path}")


if __name__ == "__main__":
    main()
