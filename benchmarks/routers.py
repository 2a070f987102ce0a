"""Routers on zoo-tiny-moe (trained with top-2 softmax routing), in one table: average active experts per
token and held-out perplexity per domain, with ratios to the base model.

- expert-choice at a few capacity factors and top-p at a few p, against the base top-2 (issue #7, claim 4);
- steer (claim 5): ``zoo_routers.steer_experts.find_experts`` contrasts code with English on the corpus' train split, the
  experts found are disabled, and code vs English perplexity is compared with the base; controls: as many
  random experts disabled (same layers), and the experts found the other way round (English vs code).

- ``--claim top-p``: the claim of Huang et al. 2024 (harder tokens get more experts; fewer experts on average at
  similar quality): per held-out token, the experts top-p gives it (mean over layers) against its difficulty (the
  base model's loss on the next token), and perplexity against base top-2 and top-1; recorded in
  docs/claims/top-p.json;
- ``--claim otp``: MC#'s online top-any pruning, fine-tuned with ``zoo.training.finetune`` (only the pruner trains), then
  average experts per token and perplexity against base top-2 and top-1; recorded in docs/claims/otp.json.

    python benchmarks/routers.py                 # full table (a few minutes on one thread)
    python benchmarks/routers.py --windows 4     # fewer held-out windows, faster
    python benchmarks/routers.py --claim top-p --windows 8
- ``--claim top-p-loss``: top-p's router fine-tuned with ``zoo.training.finetune`` (only the gates train) with and without
  the paper's dynamic (entropy) loss, at equal steps: average experts per token and perplexity; recorded in
  docs/claims/top-p.json.

    python benchmarks/routers.py --claim otp --windows 8 --otp-steps 200
    python benchmarks/routers.py --claim top-p-loss --windows 8 --otp-steps 200 --otp-lr 1e-3
"""
from __future__ import annotations

import argparse
import copy
import random

import torch

import zoo
from zoo.editing.calibration import corpus
from zoo.data.corpus import DOMAINS
from zoo.data.tokens import eval_windows, token_stream
from zoo.evaluation.eval import perplexity_and_usage
from zoo.moe.layout import moe_layers
from zoo_routers.steer_experts import find_experts

SEQ_LEN = 256


def measure(model, tok, windows: int) -> dict:
    ppl, usage = perplexity_and_usage(model, tok, seq_len=SEQ_LEN, max_windows=windows)
    active = {}
    for d in DOMAINS:
        tokens = eval_windows(token_stream(d, "val", tok), SEQ_LEN, windows).numel()
        active[d] = sum(sum(layer["counts"]) for layer in usage[d]) / (len(usage[d]) * tokens)
    return {"ppl": ppl, "active": active}


def random_like(found: dict, num_experts: int, seed: int) -> dict:
    """As many experts per layer as ``found``, drawn at random."""
    rng = random.Random(seed)
    return {i: sorted(rng.sample(range(num_experts), len(es))) for i, es in found.items()}


@torch.no_grad()
def per_token(model, tok, windows: int, batch: int = 4) -> dict:
    """Per domain: each held-out token's next-token loss and the experts it got (mean over MoE layers), from one
    pass; ``ppl`` is exp of the mean loss."""
    layers = [m for _, m in moe_layers(model)]
    counts = []
    hooks = [m.experts.register_forward_hook(
        lambda mod, args, out: counts.append((args[1].indices < mod.num_experts).sum(-1).float())) for m in layers]
    out = {}
    try:
        for d in DOMAINS:
            ids = eval_windows(token_stream(d, "val", tok), SEQ_LEN, windows)
            losses, experts = [], []
            for start in range(0, len(ids), batch):
                x = ids[start:start + batch]
                counts.clear()
                logits = model(input_ids=x).logits.float()
                nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
                k = torch.stack(counts).mean(0).view(x.shape)  # [B, L], mean over layers
                losses.append(nll.reshape(-1))
                experts.append(k[:, :-1].reshape(-1))  # the routing at position t serves the prediction of t+1
            loss, k = torch.cat(losses), torch.cat(experts)
            out[d] = {"loss": loss, "experts": k, "ppl": float(loss.mean().exp()), "active": float(k.mean())}
    finally:
        for h in hooks:
            h.remove()
    return out


def quartile_experts(k: torch.Tensor, difficulty: torch.Tensor) -> tuple[float, float]:
    """Mean experts of the easiest and the hardest quarter of tokens (by ``difficulty``)."""
    order = difficulty.argsort()
    q = len(order) // 4
    return float(k[order[:q]].mean()), float(k[order[-q:]].mean())


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def claim_top_p(args, base, tok) -> None:
    from zoo.evaluation.claims import record

    ref = per_token(base, tok, args.windows)
    top1 = per_token(zoo.apply(copy.deepcopy(base), "topk-softmax", top_k=1), tok, args.windows)
    rows = [row("base top-2", ref, ref), row("top-1", top1, ref)]
    hard_more, cheap = [], []
    for p in args.p:
        r = per_token(zoo.apply(copy.deepcopy(base), "top-p", p=p), tok, args.windows)
        extra = {}
        for d in DOMAINS:
            easy, hard = quartile_experts(r[d]["experts"], ref[d]["loss"])
            rho = spearman(r[d]["experts"], ref[d]["loss"])
            extra.update({f"k easy-q {d}": round(easy, 3), f"k hard-q {d}": round(hard, 3), f"rho {d}": round(rho, 3)})
            hard_more.append(hard > easy and rho > 0)
        rows.append({**row(f"top-p p={p:g}", r, ref), **extra})
        active = sum(r[d]["active"] for d in DOMAINS) / len(DOMAINS)
        worst = max(r[d]["ppl"] / ref[d]["ppl"] for d in DOMAINS)
        cheap.append(active < 2 and worst <= 1 + args.tolerance)
    print_rows(rows)
    harder = all(hard_more)
    fewer = any(cheap)
    # task level: does the domain with the higher base perplexity get more experts?
    hard_domain = max(DOMAINS, key=lambda d: ref[d]["ppl"])
    easy_domain = min(DOMAINS, key=lambda d: ref[d]["ppl"])
    task = [r[f"k {hard_domain}"] > r[f"k {easy_domain}"] for r in rows[2:]]
    verdict = "holds" if harder and fewer else "holds in part" if harder or fewer else "does not hold"
    summary = (f"zoo-tiny-moe (trained with top-2) with its router swapped for top-p at p in {list(args.p)}; "
               f"{args.windows} held-out windows of {SEQ_LEN} tokens per domain, one thread. A token's difficulty "
               "is the base model's loss on the next token; 'k easy-q'/'k hard-q' are the mean experts top-p gives "
               "the easiest/hardest quarter of tokens, rho the rank correlation of experts with difficulty. "
               "Harder tokens get more experts at every p (hardest quarter above the easiest and a positive rank "
               f"correlation): {harder}. Some p uses fewer than 2 experts on average "
               f"with perplexity within {100 * args.tolerance:g}% of top-2 on both domains: {fewer}. Task level: "
               f"the harder domain ({hard_domain}, base perplexity {ref[hard_domain]['ppl']:.1f} vs "
               f"{ref[easy_domain]['ppl']:.1f}) gets more experts than {easy_domain} at {sum(task)} of {len(task)} "
               "p values (not part of the verdict: the two domains differ in more than difficulty). No dynamic "
               "(entropy) loss was trained here: the router is the top-2-trained one.")
    path = record("top-p", "harder tokens get more experts; fewer experts on average at similar quality", verdict,
                  summary, rows, f"python benchmarks/routers.py --claim top-p --windows {args.windows}", args.model)
    print(f"{verdict}: recorded in {path}")


def claim_otp(args, base, tok) -> None:
    from zoo.evaluation.claims import record
    from zoo.training.finetune import finetune

    ref = per_token(base, tok, args.windows)
    top1 = per_token(zoo.apply(copy.deepcopy(base), "topk-softmax", top_k=1), tok, args.windows)
    rows = [row("base top-2", ref, ref), row("top-1", top1, ref)]
    untrained = per_token(zoo.apply(copy.deepcopy(base), "otp").eval(), tok, args.windows)
    rows.append(row("otp untrained", untrained, ref))
    results = []
    for sparsity in args.sparsity:
        tuned = finetune(copy.deepcopy(base), "otp", {"sparsity": sparsity}, domain=args.otp_domain,
                         steps=args.otp_steps, lr=args.otp_lr, batch_size=args.otp_batch, seq_len=SEQ_LEN, windows=2,
                         threads=1, progress=False).model.eval()
        r = per_token(tuned, tok, args.windows)
        rows.append(row(f"otp sparsity={sparsity:g}", r, ref))
        results.append(r)
    print_rows(rows)
    base_k = sum(ref[d]["active"] for d in DOMAINS) / len(DOMAINS)
    one_k = sum(top1[d]["active"] for d in DOMAINS) / len(DOMAINS)
    verdicts = []
    for r in results:
        k = sum(r[d]["active"] for d in DOMAINS) / len(DOMAINS)
        cut = 1 - k / base_k
        loss = max(r[d]["ppl"] / ref[d]["ppl"] for d in DOMAINS) - 1
        # the straight line from top-2 to top-1 at this expert count: what removing experts blindly would cost
        line = max((top1[d]["ppl"] / ref[d]["ppl"] - 1) * (base_k - k) / (base_k - one_k) for d in DOMAINS)
        verdicts.append("holds" if cut >= 0.2 and loss <= 0.01 else
                        "holds in part" if cut >= 0.2 and loss < line else "does not hold")
    verdict = next((v for v in ("holds", "holds in part") if v in verdicts), "does not hold")
    summary = (f"zoo-tiny-moe (top-2) with otp fine-tuned by zoo.training.finetune for {args.otp_steps} steps of "
               f"{args.otp_batch}x{SEQ_LEN} tokens on the {args.otp_domain} train split (only the pruner trains; "
               f"lr {args.otp_lr:g}, Gumbel temperature 1, sparsity weights {list(args.sparsity)}), one thread; "
               f"{args.windows} held-out windows of {SEQ_LEN} tokens per domain. The paper's claim: over 20% fewer "
               "experts with under 1% loss. 'holds in part': at least 20% fewer experts, with a perplexity cost "
               "below the straight line from top-2 to top-1 at the same expert count, but over 1%.")
    path = record("otp", "over 20% fewer experts activated with under 1% performance loss", verdict, summary, rows,
                  f"python benchmarks/routers.py --claim otp --windows {args.windows} --otp-steps {args.otp_steps}",
                  args.model)
    print(f"{verdict}: recorded in {path}")


def claim_top_p_loss(args, base, tok) -> None:
    """The dynamic loss at equal fine-tuning steps: does it make top-p take fewer experts at similar quality?"""
    from zoo.evaluation.claims import record
    from zoo.training.finetune import finetune

    ref = per_token(base, tok, args.windows)
    p = args.p[0] if len(args.p) == 1 else 0.4  # the paper's threshold unless one p is given
    rows = [row("base top-2", ref, ref), row(f"top-p p={p:g} untuned", per_token(
        zoo.apply(copy.deepcopy(base), "top-p", p=p), tok, args.windows), ref)]
    tuned = {}
    for coef in args.dynamic_coefs:
        model = finetune(copy.deepcopy(base), "top-p", {"p": p, "dynamic_loss_coef": coef}, domain=args.otp_domain,
                         steps=args.otp_steps, lr=args.otp_lr, batch_size=args.otp_batch, seq_len=SEQ_LEN, windows=2,
                         threads=1, progress=False).model.eval()
        tuned[coef] = per_token(model, tok, args.windows)
        rows.append(row(f"tuned, dynamic loss {coef:g}", tuned[coef], ref))
    print_rows(rows)

    def k(r):
        return sum(r[d]["active"] for d in DOMAINS) / len(DOMAINS)

    def worst(r):
        return max(r[d]["ppl"] / ref[d]["ppl"] for d in DOMAINS)

    plain = tuned[0.0]
    wins = [k(tuned[c]) < k(plain) and worst(tuned[c]) <= worst(plain) * (1 + args.tolerance)
            for c in args.dynamic_coefs if c > 0]
    paper = k(tuned[1e-4]) < k(plain) if 1e-4 in tuned else None
    verdict = "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"
    summary = (f"zoo-tiny-moe (top-2) with its router swapped for top-p (p={p:g}) and the gates fine-tuned by "
               f"zoo.training.finetune for {args.otp_steps} steps of {args.otp_batch}x{SEQ_LEN} tokens on the {args.otp_domain} "
               f"train split (lr {args.otp_lr:g}, the balance loss on), with dynamic-loss weights "
               f"{list(args.dynamic_coefs)} (0: without it; 1e-4: the paper's); {args.windows} held-out windows per "
               f"domain. With the loss, fewer experts than without it at perplexity within "
               f"{100 * args.tolerance:g}% of the no-loss run: {sum(wins)} of {len(wins)} weights"
               + (f"; at the paper's 1e-4, fewer experts: {paper}" if paper is not None else "") +
               ". The paper trains from scratch; here only the gates of a top-2-trained model move.")
    path = record("top-p", "the dynamic loss makes top-p activate fewer experts at similar quality", verdict, summary,
                  rows, f"python benchmarks/routers.py --claim top-p-loss --windows {args.windows} "
                  f"--otp-steps {args.otp_steps} --otp-lr {args.otp_lr:g}", args.model)
    print(f"{verdict}: recorded in {path}")


def row(label: str, r: dict, ref: dict) -> dict:
    out = {"run": label}
    for d in DOMAINS:
        out[f"k {d}"] = round(r[d]["active"], 3)
    for d in DOMAINS:
        out[f"ppl {d}"] = round(r[d]["ppl"], 2)
    for d in DOMAINS:
        out[f"x {d}"] = round(r[d]["ppl"] / ref[d]["ppl"], 4)
    return out


def print_rows(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("  ".join(f"{k:>14}" for k in keys))
    for r in rows:
        print("  ".join(f"{r.get(k, ''):>14}" if isinstance(r.get(k, ""), str) else f"{r[k]:>14.4g}" for k in keys))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claim", choices=["top-p", "otp", "top-p-loss"],
                    help="measure and record one paper's claim instead")
    ap.add_argument("--p", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9], help="top-p masses (--claim top-p)")
    ap.add_argument("--tolerance", type=float, default=0.02, help="'similar quality': perplexity within this ratio")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.05, 0.2], help="otp sparsity weights")
    ap.add_argument("--dynamic-coefs", type=float, nargs="+", default=[0.0, 1e-4, 1e-2],
                    help="dynamic-loss weights (--claim top-p-loss; 0 is the run without it)")
    ap.add_argument("--otp-steps", type=int, default=200)
    ap.add_argument("--otp-batch", type=int, default=4)
    ap.add_argument("--otp-lr", type=float, default=1e-2)
    ap.add_argument("--otp-domain", default="english", choices=list(DOMAINS))
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--windows", type=int, default=24, help="held-out windows of 256 tokens per domain")
    ap.add_argument("--calibration-tokens", type=int, default=16384, help="tokens per set for find_experts")
    ap.add_argument("--top", type=int, nargs="+", default=[4, 8], help="experts find_experts returns")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, tok = zoo.load(args.model).eval(), zoo.load_tokenizer(args.model)
    if args.claim:
        return {"top-p": claim_top_p, "otp": claim_otp, "top-p-loss": claim_top_p_loss}[args.claim](args, base, tok)
    num_experts = max(m.num_experts for _, m in moe_layers(base))

    runs = [("base top-2", None, {})]
    runs += [(f"expert-choice cf={cf:g}", "expert-choice", {"capacity_factor": cf}) for cf in (1.0, 2.0, 3.0)]
    runs += [(f"top-p p={p:g}", "top-p", {"p": p}) for p in (0.3, 0.5, 0.7, 0.9)]
    code_set = corpus("code", tokens=args.calibration_tokens)
    english_set = corpus("english", tokens=args.calibration_tokens)
    for top in args.top:
        code_experts = find_experts(base, code_set, english_set, tok, top=top)
        english_experts = find_experts(base, english_set, code_set, tok, top=top)
        print(f"top {top}: code experts {code_experts}; english experts {english_experts}")
        runs.append((f"steer -code x{top}", "steer", {"disable": code_experts}))
        for seed in range(3):
            runs.append((f"steer -random x{top} s{seed}", "steer", {"disable": random_like(code_experts, num_experts, seed)}))
        runs.append((f"steer -english x{top}", "steer", {"disable": english_experts}))

    results = {}
    for label, name, options in runs:
        model = base if name is None else zoo.apply(copy.deepcopy(base), name, **options)
        results[label] = measure(model, tok, args.windows)
    ref = results["base top-2"]["ppl"]
    head = f"{'run':<26}" + "".join(f"{'k ' + d:>10}" for d in DOMAINS) + "".join(f"{'ppl ' + d:>13}" for d in DOMAINS)
    head += "".join(f"{'x ' + d:>10}" for d in DOMAINS) + f"{'code/eng':>10}"
    print(f"\n{args.model}, {args.windows} held-out windows x {SEQ_LEN} tokens per domain; k = active experts/token "
          f"(mean over layers), x = perplexity ratio to base, code/eng = ratio of the two ratios")
    print(head)
    for label, r in results.items():
        ratio = {d: r["ppl"][d] / ref[d] for d in DOMAINS}
        print(f"{label:<26}" + "".join(f"{r['active'][d]:>10.2f}" for d in DOMAINS)
              + "".join(f"{r['ppl'][d]:>13.2f}" for d in DOMAINS) + "".join(f"{ratio[d]:>10.3f}" for d in DOMAINS)
              + f"{ratio['code'] / ratio['english']:>10.3f}")


if __name__ == "__main__":
    main()
