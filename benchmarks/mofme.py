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
``zoo.evaluation.eval`` on held-out windows (fp32, routers in eval mode). A difference under ``TIE`` (0.5%) counts as none.

    python benchmarks/mofme.py --steps 30 --batch 4 --windows 6     # the recorded run (a few CPU minutes)
    python benchmarks/mofme.py --steps 2 --windows 2 --no-record     # smoke
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from upcycle import measure, table  # noqa: E402  (the upcycle claims' measurement and table)

import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokenizer import load_tokenizer  # noqa: E402
from zoo.data.tokens import token_stream, train_batch  # noqa: E402
from zoo.moe.layout import moe_layers, set_block, sync_layout  # noqa: E402
from zoo.training.train import TrainConfig, lr_at  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

SCOPE = ("Scope: a short continued-training run of an upcycled, already trained dense model; the paper trains MoFME "
         "from scratch to convergence (image restoration), where the experts have the whole run to specialise")
TIE = 0.005  # relative perplexity difference below which two arms count as equal (run-to-run noise of this size)


def better(a: float, b: float) -> bool:
    """``a`` beats ``b`` by more than the tie margin."""
    return a < b * (1 - TIE)


def verdict_of(wins: list[bool]) -> str:
    return "holds" if all(wins) else "does not hold" if not any(wins) else "holds in part"


def continue_training(model, args, streams, label: str) -> dict:
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
        batch = train_batch(streams, step, args.batch, args.seq_len, seed=args.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-4, help="the shared FFNs, attention, norms, embeddings")
    p.add_argument("--film-lr", type=float, default=1e-2, help="the FiLM vectors and the routers")
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

    settings = (f"N={args.steps} steps of {args.batch}x{args.seq_len} tokens, lr {args.lr} (FiLM vectors and routers "
                f"{args.film_lr}; warm-up {args.warmup}, cosine to 10%), router rows N(0, initializer_range^2), "
                f"uncertainty-aware router 4 MC samples at dropout 0.1 in training, {args.windows} held-out windows "
                f"per domain, "
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
    wins = [better(ppl(names[b])[d], ppl(names[a])[d]) for a, b in steps for d in DOMAINS]
    verdict = verdict_of(wins)
    params = ", ".join(f"E={e} {rows[names[e]]['size']['params'] / 1e6:.3f}M" for e in order)
    text = "; ".join(f"E={e}: " + ", ".join(f"{d} {ppl(names[e])[d]:.2f}" for d in DOMAINS) for e in order)
    summary = (f"held-out ppl {text}; params {params} (each expert adds 2*I FiLM numbers and a router row per "
               f"layer); a larger E counts as better only when its ppl is lower by more than {TIE:.1%}. {settings}. "
               f"{SCOPE}.")
    # router claim: uncertainty-aware vs plain softmax at E experts
    u, s = ppl(names[E]), ppl(plain)
    rverdict = verdict_of([better(u[d], s[d]) for d in DOMAINS])
    rtext = ", ".join(f"{d} ppl {u[d]:.2f} vs {s[d]:.2f} ({(u[d] / s[d] - 1) * 100:+.1f}%)" for d in DOMAINS)
    print(f"mofme: {verdict} ({text})")
    print(f"uncertainty-aware: {rverdict} ({rtext})")
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    command = (f"python benchmarks/mofme.py --steps {args.steps} --batch {args.batch} --windows {args.windows} "
               f"--lr {args.lr} --film-lr {args.film_lr} --experts {' '.join(map(str, args.experts))}")
    record("mofme", "MoFME: more feature-modulated experts at near-constant parameters lower perplexity "
           "(upcycled zoo-tiny-dense, equal training steps)", verdict, summary, numbers, command, "zoo-tiny-dense")
    record("uncertainty-aware", "MoFME's uncertainty-aware router beats a plain linear top-k softmax router over "
           "the same FiLM experts, at equal steps", rverdict,
           f"{names[E]} vs {plain}: {rtext} (better only by more than {TIE:.1%}). Same initial router rows, same "
           f"batches. {settings}. {SCOPE}.", numbers, command,
           "zoo-tiny-dense")


if __name__ == "__main__":
    main()
