"""Adapters' paper claims on zoo-tiny-moe, measured with short ``zoo.training.finetune`` runs on one thread and recorded
with zoo.evaluation.claims (``docs/claims/<component>.json``). Every arm: same model, same code-domain batches, same
schedule (``zoo.training.finetune``), held-out perplexity of both domains before and after.

- ``mixture-of-loras``: MoLoRA's claim (a mixture of LoRAs, softly merged, beats a single LoRA at a comparable
  parameter budget): N=4 LoRAs of rank 4, all four active (MoLoRA's soft merging: learned softmax over all),
  against one LoRA of rank 16 (the same trainable LoRA parameters) and one of rank 4;
- ``replora``: RepLoRA's claim (reparameterised factors learn faster than LoRA's: better at equal steps) against
  one LoRA of the same rank on the same layers, at two step counts;
- ``lora-experts``: LoRA's claim (close to full fine-tuning at a small fraction of the trainable parameters) on
  the experts: LoRA rank 8 on every expert against fine-tuning the experts' full weights.

    python benchmarks/claims_adapters.py --component replora       # a few minutes on one thread
    python benchmarks/claims_adapters.py --component all
"""
from __future__ import annotations

import argparse
import time

import torch

import zoo
from zoo.evaluation.claims import record
from zoo.data.corpus import DOMAINS
from zoo.data.tokens import token_stream, train_batch
from zoo.training.finetune import finetune, held_out, lr_at
from zoo.moe.layout import moe_layers

from claim_args import show  # noqa: E402

MODEL = "zoo-tiny-moe"
SINGLE_LORA = {"num_loras": 1, "top_k": 1, "router": "learned"}  # one LoRA: a one-way softmax weighs it 1


def arm(args, label: str, adapter: str, options: dict, steps: int | None = None, lr: float | None = None) -> dict:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    res = finetune(zoo.load(MODEL, dtype=torch.float32), adapter, options, domain=args.domain,
                   steps=steps or args.steps, lr=lr or args.lr, batch_size=args.batch, seq_len=args.seq_len,
                   windows=args.windows, progress=False)
    out = {"arm": label, "steps": steps or args.steps, "trainable params": res.trainable_params}
    for d in DOMAINS:
        out[f"ppl {d} before"] = res.before["perplexity"][d]
        out[f"ppl {d} after"] = round(res.after["perplexity"][d], 2)
    tail = [loss for _, loss in res.history[-10:]]
    out["train loss last 10"] = round(sum(tail) / len(tail), 4)
    out["seconds"] = round(time.perf_counter() - t0)
    print(out, flush=True)
    return out


def full_experts(args, label: str) -> dict:
    """Fine-tune every expert weight (nothing else), as zoo.training.finetune would train an adapter."""
    torch.manual_seed(0)
    model = zoo.load(MODEL, dtype=torch.float32)
    tok = zoo.load_tokenizer(MODEL)
    before = held_out(model, tok, args.seq_len, args.windows)["perplexity"]
    model.requires_grad_(False)
    for _, m in moe_layers(model):
        m.experts.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.full_lr, weight_decay=0.0)
    stream = token_stream(args.domain, "train", tok)
    streams = {d: stream for d in DOMAINS}
    history, t0 = [], time.perf_counter()
    model.train()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(args.full_lr, step, args.steps)
        ids = train_batch(streams, step, args.batch, args.seq_len, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(loss.item())
    model.eval()
    after = held_out(model, tok, args.seq_len, args.windows)["perplexity"]
    out = {"arm": label, "steps": args.steps, "trainable params": sum(p.numel() for p in params)}
    for d in DOMAINS:
        out[f"ppl {d} before"] = before[d]
        out[f"ppl {d} after"] = round(after[d], 2)
    out["train loss last 10"] = round(sum(history[-10:]) / len(history[-10:]), 4)
    out["seconds"] = round(time.perf_counter() - t0)
    print(out, flush=True)
    return out


def settings(args, steps=None) -> str:
    return (f"{steps or args.steps} steps x {args.batch} x {args.seq_len} {args.domain} tokens (zoo.training.finetune's schedule, "
            f"bf16 autocast), {args.windows} held-out windows x {args.seq_len} tokens per domain, one thread")


def command(args, component: str) -> str:
    return (f"python benchmarks/claims_adapters.py --component {component} --steps {args.steps} --batch {args.batch} "
            f"--windows {args.windows}")


def mixture_of_loras(args) -> None:
    rows = [arm(args, "MoLoRA: 4 LoRAs r=4, soft (all 4 active)", "mixture-of-loras",
                {"num_loras": 4, "r": 4, "alpha": 8.0, "top_k": 4, "router": "learned"}),
            arm(args, "one LoRA r=16 (same LoRA parameters)", "mixture-of-loras", {**SINGLE_LORA, "r": 16,
                                                                                   "alpha": 32.0}),
            arm(args, "one LoRA r=4", "mixture-of-loras", {**SINGLE_LORA, "r": 4, "alpha": 8.0})]
    show(rows)
    d = args.domain
    mix, same, small = (r[f"ppl {d} after"] for r in rows)
    verdict = ("holds" if mix < same and mix < small else "holds in part" if mix < same or mix < small
               else "does not hold")
    record("mixture-of-loras", "a mixture of LoRAs beats a single LoRA at a comparable parameter budget (MoLoRA)",
           verdict, f"{settings(args)}; lr {args.lr}; LoRAs on q/k/v/o; alpha = 2r. {d} perplexity after: mixture "
           f"{mix}, one LoRA of rank 16 (same parameters) {same}, one of rank 4 {small}. The paper fine-tunes T5 on "
           "instructions for far longer.", rows, command(args, "mixture-of-loras"), MODEL)


def replora(args) -> None:
    rows = []
    for steps in (args.steps // 2, args.steps):
        rows.append(arm(args, "RepLoRA r=8 (MLP hidden 64)", "replora", {"r": 8, "alpha": 16.0}, steps=steps,
                        lr=args.replora_lr))
        rows.append(arm(args, "LoRA r=8", "mixture-of-loras", {**SINGLE_LORA, "r": 8, "alpha": 16.0}, steps=steps))
    show(rows)
    d = args.domain
    wins = [rows[i][f"ppl {d} after"] < rows[i + 1][f"ppl {d} after"] for i in (0, 2)]
    verdict = "holds" if all(wins) else "holds in part" if any(wins) else "does not hold"
    record("replora", "reparameterising LoRA's factors through a shared MLP makes them learn faster: better than "
           "LoRA at equal steps (RepLoRA)", verdict,
           f"{settings(args)} and half as many steps; q/k/v/o, rank 8 both; lr RepLoRA {args.replora_lr} (its card: "
           f"lower suits it), LoRA {args.lr}. {d} perplexity after, RepLoRA vs LoRA: "
           + ", ".join(f"{rows[i]['steps']} steps {rows[i][f'ppl {d} after']} vs {rows[i + 1][f'ppl {d} after']}"
                       for i in (0, 2)) + f". RepLoRA trains {rows[0]['trainable params']:,} parameters, LoRA "
           f"{rows[1]['trainable params']:,}.", rows, command(args, "replora"), MODEL)


def lora_experts(args) -> None:
    rows = [arm(args, "LoRA r=8 on every expert", "lora-experts", {"r": 8, "alpha": 16.0}),
            full_experts(args, f"full fine-tune of the experts (lr {args.full_lr})")]
    show(rows)
    d = args.domain
    lora, full = rows[0][f"ppl {d} after"], rows[1][f"ppl {d} after"]
    gain_lora, gain_full = rows[0][f"ppl {d} before"] - lora, rows[1][f"ppl {d} before"] - full
    share = rows[0]["trainable params"] / rows[1]["trainable params"]
    ratio = lora / full
    verdict = "holds" if ratio <= 1.02 else "holds in part" if gain_lora > 0.5 * gain_full else "does not hold"
    record("lora-experts", "LoRA comes close to full fine-tuning with a small fraction of the trainable parameters "
           "(LoRA)", verdict,
           f"{settings(args)}; LoRA lr {args.lr}, full fine-tune lr {args.full_lr}. {d} perplexity after: LoRA {lora} "
           f"vs full {full} (ratio {ratio:.3f}; 'close': within 2%) with {share:.1%} of the trainable parameters; "
           f"LoRA got {gain_lora:.2f} of full fine-tuning's {gain_full:.2f} perplexity gain.", rows,
           command(args, "lora-experts"), MODEL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--component", required=True, choices=("mixture-of-loras", "replora", "lora-experts", "all"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3, help="LoRA learning rate")
    ap.add_argument("--replora-lr", type=float, default=5e-4)
    ap.add_argument("--full-lr", type=float, default=2e-4)
    ap.add_argument("--domain", default="code", choices=DOMAINS)
    ap.add_argument("--windows", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {"mixture-of-loras": mixture_of_loras, "replora": replora, "lora-experts": lora_experts}
    for name, fn in runs.items():
        if args.component in (name, "all"):
            fn(args)


if __name__ == "__main__":
    main()
