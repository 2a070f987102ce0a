"""Routers' paper claims on zoo-tiny-moe, measured in short runs on one thread and recorded with zoo.evaluation.claims.

Each ``--component`` runs its own small experiment, prints the rows side by side and records the verdict in
``docs/claims/<component>.json``:

- ``topk-softmax``: Mixtral's claim (sparse MoE beats a dense model at equal active parameters) is read from
  ``docs/claims/zoo-tiny-moe.json`` (benchmarks/own_models.py); Switch's claim (the auxiliary balance loss
  balances expert load) by re-initialising the routers and fine-tuning the whole model with and without it;
- ``sigmoid-bias``: DeepSeek-V3's auxiliary-loss-free balancing: the router swapped to sigmoid-bias, fine-tuned
  with no balancing, with the auxiliary loss, and with the selection-only bias updated by load after every step
  (``b_e += gamma * sign(mean load - load_e)``, the router's ``bias_update_speed`` and ``after_step``);
- ``token-hash``: Hash Layers' claim (fixed hash routing is competitive with learned routing): fine-tuned with
  the hash router and with the learned one for the same steps;
- ``expert-choice``: expert choice at capacity factor 2 (top-2's compute) against top-2, fine-tuned the same;
- ``scored-topk``: DeepSeek-V2's group-limited routing at inference (the best ``topk_group`` of 4 groups);
- ``steer``: experts found by contrasting code with English (``find_experts``) disabled, against random ones;
- ``sparsemixer``, ``language-conditioned``: recorded as untestable here, with the reason.

    python benchmarks/claims_routers.py --component token-hash     # a few minutes on one thread
    python benchmarks/claims_routers.py --component all
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

import zoo
from zoo.evaluation.claims import record
from zoo.data.corpus import DOMAINS
from zoo.data.tokens import token_stream, train_batch
from zoo.evaluation.eval import perplexity_and_usage
from zoo.training.finetune import lr_at
from zoo.moe.layout import moe_layers
from zoo.moe.losses import load_balancing_loss

from claim_args import show  # noqa: E402

COMPONENTS = ("topk-softmax", "sigmoid-bias", "token-hash", "expert-choice", "scored-topk", "steer", "sparsemixer",
              "language-conditioned")
MODEL = "zoo-tiny-moe"


def evaluate(model, tok, windows: int) -> dict:
    """Held-out perplexity per domain and the load of the experts: max/mean load per layer (1 = balanced) and the
    routing entropy in bits, both averaged over layers and domains."""
    ppl, usage = perplexity_and_usage(model, tok, 256, windows)
    peaks, ents = [], []
    for d in DOMAINS:
        for layer in usage[d]:
            c = torch.tensor(layer["counts"], dtype=torch.float)
            peaks.append(float(c.max() / c.mean().clamp(min=1e-9)))
            ents.append(layer["entropy_bits"])
    return {"ppl": ppl, "max/mean load": sum(peaks) / len(peaks), "entropy": sum(ents) / len(ents),
            "max entropy": usage[DOMAINS[0]][0]["max_entropy_bits"]}


def tune(model, tok, args, aux: float = 0.0) -> list[float]:
    """Fine-tune every parameter for ``args.steps`` (AdamW, zoo.training.finetune's schedule, bf16 autocast) on both
    domains; ``aux``: weight of the Switch balance loss (mean over layers). Routers with ``after_step`` get it
    after every optimizer step, as ``moe-zoo finetune`` does."""
    layers = moe_layers(model)
    seen = {}
    handles = [m.router.register_forward_hook(lambda mod, a, r, i=i: seen.__setitem__(i, r))
               for i, (_, m) in enumerate(layers)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    streams = {d: token_stream(d, "train", tok) for d in DOMAINS}
    losses = []
    model.train()
    try:
        for step in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(args.lr, step, args.steps)
            ids = train_batch(streams, step, args.batch, args.seq_len, 0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lm = model(input_ids=ids, labels=ids).loss
                loss = lm
                # routers without logits (token-hash: the table picks, balanced by construction) take no loss
                bal = [load_balancing_loss(seen[i].logits, layers[i][1].router.top_k) for i in seen
                       if seen[i].logits is not None]
                if aux and bal:
                    loss = lm + aux * torch.stack(bal).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for _, m in layers:  # the router's own per-step update (sigmoid-bias: DeepSeek-V3's bias rule)
                if callable(getattr(m.router, "after_step", None)):
                    m.router.after_step()
            losses.append(lm.item())
    finally:
        for h in handles:
            h.remove()
    model.eval()
    return losses


def row(label: str, r: dict, **extra) -> dict:
    out = {"run": label, **extra}
    for d in DOMAINS:
        out[f"ppl {d}"] = round(r["ppl"][d], 2)
    out["max/mean load"] = round(r["max/mean load"], 3)
    out["entropy bits"] = round(r["entropy"], 3)
    return out


def settings(args) -> str:
    return (f"{args.steps} steps x {args.batch} x {args.seq_len} tokens of both domains, lr {args.lr}, whole model, "
            f"bf16 autocast; {args.windows} held-out windows x 256 tokens per domain; one thread (so short a tune at "
            f"this rate raises every arm's perplexity above the shipped model's 84.12 english, 62.76 code: compare "
            f"the arms with each other)")


def command(args, component: str) -> str:
    return (f"python benchmarks/claims_routers.py --component {component} --steps {args.steps} --batch {args.batch} "
            f"--windows {args.windows}")


def fresh(args):
    torch.manual_seed(0)
    return zoo.load(MODEL, dtype=torch.float32)


# ---- claims ----------------------------------------------------------------------------------------------------

def topk_softmax(args, tok) -> None:
    src = Path(__file__).resolve().parent.parent / "docs/claims/zoo-tiny-moe.json"
    entry = json.loads(src.read_text())["claims"][0]
    print("Mixtral (from docs/claims/zoo-tiny-moe.json):")
    show(entry["numbers"])
    record("topk-softmax", "a sparse top-2 MoE matches or beats a dense model at far fewer active parameters "
           "(Mixtral)", entry["verdict"],
           "Read from docs/claims/zoo-tiny-moe.json (benchmarks/own_models.py): zoo-tiny-moe (top-2 softmax routing) "
           "against its dense control at equal active parameters and training tokens, so the comparison is at equal "
           "active, not total, parameters; the paper's is against a dense model with 5x the active parameters. "
           + entry["summary"], entry["numbers"], entry["command"], entry["model"])
    rows = []
    for label, aux in (("no balance loss", 0.0), (f"balance loss {args.aux:g}", args.aux)):
        model = fresh(args)
        for _, m in moe_layers(model):  # a fresh router: does the loss keep a new router balanced?
            torch.nn.init.normal_(m.router.weight, std=args.router_std)
        t0 = time.perf_counter()
        tune(model, tok, args, aux=aux)
        rows.append(row(label, evaluate(model, tok, args.windows), seconds=round(time.perf_counter() - t0)))
        print(rows[-1], flush=True)
    show(rows)
    no, yes = rows
    # balances: a clear (>= 5%) cut of the max/mean load, not a difference within run-to-run noise
    better = yes["max/mean load"] <= 0.95 * no["max/mean load"] and yes["entropy bits"] > no["entropy bits"]
    cost = max(yes[f"ppl {d}"] / no[f"ppl {d}"] for d in DOMAINS)
    verdict = "holds" if better and cost <= 1.02 else "holds in part" if better else "does not hold"
    record("topk-softmax", "the auxiliary load-balancing loss balances expert load (Switch Transformers)", verdict,
           f"Routers re-initialised (normal, std {args.router_std}), then {settings(args)}; with the Switch loss "
           f"(weight {args.aux:g}, mean over layers) max/mean load {yes['max/mean load']} vs {no['max/mean load']} "
           f"without, routing entropy {yes['entropy bits']} vs {no['entropy bits']} bits (max 3); perplexity with the "
           f"loss at most {cost:.3f} x without ('balances': max/mean load at least 5% lower).", rows,
           command(args, "topk-softmax"), MODEL)


def sigmoid_bias(args, tok) -> None:
    rows = []
    for label, aux, gamma in (("no balancing", 0.0, 0.0), (f"aux loss {args.aux:g}", args.aux, 0.0),
                              (f"bias update gamma {args.gamma:g}", 0.0, args.gamma)):
        model = zoo.apply(fresh(args), "sigmoid-bias", **({"bias_update_speed": gamma} if gamma else {}))
        t0 = time.perf_counter()
        tune(model, tok, args, aux=aux)
        rows.append(row(label, evaluate(model, tok, args.windows), seconds=round(time.perf_counter() - t0)))
        print(rows[-1], flush=True)
    show(rows)
    none, aux, free = rows
    balances = free["max/mean load"] < none["max/mean load"]
    quality = all(free[f"ppl {d}"] <= aux[f"ppl {d}"] for d in DOMAINS)
    verdict = "holds" if balances and quality else "holds in part" if balances or quality else "does not hold"
    record("sigmoid-bias", "auxiliary-loss-free balancing (a selection-only bias updated by load) balances load "
           "without the auxiliary loss's cost in quality (DeepSeek-V3)", verdict,
           f"zoo-tiny-moe's routers swapped to sigmoid-bias (its trained gate kept), then {settings(args)}. The router's "
           f"own update rule, b_e += gamma * sign(mean load - load_e) after every step (bias_update_speed gamma "
           f"{args.gamma:g}, larger than the paper's 0.001 for a short run). "
           f"max/mean load: bias {free['max/mean load']}, aux loss {aux['max/mean load']}, none "
           f"{none['max/mean load']}; perplexity bias vs aux: "
           + ", ".join(f"{d} {free[f'ppl {d}']} vs {aux[f'ppl {d}']}" for d in DOMAINS) + ".",
           rows, command(args, "sigmoid-bias"), MODEL)


def versus_learned(args, tok, component: str, options: dict, claim: str, what: str) -> None:
    rows = []
    for label, name in (("learned top-2 (as shipped)", None), (f"{component} {options or ''}".strip(), component)):
        model = fresh(args)
        if name:
            model = zoo.apply(model, name, **options)
        before = evaluate(model, tok, args.windows)
        rows.append(row(label + " before tuning", before))
        t0 = time.perf_counter()
        tune(model, tok, args, aux=args.aux)
        rows.append(row(label + " after tuning", evaluate(model, tok, args.windows),
                        seconds=round(time.perf_counter() - t0)))
        print(rows[-2:], flush=True)
    show(rows)
    learned, new = rows[1], rows[3]
    ratio = {d: new[f"ppl {d}"] / learned[f"ppl {d}"] for d in DOMAINS}
    worst = max(ratio.values())
    verdict = ("holds" if worst <= 1.0 + args.tolerance else
               "holds in part" if min(ratio.values()) <= 1.0 + args.tolerance else "does not hold")
    record(component, claim, verdict,
           f"{what} Both fine-tuned the same ({settings(args)}, Switch loss {args.aux:g}); after tuning {component} "
           f"has " + ", ".join(f"{d} perplexity {ratio[d]:.3f} x" for d in DOMAINS) + " the learned router's "
           f"('competitive': within {args.tolerance:.0%}). The experts were trained under the learned router, so the "
           "swap starts behind; the paper trains from scratch.", rows, command(args, component), MODEL)


def scored_topk(args, tok) -> None:
    base = fresh(args).eval()
    ref = evaluate(base, tok, args.windows)
    rows = [row("top-2 of 8, no group limit (as shipped)", ref)]
    for m in (1, 2, 3):
        model = zoo.apply(copy.deepcopy(base), "scored-topk", n_group=4, topk_group=m)
        rows.append(row(f"best {m} of 4 groups of 2 experts", evaluate(model, tok, args.windows)))
        print(rows[-1], flush=True)
    show(rows)
    ratio = {r["run"]: max(r[f"ppl {d}"] / rows[0][f"ppl {d}"] for d in DOMAINS) for r in rows[1:]}
    three = ratio["best 3 of 4 groups of 2 experts"]
    verdict = "holds" if three <= 1.0 + args.tolerance else "holds in part" if three <= 1.05 else "does not hold"
    record("scored-topk", "group-limited routing (experts from the best M groups only) costs little quality once "
           "M >= 3 (DeepSeek-V2's device-limited routing)", verdict,
           f"Applied at inference to zoo-tiny-moe (trained without group limits; DeepSeek-V2 trains with them): "
           f"{args.windows} held-out windows x 256 tokens per domain. Worst-domain perplexity ratio to unrestricted "
           "top-2: " + ", ".join(f"{k.split(' groups')[0]}: {v:.3f}" for k, v in ratio.items())
           + f" ('little': within {args.tolerance:.0%}).", rows, f"python benchmarks/claims_routers.py --component "
           f"scored-topk --windows {args.windows}", MODEL)


def steer(args, tok) -> None:
    from routers import find_experts, random_like  # benchmarks/routers.py (not edited here)
    from zoo.editing.calibration import corpus

    base = fresh(args).eval()
    num_experts = max(m.num_experts for _, m in moe_layers(base))
    code, english = corpus("code", tokens=args.calibration_tokens), corpus("english", tokens=args.calibration_tokens)
    ref = evaluate(base, tok, args.windows)
    rows = [row("base", ref)]
    found = find_experts(base, code, english, tok, top=args.top)
    runs = [("disable code experts", found), ("disable english experts", find_experts(base, english, code, tok,
                                                                                       top=args.top))]
    runs += [(f"disable random experts s{s}", random_like(found, num_experts, s)) for s in range(3)]
    for label, disable in runs:
        r = evaluate(zoo.apply(copy.deepcopy(base), "steer", disable=disable), tok, args.windows)
        x = {d: r["ppl"][d] / ref["ppl"][d] for d in DOMAINS}
        rows.append(row(label, r, **{"code x / english x": round(x["code"] / x["english"], 3)}))
        print(rows[-1], flush=True)
    show(rows)
    sel = {r["run"]: r["code x / english x"] for r in rows[1:]}
    rand = [v for k, v in sel.items() if "random" in k]
    code_sel = sel["disable code experts"] > max(rand)
    eng_sel = sel["disable english experts"] < min(rand)
    verdict = "holds" if code_sel and eng_sel else "holds in part" if code_sel or eng_sel else "does not hold"
    record("steer", "disabling the experts tied to a behaviour changes that behaviour selectively (Mixture of Tunable "
           "Experts)", verdict,
           f"find_experts contrasts {args.calibration_tokens} code tokens with as many English ones (train split) and "
           f"returns {args.top} experts; those are disabled and the code/English perplexity ratios compared with "
           f"as many random experts in the same layers (3 seeds) and with the English experts; {args.windows} held-out "
           f"windows x 256 tokens per domain, one thread. code x / english x (how much more code suffers): code "
           f"experts {sel['disable code experts']}, English experts {sel['disable english experts']}, random "
           f"{min(rand)}..{max(rand)}. The paper steers behaviours of DeepSeek-R1 (e.g. refusals), not domains.",
           rows, f"python benchmarks/claims_routers.py --component steer --windows {args.windows}", MODEL)


def untestable(args, tok) -> None:
    record("sparsemixer", "GRIN's gradient-informed training (SparseMixer-v2's sampled routing with a Heun "
           "third-order gradient estimate) trains MoEs better than top-k routing", "untestable here",
           "The zoo's sparsemixer implements GRIN's inference-time routing (Phi-3.5-MoE's) only: in training it "
           "selects as at inference and the gate gets gradients through each round's softmax, so the paper's "
           "estimator is absent. Measuring the claim needs that estimator and a training run from scratch long "
           "enough to compare convergence (the paper: billions of tokens).", [], "python benchmarks/claims_routers.py "
           "--component sparsemixer", "none (not run)")
    record("language-conditioned", "text-guided visual expert selection aligns visual tokens with the prompt's "
           "language and improves multilingual visual question answering (Parrot)", "untestable here",
           "zoo-tiny-mm's only text prompts are in one language (the digits task), so there is no multilingual "
           "benchmark to run; measuring the claim needs a vision-language model with multilingual instruction data "
           "and an evaluation such as the paper's MMMB, far beyond this machine.", [],
           "python benchmarks/claims_routers.py --component language-conditioned", "none (not run)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--component", required=True, choices=COMPONENTS + ("all",))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--aux", type=float, default=0.01, help="Switch balance loss weight (Switch's 0.01)")
    ap.add_argument("--gamma", type=float, default=0.01, help="sigmoid-bias: bias update speed")
    ap.add_argument("--router-std", type=float, default=0.02, help="topk-softmax: std of the re-initialised routers")
    ap.add_argument("--windows", type=int, default=6, help="held-out windows of 256 tokens per domain")
    ap.add_argument("--tolerance", type=float, default=0.02, help="'competitive': perplexity within this ratio")
    ap.add_argument("--calibration-tokens", type=int, default=8192, help="steer: tokens per set for find_experts")
    ap.add_argument("--top", type=int, default=4, help="steer: experts find_experts returns")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = zoo.load_tokenizer(MODEL)
    runs = {
        "topk-softmax": topk_softmax,
        "sigmoid-bias": sigmoid_bias,
        "token-hash": lambda a, t: versus_learned(
            a, t, "token-hash", {}, "fixed hash routing (token id -> experts) is competitive with learned routing "
            "(Hash Layers)", "Hash routing (the zoo's balanced hash of the token id, the gate only weighting) "
            "against zoo-tiny-moe's learned top-2 router; the hash arm trains without the balance loss (its routing "
            "carries no logits; the table is balanced by construction)."),
        "expert-choice": lambda a, t: versus_learned(
            a, t, "expert-choice", {"capacity_factor": 2.0}, "expert choice routing (each expert picks its tokens) "
            "trains at least as well as token-choice top-k at equal compute", "Expert choice at capacity factor 2 "
            "(top-2's compute) against top-2 token choice; its evaluation routes within each batch of held-out "
            "windows, as it is not causal."),
        "scored-topk": scored_topk,
        "steer": steer,
        "sparsemixer": untestable,
        "language-conditioned": untestable,
    }
    chosen = list(dict.fromkeys(runs[c] for c in COMPONENTS)) if args.component == "all" else [runs[args.component]]
    for fn in chosen:
        fn(args, tok)


if __name__ == "__main__":
    main()
