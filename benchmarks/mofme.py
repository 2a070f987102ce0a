"""MoFME's claims on zoo-tiny-dense, in one run:

* mofme (experts): more FiLM experts at near-constant parameters lower perplexity. zoo-tiny-dense is upcycled
  (``upcycle`` with ``experts="mofme"``) into E = 1 (the dense control: the same FFN with one FiLM, top-1), 4
  and 16 experts (top-2), each arm trained the same N steps on the same batches; held-out perplexity and
  parameter counts side by side.
* uncertainty-aware (router): with 16 MoFME experts, the uncertainty-aware router (MC dropout, calibrated
  weights) beats the plain linear top-k softmax router with the same initial rows, at equal steps.

Every arm starts as the dense model (identity FiLM, renormalised top-k weights) and trains with
``benchmarks/upcycle.py``'s loop (``zoo.train``'s AdamW, warm-up + cosine, bf16 autocast, clipping, the
load-balancing loss at 0.01). Perplexity is ``zoo.eval`` on held-out windows (fp32, routers in eval mode).

    python benchmarks/mofme.py --steps 40 --batch 8 --windows 8     # the recorded run (a few minutes)
    python benchmarks/mofme.py --steps 2 --windows 2 --no-record     # smoke
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from upcycle import continue_training, measure, table  # noqa: E402  (the upcycle claims' loop and table)

import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokenizer import load_tokenizer  # noqa: E402
from zoo.data.tokens import token_stream  # noqa: E402
from zoo.layout import moe_layers, set_block, sync_layout  # noqa: E402


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--experts", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--windows", type=int, default=8, help="held-out windows of seq-len tokens per domain")
    p.add_argument("--seed", type=int, default=1, help="data seed (the base model was trained with seed 0)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    streams = {d: token_stream(d, "train", tokenizer) for d in DOMAINS}

    rows = {"base (zoo-tiny-dense)": measure(dense(), tokenizer, args)}
    names = {}
    for E in args.experts:
        k = min(2, E)
        torch.manual_seed(0)  # the same MC-dropout masks stream for every arm
        model = mofme(E, k)
        name = f"mofme E={E} top-{k} +{args.steps}"
        trained = continue_training(model, args, streams, name)
        rows[name] = {**measure(model, tokenizer, args), **trained}
        names[E] = name
        del model
    E = max(args.experts)
    torch.manual_seed(0)
    model = with_plain_router(mofme(E, 2))
    plain = f"mofme E={E} top-2, topk-softmax +{args.steps}"
    trained = continue_training(model, args, streams, plain)
    rows[plain] = {**measure(model, tokenizer, args), **trained}
    del model

    settings = (f"N={args.steps} steps of {args.batch}x{args.seq_len} tokens, lr {args.lr} (warm-up {args.warmup}, "
                f"cosine to 10%), router rows N(0, initializer_range^2), uncertainty-aware router 4 MC samples at "
                f"dropout 0.1 in training, {args.windows} held-out windows per domain, "
                f"{torch.get_num_threads()} thread(s)")
    print(f"\n{settings}\n")
    print(table(rows))

    numbers = [{"model": n, **{f"ppl {d}": round(r["ppl"][d], 3) for d in DOMAINS},
                "params (M)": round(r["size"]["params"] / 1e6, 4),
                "active (M)": round(r["size"]["active_params"] / 1e6, 4),
                **({"train loss": round(r["train_loss"], 3)} if "train_loss" in r else {})} for n, r in rows.items()]

    def ppl(name):
        return rows[name]["ppl"]

    # experts claim: perplexity falls as E grows (each larger E below each smaller one, per domain)
    order = sorted(names)
    steps = [(a, b) for a, b in zip(order, order[1:])]
    wins = [ppl(names[b])[d] < ppl(names[a])[d] for a, b in steps for d in DOMAINS]
    verdict = "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"
    params = ", ".join(f"E={e} {rows[names[e]]['size']['params'] / 1e6:.3f}M" for e in order)
    text = "; ".join(f"E={e}: " + ", ".join(f"{d} {ppl(names[e])[d]:.2f}" for d in DOMAINS) for e in order)
    summary = (f"held-out ppl {text}; params {params} (each expert adds 2*I FiLM numbers and a router row per "
               f"layer). {settings}.")
    # router claim: uncertainty-aware vs plain softmax at E experts
    u, s = ppl(names[E]), ppl(plain)
    rwins = [u[d] < s[d] for d in DOMAINS]
    rverdict = "holds" if all(rwins) else "does not hold" if not any(rwins) else "holds in part"
    rtext = ", ".join(f"{d} ppl {u[d]:.2f} vs {s[d]:.2f} ({(u[d] / s[d] - 1) * 100:+.1f}%)" for d in DOMAINS)
    print(f"mofme: {verdict} ({text})")
    print(f"uncertainty-aware: {rverdict} ({rtext})")
    if args.no_record:
        return
    from zoo.claims import record

    command = (f"python benchmarks/mofme.py --steps {args.steps} --batch {args.batch} --windows {args.windows} "
               f"--experts {' '.join(map(str, args.experts))}")
    record("mofme", "MoFME: more feature-modulated experts at near-constant parameters lower perplexity "
           "(upcycled zoo-tiny-dense, equal training steps)", verdict, summary, numbers, command, "zoo-tiny-dense")
    record("uncertainty-aware", "MoFME's uncertainty-aware router beats a plain linear top-k softmax router over "
           "the same FiLM experts, at equal steps", rverdict,
           f"{names[E]} vs {plain}: {rtext}. Same initial router rows, same batches. {settings}.", numbers, command,
           "zoo-tiny-dense")


if __name__ == "__main__":
    main()
