"""RoMA's claim on zoo-tiny-moe: routers tuned with the manifold regulariser beat routers tuned without it
(lam = 0, plain router-only fine-tuning), at equal steps and lr, on held-out data.

Every arm: the same model, everything but the routers frozen (``zoo.apply(model, "roma", ...)``), random windows
of both domains' train split (half each: the paper trains on a mixture of tasks), the schedule of
``zoo.training.finetune`` (AdamW, warm-up then cosine, clip 1.0), trained on ``Roma.loss``; only ``lam`` differs.
Each arm runs from each of ``--seeds`` seeds; seed s draws the batches (``train_batch(seed=s)``) and RoMA's pool of
neighbours (``Roma(seed=s)``), and the routers start from the model's own, so both arms of a seed start from the
same weights and see the same batches: judged paired by seed (``zoo.evaluation.claims.judge``). The measure is the
geometric mean over domains of the held-out perplexity, on consecutive windows of each domain's val split and,
as a second part, of its ood split (text of other origins, never trained on); next-token accuracy is shown beside.

    python benchmarks/roma.py                        # 3 seeds x 2 arms x 40 steps (a few minutes on one thread)
    python benchmarks/roma.py --quick                # 2 seeds x 2 steps, tiny pool; records nothing
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, geo, seed_args, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokens import eval_windows, token_stream, train_batch  # noqa: E402
from zoo.evaluation.claims import judge, same_weights  # noqa: E402
from zoo.io.loading import tokenizer_for  # noqa: E402
from zoo.training.finetune import lr_at  # noqa: E402
from zoo_adapters.roma import Roma  # noqa: E402
from zoo_adapters.roma_manifold import next_token_accuracy  # noqa: E402

CLAIM = ("routers fine-tuned with the manifold regulariser (successful neighbours in a task-embedding space) beat "
         "routers fine-tuned without it, at equal steps (RoMA)")
SPLITS = ("val", "ood")


@torch.no_grad()
def held_out(model, tokenizer, seq_len: int, windows: int) -> dict:
    """{split: {domain: (accuracy, perplexity)}} on consecutive windows of the val and ood splits."""
    model.eval()
    out = {}
    for split in SPLITS:
        out[split] = {}
        for d in DOMAINS:
            ids = eval_windows(token_stream(d, split, tokenizer), seq_len, windows)
            nll, acc = [], []
            for batch in ids.split(8):
                logits = model(input_ids=batch).logits.float()
                nll.append(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                             reduction="none").view(len(batch), -1).mean(1))
                acc.append(next_token_accuracy(logits, batch))
            out[split][d] = (float(torch.cat(acc).mean()), math.exp(float(torch.cat(nll).mean())))
    return out


def arm(args, base, lam: float, seed: int, tokenizer):
    """One arm from one seed: (the tuned model, its row, {split: geo-mean perplexity})."""
    options = {"lam": lam, "k": args.k, "pool": args.pool, "embedding": args.embedding, "seed": seed}
    model = zoo.apply(copy.deepcopy(base), "roma", **options)
    roma = Roma(**options)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    streams = {d: token_stream(d, "train", tokenizer) for d in DOMAINS}
    bank = roma.bank(model)  # the pool, recorded before the first step (as the first loss call would)
    t0, lm_tail, pen_tail = time.perf_counter(), [], []
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(args.lr, step, args.steps)
        loss, lm = roma.loss(model, train_batch(streams, step, args.batch, args.seq_len, seed))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.steps - 10:
            lm_tail.append(lm.item())
            pen_tail.append(float(roma.last_penalty) if roma.last_penalty is not None else float("nan"))
    seconds = time.perf_counter() - t0
    after = held_out(model, tokenizer, args.seq_len, args.windows)
    row = {"arm": f"lam={lam:g}", "seed": seed, "trainable params": sum(p.numel() for p in params)}
    for split in SPLITS:
        for d, (acc, ppl) in after[split].items():
            row[f"acc {split} {d}"] = round(100 * acc, 2)
            row[f"ppl {split} {d}"] = round(ppl, 3)
        row[f"ppl {split} geo-mean"] = round(geo({d: p for d, (_, p) in after[split].items()}), 4)
    row["train LM loss last 10"] = round(sum(lm_tail) / len(lm_tail), 4)
    if lam:
        row["penalty last 10"] = round(sum(pen_tail) / len(pen_tail), 4)
    row["successful in pool"] = f"{bank.summary()['successful']} of {bank.summary()['pool']}"
    row["seconds"] = round(seconds)
    print(row, flush=True)
    return model, row, {split: geo({d: p for d, (_, p) in after[split].items()}) for split in SPLITS}


def main(argv=None):
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--lam", type=float, default=1.0, help="the regulariser's weight (the control is lam=0)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.01, help="the same for both arms (router-only tuning barely "
                                                            "moves at 1e-3 in tens of steps)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--pool", type=int, default=64)
    ap.add_argument("--embedding", default="wordllama")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of seq-len tokens per split and domain")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    args = seed_args(ap).parse_args(argv)
    if args.quick:  # the whole path at a tiny budget: 2 seeds x 2 steps, a pool of 8, 2 windows; records nothing
        args.seeds, args.steps, args.batch, args.seq_len = min(args.seeds, 2), 2, 2, 64
        args.pool, args.k, args.windows, args.no_record = 8, 3, 2, True
    if args.seeds < 2:
        ap.error("--seeds must be at least 2: one run has no noise to compare against")
    if args.lam <= 0:
        ap.error("--lam must be positive: lam=0 is the control")
    torch.set_num_threads(args.threads)
    base = zoo.load(args.model, dtype=torch.float32)
    tokenizer = tokenizer_for(base, required=True)
    rows, measures, same = [], {lam: {s: [] for s in SPLITS} for lam in (args.lam, 0.0)}, []
    for seed in range(args.seeds):
        models = {}
        for lam in (args.lam, 0.0):
            models[lam], row, per_split = arm(args, base, lam, seed, tokenizer)
            rows.append(row)
            for split in SPLITS:
                measures[lam][split].append(per_split[split])
        same.append(same_weights(models[args.lam], models[0.0]))
        del models
    show(rows)
    why = "the regulariser did not change the routers at this budget"
    judgements = {f"{split} perplexity (geo-mean over domains), lam={args.lam:g} vs lam=0": judge(
        measures[args.lam][split], measures[0.0][split], paired=True, same_model=all(same),
        why_same=why if all(same) else "") for split in SPLITS}
    verdict = conclude("RoMA", judgements, "seeds, paired by seed")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    summary = (f"{verdict_parts(judgements)}. Settings: {args.model}, {args.steps} steps of {args.batch}x{args.seq_len} "
               f"tokens (both domains' train split, half each), lr {args.lr:g} for both arms, routers only "
               f"({rows[0]['trainable params']:,} parameters), lam={args.lam:g} against lam=0; seeds "
               f"{', '.join(map(str, range(args.seeds)))} (seed s draws the batches and the pool; both arms of a "
               f"seed start from the same routers: paired by seed); pool {args.pool} windows per domain, successful "
               f"= top half by next-token accuracy, k={args.k}, embedding {args.embedding}; held out: {args.windows} "
               f"windows of {args.seq_len} tokens per split (val, ood) and domain; one thread. Measure: geometric "
               "mean over domains of the perplexity (accuracy shown beside). A tiny model and minutes of router "
               "tuning: the paper tunes OLMoE/DeepSeekMoE/Qwen3-MoE routers on multiple-choice tasks and scores "
               "downstream accuracy.")
    command = "python benchmarks/roma.py" + "".join(
        f" --{k} {v:g}" if isinstance(v, float) else f" --{k} {v}"
        for k, v, default in (("lam", args.lam, 1.0), ("steps", args.steps, 40), ("lr", args.lr, 0.01),
                              ("pool", args.pool, 64), ("windows", args.windows, 16), ("seeds", args.seeds, 3))
        if v != default)
    print(record("roma", CLAIM, verdict, summary, rows, command, args.model, judgements=judgements))


if __name__ == "__main__":
    main()
