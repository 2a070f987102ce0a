"""The dense-to-MoE adapters' claims, each against the dense control trained the same N more steps:

* upcycle (Sparse Upcycling): the upcycled zoo-tiny-dense, trained N more steps, beats the dense model trained
  the same N more steps (claim 3 of issue #7);
* moefy (Dynamic-DINO): the granularity-decomposed model (8 experts of I/2, top-2: the dense active parameters,
  lossless at init) trained N more steps beats the dense model trained N more steps;
* ewa (Experts Weights Averaging): an MoE of 4 copies trained N steps with random-partition routing and EWA
  (beta 0.1), then collapsed to one FFN per layer (the dense model's size and cost), beats the dense model
  trained N more steps.

Every arm starts from the shipped zoo-tiny-dense (Mistral, 6.0M params) and trains with the same lr schedule
(warm-up, cosine to 10%), AdamW, bf16 autocast and gradient clipping as ``zoo.training.train``; the MoE arms add the
load-balancing loss (coefficient 0.01, as the zoo's own MoE was trained). Each arm is trained from each of ``--seeds``
seeds: repeat s draws the batches with data seed s + 1 (the train split; the base was trained with seed 0) and seeds
the adapters' random parts (routers, EWA's partitions) with s, so all arms of a seed start from the same dense
weights and see the same batches: each claim is judged paired by seed (``zoo.evaluation.claims.judge``). The measure
is the geometric mean over domains of the held-out perplexity (``zoo.evaluation.eval``, fp32, the same windows for
every model).

    python benchmarks/upcycle.py                  # N=12 steps of 4 x 256 tokens, 3 seeds (about 4 min, one thread)
    python benchmarks/upcycle.py --no-record      # print only
    python benchmarks/upcycle.py --quick          # 2 seeds x 1 step of 2 x 64 tokens; records nothing
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, geo, seed_args, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS, load_text  # noqa: E402
from zoo.data.tokenizer import load_tokenizer  # noqa: E402
from zoo.data.tokens import token_stream, train_batch  # noqa: E402
from zoo.evaluation.eval import perplexity_and_usage, sizes  # noqa: E402
from zoo.training.precision import training_autocast  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402
from zoo.training.train import TrainConfig, lr_at  # noqa: E402

UNIT = "seeds, paired by seed"
SETTINGS = ("steps", "batch", "seq_len", "lr", "warmup", "experts", "top_k", "gate", "windows", "ewa_beta", "seeds")
# what the papers trained, for the summaries (our runs are a few dozen steps of continued training)
BUDGETS = {
    "upcycle": "the paper continues T5 and ViT checkpoints with an extra budget of up to about 50% of their dense "
               "pretraining cost (its abstract)",
    "moefy": "the paper tunes an open-vocabulary detector on large detection datasets for full training schedules",
    "ewa": "the paper trains vision transformers with EWA over full training schedules (from scratch and fine-tuning)",
}


def train_streams(tokenizer, quick: bool = False) -> dict:
    """{domain: the train split's token ids}; ``quick``: its first 100k characters only (tokenizing the whole split
    takes ~10 s)."""
    if not quick:
        return {d: token_stream(d, "train", tokenizer) for d in DOMAINS}
    return {d: torch.tensor(tokenizer(load_text(d, "train")[:100_000])["input_ids"], dtype=torch.int32)
            for d in DOMAINS}


def continue_training(model, args, streams, label: str, data_seed: int, setup=None) -> dict:
    """``args.steps`` more steps of ``zoo.training.train``'s loop on the batches of ``data_seed``; returns seconds
    and the mean LM loss of the last 20. ``setup(optimizer)``: installs training-time hooks (EWA), returns a handle."""
    cfg = TrainConfig(lr=args.lr, warmup=args.warmup, steps=args.steps, min_lr_ratio=0.1)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    moe = bool(moe_layers(model))
    handle = setup(opt) if setup is not None else None
    model.train()
    losses, start = [], time.perf_counter()
    for step in tqdm(range(args.steps), desc=label):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        ids = train_batch(streams, step, args.batch, args.seq_len, seed=data_seed)
        with training_autocast():
            out = model(input_ids=ids, labels=ids, output_router_logits=moe)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = model.config.router_aux_loss_coef * out.aux_loss.item() if moe else 0.0
        losses.append(out.loss.item() - aux)
    model.eval()
    if handle is not None:
        handle.remove()
    tail = losses[-20:]
    return {"seconds": time.perf_counter() - start, "train_loss": sum(tail) / len(tail)}


def measure(model, tokenizer, args) -> dict:
    ppl, usage = perplexity_and_usage(model, tokenizer, seq_len=args.seq_len, max_windows=args.windows)
    ent = {d: (sum(u["entropy_bits"] for u in usage[d]) / len(usage[d])) if usage[d] else None for d in DOMAINS}
    return {"ppl": ppl, "size": sizes(model), "entropy": ent}


def table(rows: dict[str, dict]) -> str:
    head = ["model"] + [f"ppl {d}" for d in DOMAINS] + ["params (M)", "active (M)", "train loss", "train s",
                                                         "routing entropy (bits)"]
    lines = ["  ".join(f"{h:>12}" if i else f"{h:<22}" for i, h in enumerate(head))]
    for name, r in rows.items():
        ent = r["entropy"]
        cells = [f"{r['ppl'][d]:.2f}" for d in DOMAINS]
        cells += [f"{r['size']['params'] / 1e6:.2f}", f"{r['size']['active_params'] / 1e6:.2f}",
                  f"{r['train_loss']:.3f}" if "train_loss" in r else "-",
                  f"{r['seconds']:.0f}" if "seconds" in r else "-",
                  "/".join(f"{ent[d]:.2f}" for d in DOMAINS) if ent[DOMAINS[0]] is not None else "-"]
        lines.append(f"{name:<22}  " + "  ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def summary_rows(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per arm: per-domain perplexity and geo-mean (means over its seeds), the geo-mean of each seed."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    out = []
    for name, rs in runs.items():
        row = {"model": name, **{f"ppl {d}": round(mean([r["ppl"][d] for r in rs]), 3) for d in DOMAINS},
               "geo-mean": round(mean([geo(r["ppl"]) for r in rs]), 3),
               "geo-mean by seed": "/".join(f"{geo(r['ppl']):.3f}" for r in rs),
               "params (M)": round(rs[0]["size"]["params"] / 1e6, 3),
               "active (M)": round(rs[0]["size"]["active_params"] / 1e6, 3)}
        if "train_loss" in rs[0]:
            row["train loss"] = round(mean([r["train_loss"] for r in rs]), 3)
        out.append(row)
    return out


def arms(args, seed: int) -> dict:
    """{name: (build() -> model, training setup or None, after training or None)} of the mechanism arms of repeat
    ``seed``; the arms without an after-training step start as the dense model (lossless at init)."""
    from zoo_adapters.ewa import Ewa

    def dense():
        return zoo.load("zoo-tiny-dense", dtype=torch.float32).eval()

    def ewa():
        return zoo.apply(zoo.apply(dense(), "upcycle", num_experts=4, top_k=1, seed=seed), "ewa",
                         beta=args.ewa_beta, seed=seed)

    return {
        f"upcycled {args.experts}x top-{args.top_k}": (
            lambda: zoo.apply(dense(), "upcycle", num_experts=args.experts, top_k=args.top_k, gate=args.gate,
                              seed=seed), None, None),
        "moefy 8 of I/2 top-2": (lambda: zoo.apply(dense(), "moefy", num_experts=8, top_k=2, seed=seed), None, None),
        "ewa 4 experts, collapsed": (ewa, lambda model: lambda opt: Ewa.from_model(model).register(opt, model),
                                     lambda model: zoo.apply(model, "ewa", collapse=True)),
    }


def main(argv=None):
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--gate", default="random", choices=("random", "hidden"))
    p.add_argument("--windows", type=int, default=8, help="held-out windows of seq-len tokens per domain")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ewa-beta", type=float, default=0.1)
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
    from zoo.evaluation.claims import judge, same_weights

    base = zoo.load("zoo-tiny-dense", dtype=torch.float32).eval()
    printed = {"base (zoo-tiny-dense)": measure(base, tokenizer, args)}
    del base
    dense_name = f"dense +{args.steps}"
    runs, same = {dense_name: []}, {}
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        control = zoo.load("zoo-tiny-dense", dtype=torch.float32).eval()
        trained = continue_training(control, args, streams, f"{dense_name} s{seed}", seed + 1)
        runs[dense_name].append({**measure(control, tokenizer, args), **trained})
        printed[f"{dense_name} s{seed}"] = runs[dense_name][-1]
        for name, (build, setup, after) in arms(args, seed).items():
            torch.manual_seed(seed)
            model = build()
            if seed == 0 and after is None:  # lossless at init: the dense model's perplexity
                printed[f"{name}, at init"] = measure(model, tokenizer, args)
            trained = continue_training(model, args, streams, f"{name} +{args.steps} s{seed}", seed + 1,
                                        setup(model) if setup else None)
            if after is not None:
                after(model)
            label = f"{name} +{args.steps}"
            runs.setdefault(label, []).append({**measure(model, tokenizer, args), **trained})
            printed[f"{label} s{seed}"] = runs[label][-1]
            same.setdefault(label, []).append(same_weights(model, control))
            del model
        del control
    settings = (f"N={args.steps} steps of {args.batch}x{args.seq_len} tokens from zoo-tiny-dense, lr {args.lr} "
                f"(warm-up {args.warmup}, cosine to 10%), gate={args.gate}, seeds {', '.join(map(str, range(args.seeds)))} "
                f"(data seed s + 1, adapters seeded with s: all arms of a seed see the same batches), {args.windows} "
                f"held-out windows of {args.seq_len} tokens per domain, {torch.get_num_threads()} thread(s)")
    print(f"\n{settings}\n")
    print(table(printed))
    rows = [{"model": "base (zoo-tiny-dense)", **{f"ppl {d}": round(printed['base (zoo-tiny-dense)']['ppl'][d], 3)
                                                  for d in DOMAINS},
             "geo-mean": round(geo(printed["base (zoo-tiny-dense)"]["ppl"]), 3)}] + summary_rows(runs)
    print()
    show(rows)

    def part(label: str) -> dict:
        judged = judge([geo(r["ppl"]) for r in runs[label]], [geo(r["ppl"]) for r in runs[dense_name]],
                       paired=True, same_model=all(same[label]),
                       why_same="training left the arm bit-identical to the dense control" if all(same[label]) else "")
        return {f"{label} vs {dense_name}, held-out geo-mean ppl": judged}

    up, fy, ew = (f"{name} +{args.steps}" for name in arms(args, 0))
    claims = [
        ("upcycle", "Sparse Upcycling: the upcycled dense model trained N more steps beats the dense model trained the "
         "same N more steps", up, f"{args.experts} copies top-{args.top_k}, so {args.top_k}x the dense FFN compute per "
         "token"),
        ("moefy", "Dynamic-DINO: the granularity-decomposed MoE (lossless at init) tuned N steps beats the dense model "
         "tuned N steps at equal active parameters", fy,
         "8 experts of I/2, top-2, grouped init (the paper's); at init it is the dense model"),
        ("ewa", "EWA: training as an MoE (random-partition routing, experts weights averaging) then averaging back to "
         "one FFN beats plain training of the dense model, at the same inference cost", ew,
         f"upcycled to 4 copies, beta {args.ewa_beta}, collapsed after training"),
    ]
    print()
    judged = [(component, claim, label, note, part(label)) for component, claim, label, note in claims]
    verdicts = [conclude(f"{component}: {claim}", parts, UNIT) for component, claim, _, _, parts in judged]
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    base_geo = rows[0]["geo-mean"]
    means = {r["model"]: r["geo-mean"] for r in rows}
    caveat = (f" Every trained arm ends above the untrained base (geo-mean ppl {base_geo}): {args.steps} steps at a "
              f"re-warmed lr {args.lr} measure the early transient of continued training, not a converged comparison."
              if all(means[label] > base_geo for label in runs) else "")
    command = "python benchmarks/upcycle.py" + "".join(
        f" --{dest.replace('_', '-')} {getattr(args, dest)}" for dest in SETTINGS
        if getattr(args, dest) != p.get_default(dest))
    for (component, claim, label, note, parts), verdict in zip(judged, verdicts):
        j = next(iter(parts.values()))
        summary = (f"{verdict_parts(parts)}: geo-mean held-out ppl {j['mechanism']:.3f} vs {j['control']:.3f} for "
                   f"{dense_name} (margin {j['margin']:+.3f}, noise {j['noise']:.3f} over {j['repeats']} {UNIT}). "
                   f"{note}. Settings: {settings}.{caveat} Scale: {BUDGETS[component]}; this run is "
                   f"{args.steps * args.batch * args.seq_len} tokens.")
        record(component, claim, verdict, summary, rows, command, "zoo-tiny-dense", judgements=parts)
    print("recorded: docs/claims/upcycle.json, moefy.json, ewa.json")


if __name__ == "__main__":
    main()
