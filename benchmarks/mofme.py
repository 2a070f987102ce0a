"""MoFME's claims on zoo-tiny-dense, in one run:

* mofme (experts): more FiLM experts at near-constant parameters lower perplexity. zoo-tiny-dense is upcycled
  (``upcycle`` with ``experts="mofme"``) into E = 1 (the dense control: the same FFN with one FiLM, top-1), 4
  and 16 experts (top-2), each arm trained the same N steps on the same batches; held-out perplexity and
  parameter counts side by side.
* uncertainty-aware (router): with 16 MoFME experts, the uncertainty-aware router (MC dropout, calibrated
  weights) beats the plain linear top-k softmax router with the same initial rows, at equal steps.

Every arm starts as the dense model (identity FiLM, renormalised top-k weights) and trains with
``benchmarks/upcycle.py``'s loop (``zoo.training.train``'s AdamW, warm-up + cosine, bf16 autocast, clipping, the
load-balancing loss at 0.01), the FiLM vectors and routers at their own rate (``--film-lr``). Perplexity is
``zoo.evaluation.eval`` on held-out windows (fp32, routers in eval mode); the measure is its geometric mean over
domains.

Every arm runs from each of ``--seeds`` seeds: seed s draws the router rows and the MC-dropout masks
(``torch.manual_seed(s)``) and the batches (data seed ``--seed`` + s; the base was trained with 0). Each claim is
decided by the one rule (``zoo.evaluation.claims.judge``): more experts against E = 1 over independent seeds (the
arms differ in shape, so they do not start from the same weights); the uncertainty-aware router against the plain
one paired by seed (same initial rows, same batches).

    python benchmarks/mofme.py                      # the recorded run: 3 seeds x 3 arms (a few CPU minutes)
    python benchmarks/mofme.py --quick              # 2 seeds x 2 steps, E = 1 and 4; records nothing
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, geo, seed_args, verdict_parts  # noqa: E402
from upcycle import measure, table  # noqa: E402  (the upcycle claims' measurement and table)

import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokenizer import load_tokenizer  # noqa: E402
from zoo.data.tokens import token_stream, train_batch  # noqa: E402
from zoo.moe.layout import moe_layers, set_block, sync_layout  # noqa: E402
from zoo.training.precision import training_autocast  # noqa: E402
from zoo.evaluation.claims import judge  # noqa: E402
from zoo.training.train import TrainConfig, lr_at  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

SCOPE = ("Scope: a short continued-training run of an upcycled, already trained dense model; the paper trains MoFME "
         "from scratch to convergence (image restoration), where the experts have the whole run to specialise")


def continue_training(model, args, streams, label: str, seed: int) -> dict:
    """``benchmarks/upcycle.py``'s loop (AdamW, warm-up + cosine, bf16 autocast, clipping, balance loss), with the
    FiLM vectors and the routers in their own group at ``--film-lr``: vectors a few steps must move (as norms and
    biases often get a larger rate); every arm, the E=1 control included, gets the same groups."""
    film = [p for n, p in model.named_parameters() if "film_" in n or ".router." in n]
    ids = {id(p) for p in film}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1, "scale": 1.0},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0, "scale": 1.0},
              {"params": film, "weight_decay": 0.0, "scale": args.film_lr / args.lr}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    cfg = TrainConfig(lr=args.lr, warmup=args.warmup, steps=args.steps, min_lr_ratio=0.1)
    model.train()
    losses, start = [], time.perf_counter()
    for step in tqdm(range(args.steps), desc=label):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step) * group["scale"]
        batch = train_batch(streams, step, args.batch, args.seq_len, seed=seed)
        with training_autocast():
            out = model(input_ids=batch, labels=batch, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item() - model.config.router_aux_loss_coef * out.aux_loss.item())
    model.eval()
    tail = losses[-20:]
    return {"seconds": time.perf_counter() - start, "train_loss": sum(tail) / len(tail)}


def dense():
    return zoo.load("zoo-tiny-dense", dtype=torch.float32).eval()


def mofme(num_experts: int, top_k: int):
    return zoo.apply(dense(), "upcycle", num_experts=num_experts, top_k=top_k, experts="mofme")


def with_plain_router(model):
    """The same model with each uncertainty-aware router replaced by topk-softmax holding the same rows."""
    from zoo_routers.topk_softmax import TopKSoftmax

    for i, moe in moe_layers(model):
        old = moe.router
        new = TopKSoftmax(old.hidden_size, old.num_experts, old.top_k)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        set_block(model, i, moe.with_parts(router=new))
    sync_layout(model)
    return model


def arm(build, args, streams, label: str, seed: int, tokenizer) -> dict:
    """One arm from one seed: ``build()`` under ``torch.manual_seed(seed)`` (router rows, MC-dropout masks), trained
    on data seed ``--seed`` + seed, measured on the held-out windows."""
    torch.manual_seed(seed)
    model = build()
    trained = continue_training(model, args, streams, f"{label} s{seed}", args.seed + seed)
    return {**measure(model, tokenizer, args), **trained}


def main(argv=None):
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-4, help="the shared FFNs, attention, norms, embeddings")
    p.add_argument("--film-lr", type=float, default=1e-2, help="the FiLM vectors and the routers")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--experts", type=int, nargs="+", default=[1, 16], help="E=1 is the control; the largest E also "
                                                                          "runs with the plain router")
    p.add_argument("--windows", type=int, default=6, help="held-out windows of seq-len tokens per domain")
    p.add_argument("--seed", type=int, default=1, help="data seed of seed 0 (the base model was trained with 0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-record", action="store_true")
    args = seed_args(p).parse_args(argv)
    if args.quick:  # the whole path at a tiny budget: 2 seeds x 2 steps, E = 1 and 4, 2 windows; records nothing
        args.seeds, args.steps, args.warmup, args.batch, args.seq_len = min(args.seeds, 2), 2, 1, 2, 64
        args.experts, args.windows, args.no_record = [1, 4], 2, True
    if args.seeds < 2:
        p.error("--seeds must be at least 2: one run has no noise to compare against")
    if 1 not in args.experts or len(args.experts) < 2:
        p.error("--experts must hold 1 (the control) and at least one larger E")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    streams = {d: token_stream(d, "train", tokenizer) for d in DOMAINS}

    E = max(args.experts)
    names = {e: f"mofme E={e} top-{min(2, e)}" for e in sorted(args.experts)}
    plain = f"mofme E={E} top-2, topk-softmax"
    builds = {**{names[e]: (lambda e=e: mofme(e, min(2, e))) for e in names}, plain: lambda: with_plain_router(mofme(E, 2))}
    rows = {"base (zoo-tiny-dense)": measure(dense(), tokenizer, args)}
    geos = {name: [] for name in builds}
    for seed in range(args.seeds):
        for name, build in builds.items():
            r = arm(build, args, streams, name, seed, tokenizer)
            rows[f"{name} s{seed}"] = r
            geos[name].append(geo(r["ppl"]))
            print(f"{name} s{seed}: ppl geo-mean {geos[name][-1]:.3f}, {r['seconds']:.0f} s", flush=True)

    seeds = ", ".join(map(str, range(args.seeds)))
    settings = (f"N={args.steps} steps of {args.batch}x{args.seq_len} tokens, lr {args.lr} (FiLM vectors and routers "
                f"{args.film_lr}; warm-up {args.warmup}, cosine to 10%), router rows N(0, initializer_range^2), "
                f"uncertainty-aware router 4 MC samples at dropout 0.1 in training, seeds {seeds} (data seeds "
                f"{args.seed}..{args.seed + args.seeds - 1}), {args.windows} held-out windows of {args.seq_len} tokens "
                f"per domain, measure: geometric mean over domains of the perplexity, "
                f"{torch.get_num_threads()} thread(s)")
    print(f"\n{settings}\n")
    print(table(rows))

    numbers = [{"model": n, **{f"ppl {d}": round(r["ppl"][d], 3) for d in DOMAINS},
                "ppl geo-mean": round(geo(r["ppl"]), 4),
                "params (M)": round(r["size"]["params"] / 1e6, 4),
                "active (M)": round(r["size"]["active_params"] / 1e6, 4),
                **({"train loss": round(r["train_loss"], 3)} if "train_loss" in r else {})} for n, r in rows.items()]
    control = names[1]
    experts = {f"{names[e]} vs {control} (ppl geo-mean)": judge(geos[names[e]], geos[control])
               for e in sorted(args.experts) if e > 1}
    router = {f"{names[E]} (uncertainty-aware) vs {plain} (ppl geo-mean)":
              judge(geos[names[E]], geos[plain], paired=True)}
    verdict = conclude("mofme", experts, "seeds")
    rverdict = conclude("uncertainty-aware", router, "seeds, paired by seed")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    params = ", ".join(f"E={e} {rows[f'{names[e]} s0']['size']['params'] / 1e6:.3f}M" for e in sorted(names))
    text = "; ".join(f"E={e} {mean(geos[names[e]]):.3f}" for e in sorted(names))
    command = "python benchmarks/mofme.py" + "".join(
        f" --{k} {v}" for k, v, default in (("steps", args.steps, 30), ("batch", args.batch, 4),
                                           ("windows", args.windows, 6), ("seeds", args.seeds, 3)) if v != default) \
        + ("" if args.experts == [1, 16] else " --experts " + " ".join(map(str, args.experts)))
    record("mofme", "MoFME: more feature-modulated experts at near-constant parameters lower perplexity "
           "(upcycled zoo-tiny-dense, equal training steps)", verdict,
           f"{verdict_parts(experts)}. Mean held-out ppl geo-mean over seeds: {text}; params {params} (each expert "
           "adds 2*I FiLM numbers and a router row per layer). The control is E=1: the same shared FFN under one "
           "trained FiLM, the same optimiser groups, steps and batches; the arms differ in shape, so the seeds are "
           f"independent (noise: the larger arm's spread). {settings}. {SCOPE}.", numbers, command, "zoo-tiny-dense",
           judgements=experts)
    record("uncertainty-aware", "MoFME's uncertainty-aware router beats a plain linear top-k softmax router over "
           "the same FiLM experts, at equal steps", rverdict,
           f"{verdict_parts(router)}: ppl geo-mean {mean(geos[names[E]]):.3f} vs {mean(geos[plain]):.3f}. Same "
           "initial router rows and batches per seed (paired by seed; noise: the spread of the per-seed "
           f"differences). {settings}. {SCOPE}.", numbers, command, "zoo-tiny-dense", judgements=router)


if __name__ == "__main__":
    main()
