"""Routers on zoo-tiny-moe (trained with top-2 softmax routing), in one table: average active experts per
token and held-out perplexity per domain, with ratios to the base model.

- expert-choice at a few capacity factors and top-p at a few p, against the base top-2 (issue #7, claim 4);
- steer (claim 5): ``zoo_routers.steer_experts.find_experts`` contrasts code with English on the corpus' train split, the
  experts found are disabled, and code vs English perplexity is compared with the base; controls: as many
  random experts disabled (same layers), and the experts found the other way round (English vs code).

``--claim`` measures the papers' claims instead, each decided by the one rule (``zoo.evaluation.claims.judge``:
the mechanism beats a control that lacks only the mechanism by more than the run's own noise):

- ``top-p`` (Huang et al. 2024: harder tokens get more experts; fewer experts on average at similar quality):
  swapping the router is deterministic, so the repeats are ``--draws`` disjoint evaluation draws (paired). The
  control is top-k at the same average number of experts: per draw, every token gets floor(a) or floor(a) + 1
  experts (the larger share drawn at random) so that the average is top-p's a on that draw. Measures: the experts
  of the hardest quarter of tokens minus those of the easiest (difficulty: the base model's loss on the next
  token), and the geometric mean over domains of the perplexity at that equal average;
- ``otp`` (MC#'s online top-any pruning: over 20% fewer experts with under 1% loss): the pruner is fine-tuned with
  ``zoo.training.finetune`` (only the pruner trains) from each of ``--seeds`` seeds; the control drops experts
  without the learning at the same count: the untrained pruner (its weight-ratio prior) with the keep threshold
  set so that its experts per token match the seed's; beside it the paper's bars (1% perplexity over top-2, 20%
  fewer experts than top-2), each judged over the same seeds;
- ``top-p-loss`` (the dynamic loss makes top-p take fewer experts at similar quality): top-p's gates fine-tuned with
  and without the dynamic (entropy) loss, from each seed; both arms of a seed start from the same gates and see the
  same batches (paired by seed);
- ``all``: the three, one after another (``--quick`` alone runs all three at a tiny budget, records nothing).

    python benchmarks/routers.py                 # full table (a few minutes on one thread)
    python benchmarks/routers.py --windows 4     # fewer held-out windows, faster
    python benchmarks/routers.py --claim top-p   # 4 draws x 16 windows per domain
    python benchmarks/routers.py --claim otp     # 3 seeds x 50 steps
    python benchmarks/routers.py --claim top-p-loss   # 3 seeds x 2 arms x 30 steps
    python benchmarks/routers.py --quick         # every claim: 2 draws / 2 seeds x 2 steps; records nothing
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
from claim_args import conclude, draw_windows, geo, load_model, seed_args, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.editing.apply import NoChange  # noqa: E402
from zoo.editing.calibration import corpus  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokens import eval_windows, token_stream  # noqa: E402
from zoo.evaluation.eval import perplexity_and_usage  # noqa: E402
from zoo.moe import Routing  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402
from zoo_routers.steer_experts import find_experts  # noqa: E402

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
def per_token(model, ids_by_domain: dict, batch: int = 4) -> dict:
    """Per domain of ``ids_by_domain`` ({domain: [N, L] ids}): each token's next-token loss and the experts it got
    (mean over MoE layers), from one pass; ``ppl`` is exp of the mean loss."""
    layers = [m for _, m in moe_layers(model)]
    counts = []
    hooks = [m.experts.register_forward_hook(
        lambda mod, args, out: counts.append((args[1].indices < mod.num_experts).sum(-1).float())) for m in layers]
    out = {}
    try:
        for d, ids in ids_by_domain.items():
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


def draw_ids(tok, draw: int, windows: int) -> dict:
    """{domain: [windows, SEQ_LEN] ids} of evaluation draw ``draw`` (disjoint held-out windows)."""
    return draw_windows(tok, draw, windows, SEQ_LEN)


def mean_k(r: dict) -> float:
    """Average experts per token over domains (each domain holds the same number of tokens)."""
    return sum(r[d]["active"] for d in DOMAINS) / len(DOMAINS)


def geo_ppl(r: dict) -> float:
    return geo({d: r[d]["ppl"] for d in DOMAINS})


def hard_minus_easy(r: dict, ref: dict) -> float:
    """Experts of the hardest quarter of tokens minus the easiest (by the base model's loss), mean over domains."""
    gaps = [quartile_experts(r[d]["experts"], ref[d]["loss"]) for d in DOMAINS]
    return sum(hard - easy for easy, hard in gaps) / len(gaps)


def mixed_top_k(base, average: float, seed: int):
    """Top-k at ``average`` experts per token without a per-token rule: top-(floor(a) + 1) softmax routing whose last
    slot is emptied for a random share 1 - (a - floor(a)) of the tokens (a generator seeded by ``seed``); the kept
    weights are renormalised, as top-p's are."""
    low = int(math.floor(average + 1e-9))
    share = average - low  # tokens that keep the extra expert
    try:
        model = zoo.apply(copy.deepcopy(base), "topk-softmax", top_k=low + 1)
    except NoChange:  # the base already routes top-(floor(a) + 1) by softmax
        model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    for _, moe in moe_layers(model):
        def forward(hidden, inner=moe.router.forward, num_experts=moe.router.num_experts):
            r = inner(hidden)
            keep = torch.ones_like(r.indices, dtype=torch.bool)
            keep[:, low:] = (torch.rand(len(r.indices), generator=g) < share)[:, None]
            weights = torch.where(keep, r.weights, 0.0)
            return Routing(weights=weights / weights.sum(-1, keepdim=True), logits=r.logits,
                           indices=torch.where(keep, r.indices, num_experts))
        moe.router.forward = forward
    return model.eval()


def finish(args, name: str) -> bool:
    """Print the run's end line; True when this run records."""
    print(f"{'quick run, ' if args.quick else ''}{name}: {time.perf_counter() - args.started:.0f} s"
          + (", nothing recorded" if args.no_record else ""), flush=True)
    return not args.no_record


def control_of(p: float) -> str:
    return f"top-k at top-p p={p:g}'s average"


def claim_top_p(args, base, tok) -> None:
    from zoo.evaluation.claims import judge

    rows, gap, ppl, ks = [], {}, {}, {}
    for i in range(args.draws):
        ids = draw_ids(tok, i, args.windows)
        ref = per_token(base, ids)
        rows.append(row(f"base top-2, draw {i}", ref, ref))
        for p in args.p:
            r = per_token(zoo.apply(copy.deepcopy(base), "top-p", p=p), ids)
            a = mean_k(r)
            c = per_token(mixed_top_k(base, a, seed=i), ids)
            for arm, res in ((f"top-p p={p:g}", r), (control_of(p), c)):
                gap.setdefault(arm, []).append(hard_minus_easy(res, ref))
                ppl.setdefault(arm, []).append(geo_ppl(res))
                ks.setdefault(arm, []).append(mean_k(res))
                extra = {}
                for d in DOMAINS:
                    easy, hard = quartile_experts(res[d]["experts"], ref[d]["loss"])
                    extra.update({f"k easy-q {d}": round(easy, 3), f"k hard-q {d}": round(hard, 3),
                                  f"rho {d}": round(spearman(res[d]["experts"], ref[d]["loss"]), 3)})
                rows.append({**row(f"{arm}, draw {i}", res, ref), "k mean": round(ks[arm][-1], 4),
                             "ppl geo-mean": round(ppl[arm][-1], 4), **extra})
    print_rows(rows)
    judgements = {}
    for p in args.p:
        mech, ctrl = f"top-p p={p:g}", control_of(p)
        judgements[f"p={p:g}: hard-quarter minus easy-quarter experts, top-p vs top-k at the same average"] = judge(
            gap[mech], gap[ctrl], lower_is_better=False, paired=True)
        judgements[f"p={p:g}: perplexity (geo-mean) at the same average experts, top-p vs top-k"] = judge(
            ppl[mech], ppl[ctrl], paired=True)
    claim = "harder tokens get more experts; fewer experts on average at similar quality"
    verdict = conclude(f"top-p: {claim}", judgements, "paired draws")
    if not finish(args, "top-p"):
        return
    from zoo.evaluation.claims import record

    avg = "; ".join(f"p={p:g}: top-p {sum(ks[f'top-p p={p:g}']) / args.draws:.3f}, top-k "
                    f"{sum(ks[control_of(p)]) / args.draws:.3f}" for p in args.p)
    summary = (f"{verdict_parts(judgements)}. Settings: {args.model} (trained with top-2) with its router swapped for "
               f"top-p at p in {list(args.p)}; the control is top-k at the same average experts per token (each token "
               "floor(a) or floor(a)+1 experts, the extra one at random, so the average is top-p's on that draw): "
               f"average experts per token {avg}. {args.draws} disjoint evaluation draws of {args.windows} held-out "
               f"windows of {SEQ_LEN} tokens per domain, the same for every arm (paired); one thread. A token's "
               "difficulty is the base model's loss on the next token; 'k easy-q'/'k hard-q' are the mean experts "
               "of the easiest/hardest quarter of tokens, rho the rank correlation of experts with difficulty. "
               "'Fewer experts at similar quality' is read as: at the same average experts, lower perplexity than "
               "top-k. No dynamic (entropy) loss was trained here: the router is the top-2-trained one.")
    command = "python benchmarks/routers.py --claim top-p" + (f" --draws {args.draws}" if args.draws != 4 else "") \
        + (f" --windows {args.windows}" if args.windows != 16 else "") \
        + ("" if args.p == [0.5, 0.7] else " --p " + " ".join(f"{p:g}" for p in args.p))
    path = record("top-p", claim, verdict, summary, rows, command, args.model, judgements=judgements)
    print(f"{verdict}: recorded in {path}")


def keep_probabilities(model, ids: dict) -> torch.Tensor:
    """The keep probabilities of every prunable slot (every layer, token and slot after the first) of ``model``'s
    otp routers on ``ids``: what the keep threshold is compared with."""
    seen = []
    routers = [moe.router for _, moe in moe_layers(model)]
    originals = [r.keep_logits for r in routers]
    for r, keep_logits in zip(routers, originals):
        r.keep_logits = lambda hidden, top, f=keep_logits: seen.append(f(hidden, top)[:, 1:].detach()) or seen[-1]
    try:
        per_token(model, ids)
    finally:
        for r in routers:
            del r.keep_logits
    return torch.sigmoid(torch.cat([s.reshape(-1) for s in seen]).float())


def matched_prior(base, ids: dict, target: float):
    """The untrained otp pruner (its weight-ratio prior) with the keep threshold that gives ``target`` experts per
    token on ``ids``: a quantile of its keep probabilities, corrected once for the change pruning makes downstream.
    Returns (model, its per_token result)."""
    prior = zoo.apply(copy.deepcopy(base), "otp").eval()
    probs = keep_probabilities(prior, ids)
    slots = moe_layers(base)[0][1].router.top_k - 1  # prunable slots per token

    def at(kept: float):
        t = float(torch.quantile(probs, min(max(1 - kept / slots, 0.0), 1.0)))
        t = min(max(t, 1e-6), 1 - 1e-6)
        for _, moe in moe_layers(prior):
            moe.router.keep_threshold = t
        return per_token(prior, ids)

    r = at(target - 1)
    r = at(2 * (target - 1) - (mean_k(r) - 1))  # once more, aimed past the miss
    return prior, r


def finetuned(base, args, adapter: str, options: dict, seed: int):
    from zoo.training.finetune import finetune

    return finetune(copy.deepcopy(base), adapter, options, domain=args.otp_domain, steps=args.steps_for[adapter],
                    lr=args.lr_for[adapter], batch_size=args.otp_batch, seq_len=args.train_seq_len, windows=1,
                    seed=seed, threads=1, progress=False).model.eval()


def claim_otp(args, base, tok) -> None:
    from zoo.evaluation.claims import judge

    ids = draw_ids(tok, 0, args.windows)
    ref = per_token(base, ids)
    rows, geos, ks, prior_geos, prior_ks = [row("base top-2", ref, ref)], [], [], [], []
    for seed in range(args.seeds):
        r = per_token(finetuned(base, args, "otp", {"sparsity": args.sparsity}, seed), ids)
        _, c = matched_prior(base, ids, mean_k(r))
        geos.append(geo_ppl(r))
        ks.append(mean_k(r))
        prior_geos.append(geo_ppl(c))
        prior_ks.append(mean_k(c))
        rows.append({**row(f"otp sparsity={args.sparsity:g}, seed {seed}", r, ref), "k mean": round(ks[-1], 4),
                     "ppl geo-mean": round(geos[-1], 4)})
        rows.append({**row(f"untrained prior at seed {seed}'s experts", c, ref), "k mean": round(prior_ks[-1], 4),
                     "ppl geo-mean": round(prior_geos[-1], 4)})
    print_rows(rows)
    base_geo, base_k = geo_ppl(ref), mean_k(ref)
    n = args.seeds
    judgements = {
        "perplexity (geo-mean) at the same experts per token, learned pruner vs its untrained weight-ratio prior":
            judge(geos, prior_geos, paired=True),
        "the paper's quality bar: perplexity vs top-2's x 1.01": judge(geos, [base_geo * 1.01] * n, paired=True),
        "the paper's sparsity bar: experts per token vs top-2's x 0.8": judge(ks, [base_k * 0.8] * n, paired=True)}
    claim = "over 20% fewer experts activated with under 1% performance loss"
    verdict = conclude(f"otp: {claim}", judgements, "seeds, paired by seed")
    if not finish(args, "otp"):
        return
    from zoo.evaluation.claims import record

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    summary = (f"{verdict_parts(judgements)}. Measured: {mean(ks):.3f} experts per token ({100 * (1 - mean(ks) / base_k):.1f}% "
               f"fewer than top-2) at perplexity geo-mean {mean(geos):.3f} ({100 * (mean(geos) / base_geo - 1):+.2f}% "
               f"vs top-2's {base_geo:.3f}); the untrained prior at the same count ({mean(prior_ks):.3f}): "
               f"{mean(prior_geos):.3f}. Settings: {args.model} (top-2) with otp fine-tuned by "
               f"zoo.training.finetune for {args.otp_steps} steps of {args.otp_batch}x{args.train_seq_len} tokens on the "
               f"{args.otp_domain} train split (only the pruner trains; lr {args.lr_for['otp']:g}, Gumbel temperature 1, "
               f"sparsity weight {args.sparsity:g}) from seeds {', '.join(map(str, range(n)))} (batches and Gumbel "
               "noise; the pruner starts from its deterministic prior, so each seed's control is matched to it: "
               f"paired by seed); {args.windows} held-out windows of {SEQ_LEN} tokens per domain; one thread. The "
               "control lacks only the learning: the untrained pruner keeps a slot by its weight ratio, its "
               "threshold set to the seed's experts per token. The paper's bars (20% fewer experts, under 1% loss) "
               "are judged against top-2 over the same seeds. MC# trains the pruner on large MoEs and scores "
               "downstream accuracy.")
    command = "python benchmarks/routers.py --claim otp" + "".join(
        f" --{k} {v:g}" for k, v, default in (("windows", args.windows, 16), ("otp-steps", args.otp_steps, 50),
                                             ("sparsity", args.sparsity, 0.1), ("seeds", args.seeds, 3)) if v != default)
    path = record("otp", claim, verdict, summary, rows, command, args.model, judgements=judgements)
    print(f"{verdict}: recorded in {path}")


def claim_top_p_loss(args, base, tok) -> None:
    """The dynamic loss at equal fine-tuning steps: does it make top-p take fewer experts at similar quality?"""
    from zoo.evaluation.claims import judge, same_weights

    ids = draw_ids(tok, 0, args.windows)
    ref = per_token(base, ids)
    p = args.p[0] if len(args.p) == 1 else 0.4  # the paper's threshold unless one p is given
    rows = [row("base top-2", ref, ref)]
    arms = {f"dynamic loss {args.dynamic_coef:g}": args.dynamic_coef, "without the dynamic loss": 0.0}
    ks, geos, same = {a: [] for a in arms}, {a: [] for a in arms}, []
    for seed in range(args.seeds):
        models = {}
        for arm, coef in arms.items():
            models[arm] = finetuned(base, args, "top-p", {"p": p, "dynamic_loss_coef": coef}, seed)
            r = per_token(models[arm], ids)
            ks[arm].append(mean_k(r))
            geos[arm].append(geo_ppl(r))
            rows.append({**row(f"top-p p={p:g} tuned, {arm}, seed {seed}", r, ref), "k mean": round(ks[arm][-1], 4),
                         "ppl geo-mean": round(geos[arm][-1], 4)})
        same.append(same_weights(*models.values()))
    print_rows(rows)
    mech, ctrl = arms
    why = "the dynamic loss did not move the gates at this budget" if all(same) else ""

    def part(measure: dict) -> dict:  # lower is better for both
        return judge(measure[mech], measure[ctrl], paired=True, same_model=all(same), why_same=why)

    judgements = {"experts per token, with vs without the dynamic loss": part(ks),
                  "perplexity (geo-mean), with vs without the dynamic loss": part(geos)}
    claim = "the dynamic loss makes top-p activate fewer experts at similar quality"
    verdict = conclude(f"top-p: {claim}", judgements, "seeds, paired by seed")
    if not finish(args, "top-p-loss"):
        return
    from zoo.evaluation.claims import record

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    summary = (f"{verdict_parts(judgements)}. Measured: experts per token {mean(ks[mech]):.4f} with the loss vs "
               f"{mean(ks[ctrl]):.4f} without, perplexity geo-mean {mean(geos[mech]):.3f} vs {mean(geos[ctrl]):.3f}. "
               f"Settings: {args.model} (top-2) with its router swapped for top-p (p={p:g}) and the gates fine-tuned "
               f"by zoo.training.finetune for {args.loss_steps} steps of {args.otp_batch}x{args.train_seq_len} tokens on "
               f"the {args.otp_domain} train split (lr {args.lr_for['top-p']:g}, the balance loss on), with the "
               f"dynamic loss at the paper's weight {args.dynamic_coef:g} and without it; seeds "
               f"{', '.join(map(str, range(args.seeds)))} (both arms of a seed start from the same gates and see the "
               f"same batches: paired by seed); {args.windows} held-out windows of {SEQ_LEN} tokens per domain; one "
               "thread. The perplexity part holds only when the loss improves it beyond the noise (within the noise it "
               "is inconclusive: similar quality is not a gain to show). The paper trains from scratch; here only the "
               "gates of a top-2-trained model move.")
    command = "python benchmarks/routers.py --claim top-p-loss" + "".join(
        f" --{k} {v:g}" for k, v, default in (("windows", args.windows, 16), ("loss-steps", args.loss_steps, 30),
                                             ("seeds", args.seeds, 3)) if v != default)
    path = record("top-p", claim, verdict, summary, rows, command, args.model, judgements=judgements)
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
    ap.add_argument("--claim", choices=["top-p", "otp", "top-p-loss", "all"],
                    help="measure and record one paper's claim (or all three) instead")
    ap.add_argument("--p", type=float, nargs="+", default=[0.5, 0.7], help="top-p masses (--claim top-p)")
    ap.add_argument("--draws", type=int, default=4, help="disjoint evaluation draws (--claim top-p)")
    ap.add_argument("--sparsity", type=float, default=0.1, help="otp's sparsity weight")
    ap.add_argument("--dynamic-coef", type=float, default=1e-4,
                    help="the dynamic loss' weight (--claim top-p-loss; the paper's 1e-4; the control is 0)")
    ap.add_argument("--otp-steps", type=int, default=50, help="otp's fine-tuning steps (--claim otp)")
    ap.add_argument("--loss-steps", type=int, default=30, help="top-p's fine-tuning steps (--claim top-p-loss)")
    ap.add_argument("--otp-batch", type=int, default=4)
    ap.add_argument("--otp-lr", type=float, default=1e-2, help="otp's pruner")
    ap.add_argument("--top-p-lr", type=float, default=1e-3, help="top-p's gates (--claim top-p-loss)")
    ap.add_argument("--otp-domain", default="english", choices=list(DOMAINS))
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--windows", type=int, default=None,
                    help="held-out windows of 256 tokens per domain (per draw for --claim top-p; default 16, and "
                         "24 for the table)")
    ap.add_argument("--calibration-tokens", type=int, default=16384, help="tokens per set for find_experts")
    ap.add_argument("--top", type=int, nargs="+", default=[4, 8], help="experts find_experts returns")
    ap.add_argument("--no-record", action="store_true", help="--claim: print the verdicts, record nothing")
    args = seed_args(ap).parse_args()
    args.started, args.train_seq_len = time.perf_counter(), SEQ_LEN
    if args.quick:  # every claim's whole path at a tiny budget: 2 draws / 2 seeds x 2 steps, 2 windows
        args.claim = args.claim or "all"
        args.draws, args.seeds, args.windows, args.p = 2, min(args.seeds, 2), 2, args.p[:1]
        args.otp_steps, args.loss_steps, args.otp_batch, args.train_seq_len, args.no_record = 2, 2, 1, 64, True
    if args.claim and (args.seeds < 2 or args.draws < 2):
        ap.error("--seeds and --draws must be at least 2: one run has no noise to compare against")
    args.windows = args.windows or (16 if args.claim else 24)
    args.lr_for = {"otp": args.otp_lr, "top-p": args.top_p_lr}
    args.steps_for = {"otp": args.otp_steps, "top-p": args.loss_steps}
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, tok = load_model(args.model), zoo.load_tokenizer(args.model)
    if args.claim:
        todo = ["top-p", "otp", "top-p-loss"] if args.claim == "all" else [args.claim]
        for name in todo:
            {"top-p": claim_top_p, "otp": claim_otp, "top-p-loss": claim_top_p_loss}[name](args, base, tok)
        return
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
