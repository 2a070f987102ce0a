"""AdaMoE's claims on zoo-tiny-dense (Shen et al., 2025, arXiv:2510.14300), with the harness of
``benchmarks/upcycle.py`` (the same lr schedule, AdamW, bf16 autocast, clipping, balance loss 0.01, held-out
perplexity per domain from ``zoo.evaluation.eval``). Three arms start from the shipped zoo-tiny-dense and train N more
steps on the same tokens, each with two dense FFNs' worth of active expert compute per token:

* plain upcycling (Sparse Upcycling): ``upcycle`` with 4 copies, top-2 (lossless at init);
* AdaMoE upcycling: ``upcycle`` with ``router="adamoe"``: the dense FFN as a shared expert averaged with 4 routed
  copies, top-1, picked by the router and weighted by softmax probability plus the scale adapter;
* coupled (the paper's ablation, its "vanilla MoE"): the same AdaMoE layer with the scale adapter zeroed and
  frozen, so the router's probability is the weight.

Claims: AdaMoE upcycling beats plain upcycling at equal steps and tokens (the issue's); decoupled beats coupled
(the paper's). Experts are perturbed by the same relative noise in every arm (the paper adds noise to its copies).

Each arm is trained from each of ``--seeds`` seeds: repeat s draws the batches with data seed s + 1 and seeds the
upcycling (router rows, expert noise) with s, so the arms of a seed start from the same dense weights and see the
same batches: each claim is judged paired by seed (``zoo.evaluation.claims.judge``). The measure is the geometric
mean over domains of the held-out perplexity (the same windows for every model); a per-domain win does not count.

    python benchmarks/adamoe.py                   # N=12 steps of 4 x 256 tokens, 3 seeds (about 4 min, one thread)
    python benchmarks/adamoe.py --quick           # 2 seeds x 1 step of 2 x 64 tokens; records nothing
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, geo, seed_args, show, verdict_parts  # noqa: E402
from upcycle import continue_training, measure, summary_rows, table, train_streams  # noqa: E402
import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokenizer import load_tokenizer  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402

UNIT = "seeds, paired by seed"
SETTINGS = ("steps", "batch", "seq_len", "lr", "warmup", "experts", "noise", "windows", "seeds")
SCALE = ("the paper upcycles the FFNs of pi0's action expert (a flow-matching vision-language-action policy) and "
         "fine-tunes it on robot-manipulation demonstrations for full training schedules; this run is a few dozen "
         "steps of a 6M-parameter language model")


def couple(model):
    """The paper's vanilla MoE inside the same layer: every scale adapter zeroed and frozen."""
    for _, moe in moe_layers(model):
        with torch.no_grad():
            moe.router.scale_adapter.zero_()
        moe.router.scale_adapter.requires_grad_(False)
    return model


def main(argv=None):
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--noise", type=float, default=0.01, help="relative noise on each expert copy (every arm)")
    p.add_argument("--windows", type=int, default=8, help="held-out windows of seq-len tokens per domain")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-record", action="store_true")
    args = seed_args(p).parse_args(argv)
    if args.quick:  # a smoke run of the whole path: 2 seeds x 1 step of 2 x 64 tokens, 2 windows; records nothing
        args.seeds, args.steps, args.batch, args.seq_len, args.windows = min(args.seeds, 2), 1, 2, 64, 2
        args.warmup, args.no_record = 1, True
    if args.seeds < 2:
        raise SystemExit("--seeds must be at least 2: one run has no noise to compare against")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    streams = train_streams(tokenizer, args.quick)
    E, n = args.experts, args.steps

    def arms(seed: int) -> dict:
        def upcycled(**options):
            dense = zoo.load("zoo-tiny-dense", dtype=torch.float32).eval()
            return zoo.apply(dense, "upcycle", num_experts=E, noise=args.noise, seed=seed, **options)

        return {f"plain upcycle {E}x top-2": lambda: upcycled(top_k=2),
                f"adamoe shared + {E}x top-1": lambda: upcycled(top_k=1, router="adamoe"),
                f"coupled shared + {E}x top-1": lambda: couple(upcycled(top_k=1, router="adamoe"))}

    printed = {"base (zoo-tiny-dense)": measure(zoo.load("zoo-tiny-dense", dtype=torch.float32).eval(), tokenizer,
                                                args)}
    runs = {}
    for seed in range(args.seeds):
        for name, build in arms(seed).items():
            torch.manual_seed(seed)
            model = build()
            if seed == 0:
                printed[f"{name}, at init"] = measure(model, tokenizer, args)
            trained = continue_training(model, args, streams, f"{name} +{n} s{seed}", seed + 1)
            runs.setdefault(f"{name} +{n}", []).append({**measure(model, tokenizer, args), **trained})
            printed[f"{name} +{n} s{seed}"] = runs[f"{name} +{n}"][-1]
            del model
    settings = (f"N={n} steps of {args.batch}x{args.seq_len} tokens from zoo-tiny-dense, lr {args.lr} (warm-up "
                f"{args.warmup}, cosine to 10%), AdamW, balance loss 0.01, expert noise {args.noise} (relative), random "
                f"gate, seeds {', '.join(map(str, range(args.seeds)))} (data seed s + 1, upcycling seeded with s: the "
                f"arms of a seed see the same batches), {args.windows} held-out windows of {args.seq_len} tokens per "
                f"domain, {torch.get_num_threads()} thread(s)")
    print(f"\n{settings}\n")
    print(table(printed))
    base = printed["base (zoo-tiny-dense)"]
    rows = [{"model": name, **{f"ppl {d}": round(r["ppl"][d], 3) for d in DOMAINS}, "geo-mean": round(geo(r["ppl"]), 3)}
            for name, r in printed.items() if name == "base (zoo-tiny-dense)" or name.endswith(", at init")]
    rows += summary_rows(runs)
    print()
    show(rows)
    plain, ada, coupled = (f"{name} +{n}" for name in arms(0))
    from zoo.evaluation.claims import judge

    def part(mine: str, other: str) -> dict:
        return {f"{mine} vs {other}, held-out geo-mean ppl": judge(
            [geo(r["ppl"]) for r in runs[mine]], [geo(r["ppl"]) for r in runs[other]], paired=True)}

    claims = [("AdaMoE upcycling (shared dense FFN + decoupled router, top-1) beats plain upcycling (top-2) of "
               "zoo-tiny-dense at equal steps, tokens and active compute", part(ada, plain)),
              ("Decoupling helps: the AdaMoE layer beats the same layer with the scale adapter removed (the "
               "router's probability as the weight: the paper's vanilla MoE) at equal steps", part(ada, coupled))]
    print()
    verdicts = [conclude(f"adamoe: {claim}", parts, UNIT) for claim, parts in claims]
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    def ppl(name):
        return ", ".join(f"{k} {printed[name]['ppl'][k]:.2f}" for k in DOMAINS)

    ada_init, coupled_init = (f"{name}, at init" for name in list(arms(0))[1:])
    note = (f"The AdaMoE layer starts away from the dense function (the routed half carries the chosen experts' "
            f"probability plus the adapter's output, not 1): ppl at init (seed 0) {ppl(ada_init)} (coupled: "
            f"{ppl(coupled_init)}) vs the base's {ppl('base (zoo-tiny-dense)')}, while plain upcycling starts on it; "
            f"equal active expert compute (two dense FFNs a token)")
    base_geo = geo(base["ppl"])
    if all(geo(r["ppl"]) > base_geo for rs in runs.values() for r in rs):
        note += (f". Every trained arm ends above the untrained base (geo-mean ppl {base_geo:.3f}): {n} steps at a "
                 f"re-warmed lr {args.lr} measure the early transient of continued training, not a converged comparison")
    command = "python benchmarks/adamoe.py" + "".join(
        f" --{dest.replace('_', '-')} {getattr(args, dest)}" for dest in SETTINGS
        if getattr(args, dest) != p.get_default(dest))
    for (claim, parts), verdict in zip(claims, verdicts):
        j = next(iter(parts.values()))
        summary = (f"{verdict_parts(parts)}: geo-mean held-out ppl {j['mechanism']:.3f} vs {j['control']:.3f} "
                   f"(margin {j['margin']:+.3f}, noise {j['noise']:.3f} over {j['repeats']} {UNIT}); the measure is "
                   f"the geometric mean over the two domains, so a win on one domain alone does not count. {note}. "
                   f"Settings: {settings}. Scale: {SCALE}.")
        record("adamoe", claim, verdict, summary, rows, command, "zoo-tiny-dense", judgements=parts)
    print("recorded: docs/claims/adamoe.json")


if __name__ == "__main__":
    main()
