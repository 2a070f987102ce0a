"""Routers' paper claims on zoo-tiny-moe, measured in short runs on one thread and recorded with zoo.evaluation.claims.

Every verdict comes from the one rule (``zoo.evaluation.claims.judge``): each arm is repeated, and the mechanism holds
only when it beats a control that lacks only the mechanism by more than the repeats' own noise.

Fine-tuned claims run every arm from each of ``--seeds`` seeds: an arm of seed s seeds torch with s before its router
change (so a re-initialised router starts the same in both arms) and trains on seed s's batches, so the arms of a seed
start from the same weights and see the same batches and are judged paired by seed:

- ``topk-softmax``: Switch's balance loss balances load: routers re-initialised, the whole model fine-tuned with the
  loss and without it; measure: max/mean expert load. (Mixtral's claim in the same file is recorded by
  benchmarks/own_models.py.)
- ``sigmoid-bias``: DeepSeek-V3's auxiliary-loss-free balancing: the router swapped to sigmoid-bias and fine-tuned
  with the selection-only bias updated by load after every step (``b_e += gamma * sign(mean load - load_e)``, the
  router's ``bias_update_speed`` and ``after_step``), against the same router with no balancing and with the
  auxiliary loss instead, on max/mean load and on perplexity;
- ``token-hash``: fixed hash routing against the shipped learned top-2 router, both fine-tuned the same;
- ``expert-choice``: expert choice at capacity factor 2 (top-2's compute) against top-2, fine-tuned the same.

Inference-only claims repeat over ``--draws`` disjoint evaluation draws of ``--windows`` held-out windows per domain,
repeat i of every arm on draw i (paired draws):

- ``scored-topk``: DeepSeek-V2's group-limited routing (the best 3 of 4 groups) against the same router with no limit;
- ``steer``: experts found by contrasting code with English (``find_experts``, calibrated on calibration seed i)
  disabled, against as many random experts in the same layers (random seed i).

``sparsemixer`` and ``language-conditioned`` are recorded as untestable here, with the reason.

    python benchmarks/claims_routers.py --component all     # every component, about 12 minutes on one free core
    python benchmarks/claims_routers.py --component token-hash
    python benchmarks/claims_routers.py --quick             # all at a tiny budget, 2 repeats; records nothing
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, draw_geo, draw_args, geo, judgement_line, seed_args, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS, load_text  # noqa: E402
from zoo.data.tokens import token_stream, train_batch  # noqa: E402
from zoo.evaluation.claims import judge, same_weights  # noqa: E402
from zoo.evaluation.eval import perplexity_and_usage  # noqa: E402
from zoo.training.precision import precision_label, training_autocast  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402
from zoo.moe.losses import load_balancing_loss  # noqa: E402
from zoo.training.finetune import lr_at  # noqa: E402

TRAINED = ("token-hash", "expert-choice", "topk-softmax", "sigmoid-bias")  # fine-tuned arms, repeated over seeds
COMPONENTS = ("scored-topk", "steer", "sparsemixer", "language-conditioned") + TRAINED
MODEL = "zoo-tiny-moe"
SEEDS_UNIT = "seeds, paired by seed"
BESIDE = " (beside the claim, not in its verdict)"


# ---- measuring -------------------------------------------------------------------------------------------------

def evaluate(model, tok, windows: int) -> dict:
    """Held-out perplexity per domain and its geometric mean, and the load of the experts: max/mean load per layer
    (1 = balanced) and the routing entropy in bits, both averaged over layers and domains."""
    ppl, usage = perplexity_and_usage(model, tok, 256, windows)
    peaks, ents = [], []
    for d in DOMAINS:
        for layer in usage[d]:
            c = torch.tensor(layer["counts"], dtype=torch.float)
            peaks.append(float(c.max() / c.mean().clamp(min=1e-9)))
            ents.append(layer["entropy_bits"])
    return {"ppl": ppl, "geo": geo(ppl), "load": sum(peaks) / len(peaks), "entropy": sum(ents) / len(ents)}


def streams(args, tok) -> dict:
    """Both domains' train split as token streams, made once per run. A quick run tokenizes only the first
    ``args.train_chars`` characters of each (tokenizing the whole split takes longer than its whole budget)."""
    if getattr(args, "streams", None) is None:
        if args.train_chars:
            args.streams = {d: torch.tensor(tok(load_text(d, "train")[:args.train_chars])["input_ids"])
                            for d in DOMAINS}
        else:
            args.streams = {d: token_stream(d, "train", tok) for d in DOMAINS}
    return args.streams


def calibration(args, tok, domain: str, seed: int):
    """find_experts' calibration set of ``domain``: ``corpus(domain, tokens, seed=seed)`` (train split windows at
    random, by seed); a quick run draws its 256-token windows the same way from its short streams instead."""
    from zoo.editing.calibration import corpus

    if not args.train_chars:
        return corpus(domain, tokens=args.calibration_tokens, seed=seed)
    stream, g = streams(args, tok)[domain], torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - 256, (max(1, args.calibration_tokens // 256),), generator=g)
    return [torch.stack([stream[s:s + 256] for s in starts.tolist()]).long()]


def tune(model, tok, args, aux: float, seed: int) -> None:
    """Fine-tune every parameter for ``args.steps`` on seed ``seed``'s batches of both domains (AdamW,
    zoo.training.finetune's schedule, bf16 autocast); ``aux``: weight of the Switch balance loss (mean over layers).
    Routers with ``after_step`` get it after every optimizer step, as ``moe-zoo finetune`` does."""
    layers = moe_layers(model)
    seen = {}
    handles = [m.router.register_forward_hook(lambda mod, a, r, i=i: seen.__setitem__(i, r))
               for i, (_, m) in enumerate(layers)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=True)
    data = streams(args, tok)
    model.train()
    try:
        for step in range(args.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(args.lr, step, args.steps)
            ids = train_batch(data, step, args.batch, args.seq_len, seed)
            with training_autocast():
                loss = model(input_ids=ids, labels=ids).loss
                # routers without logits (token-hash: the table picks, balanced by construction) take no loss
                bal = [load_balancing_loss(seen[i].logits, layers[i][1].router.top_k) for i in seen
                       if seen[i].logits is not None]
                if aux and bal:
                    loss = loss + aux * torch.stack(bal).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            for _, m in layers:  # the router's own per-step update (sigmoid-bias: DeepSeek-V3's bias rule)
                if callable(getattr(m.router, "after_step", None)):
                    m.router.after_step()
    finally:
        for h in handles:
            h.remove()
    model.eval()


def trained(base, tok, args, seed: int, setup=None, aux: float = 0.0):
    """One fine-tuned arm of one seed: torch seeded with ``seed``, then ``setup`` (the arm's router change) on a copy
    of the shipped model, then ``tune`` on seed ``seed``'s batches. Returns (model, ``evaluate``'s result)."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    if setup is not None:
        model = setup(model)
    tune(model, tok, args, aux, seed)
    result = evaluate(model, tok, args.windows)
    result["seconds"] = round(time.perf_counter() - t0)
    return model, result


def row(label: str, r: dict, **extra) -> dict:
    out = {"run": label, **extra}
    for d in DOMAINS:
        out[f"ppl {d}"] = round(r["ppl"][d], 2)
    out["ppl geo-mean"] = round(r["geo"], 3)
    out["max/mean load"] = round(r["load"], 3)
    out["entropy bits"] = round(r["entropy"], 3)
    if "seconds" in r:
        out["seconds"] = r["seconds"]
    return out


def run_arms(base, tok, args, arms: dict, rows: list, pairs=()) -> tuple[dict, dict]:
    """Every arm ({label: (setup, aux)}) from every seed. Returns ({label: [result per seed]}, {(a, b): whether arms
    a and b made the same weights from every seed}) for the ``pairs`` asked about."""
    results, same = {label: [] for label in arms}, {p: True for p in pairs}
    for seed in range(args.seeds):
        models = {}
        for label, (setup, aux) in arms.items():
            models[label], r = trained(base, tok, args, seed, setup, aux)
            results[label].append(r)
            rows.append(row(label, r, seed=seed))
            print(rows[-1], flush=True)
        for a, b in pairs:
            same[(a, b)] = same[(a, b)] and same_weights(models[a], models[b])
    return results, same


def paired(mech: list, ctrl: list, key: str, lower_is_better: bool = True, same: bool = False,
           why_same: str = "") -> dict:
    """``judge`` on measure ``key`` of two fine-tuned arms' per-seed results, paired by seed."""
    return judge([r[key] for r in mech], [r[key] for r in ctrl], lower_is_better=lower_is_better, paired=True,
                 same_model=same, why_same=why_same if same else "")


def settings(args) -> str:
    return (f"{MODEL} fine-tuned whole for {args.steps} steps x {args.batch} x {args.seq_len} tokens of both domains "
            f"(AdamW lr {args.lr}, warm-up then cosine, {precision_label()}) from each of {args.seeds} seeds; both "
            f"arms of a seed start from the same weights and see the same batches, so each comparison is paired by "
            f"seed (noise: the spread of the per-seed differences); evaluated on {args.windows} held-out windows x 256 "
            "tokens per domain; one thread. So short a tune raises every arm's perplexity above the shipped model's: compare "
            "the arms with each other")


def draw_settings(args) -> str:
    return (f"{args.draws} disjoint evaluation draws of {args.windows} held-out windows x 256 tokens per domain, "
            f"repeat i of every arm on draw i (paired); one thread")


def command(args, component: str, trained_arms: bool = True) -> str:
    out = f"python benchmarks/claims_routers.py --component {component}"
    keys = (("steps", "batch", "seq_len", "lr", "aux", "seeds", "windows") if trained_arms else ("draws", "windows"))
    for key in keys + (("gamma",) if component == "sigmoid-bias" else ("router_std",) if component == "topk-softmax"
                       else ("calibration_tokens", "top") if component == "steer" else ()):
        if getattr(args, key) != DEFAULTS[key]:
            out += f" --{key.replace('_', '-')} {getattr(args, key)}"
    return out


def mean(xs) -> float:
    return sum(xs) / len(xs)


# ---- claims: each returns [(component, claim, verdict, summary, rows, judgements)] ---------------------------

def topk_softmax(base, tok, args) -> list:
    def reinit(model):  # a fresh router (the same from one seed in both arms): does the loss keep it balanced?
        for _, m in moe_layers(model):
            torch.nn.init.normal_(m.router.weight, std=args.router_std)
        return model

    arms = {"no balance loss": (reinit, 0.0), f"balance loss {args.aux:g}": (reinit, args.aux)}
    no, yes = arms
    rows = []
    res, same = run_arms(base, tok, args, arms, rows, pairs=[(yes, no)])
    show(rows)
    claim = "the auxiliary load-balancing loss balances expert load (Switch Transformers)"
    parts = {"max/mean expert load, with the loss vs without (lower = balanced)": paired(
        res[yes], res[no], "load", same=same[(yes, no)], why_same="the loss changed no weight")}
    verdict = conclude(f"topk-softmax: {claim}", parts, SEEDS_UNIT)
    j = next(iter(parts.values()))
    summary = (f"{verdict_parts(parts)}. Routers re-initialised (normal, std {args.router_std}), then "
               f"{settings(args)}. "
               f"With the Switch loss (weight {args.aux:g}, mean over layers) max/mean load {j['mechanism']:.3f} vs "
               f"{j['control']:.3f} without (margin {j['margin']:.3g}, noise {j['noise']:.3g}); routing entropy "
               f"{mean([r['entropy'] for r in res[yes]]):.3f} vs {mean([r['entropy'] for r in res[no]]):.3f} bits "
               f"(max 3); perplexity geo-mean {mean([r['geo'] for r in res[yes]]):.2f} vs "
               f"{mean([r['geo'] for r in res[no]]):.2f}. The paper pre-trains from scratch on C4 for hundreds of "
               "thousands of steps.")
    return [("topk-softmax", claim, verdict, summary, rows, parts)]


def sigmoid_bias(base, tok, args) -> list:
    def sigmoid(gamma):
        return lambda model: zoo.apply(model, "sigmoid-bias", **({"bias_update_speed": gamma} if gamma else {}))

    none, aux, bias = "no balancing", f"aux loss {args.aux:g}", f"bias update gamma {args.gamma:g}"
    arms = {none: (sigmoid(0.0), 0.0), aux: (sigmoid(0.0), args.aux), bias: (sigmoid(args.gamma), 0.0)}
    rows = []
    res, same = run_arms(base, tok, args, arms, rows, pairs=[(bias, none), (bias, aux)])
    show(rows)
    why = "the bias update changed no weight"
    parts = {
        "max/mean load, bias update vs no balancing": paired(res[bias], res[none], "load", same=same[(bias, none)],
                                                            why_same=why),
        "max/mean load, bias update vs aux loss": paired(res[bias], res[aux], "load", same=same[(bias, aux)],
                                                        why_same=why),
        "perplexity (geo-mean), bias update vs aux loss": paired(res[bias], res[aux], "geo",
                                                                 same=same[(bias, aux)], why_same=why)}
    beside = {"perplexity (geo-mean), bias update vs no balancing" + BESIDE: paired(
        res[bias], res[none], "geo", same=same[(bias, none)], why_same=why)}
    claim = ("auxiliary-loss-free balancing (a selection-only bias updated by load) balances load without the "
             "auxiliary loss's cost in quality (DeepSeek-V3)")
    verdict = conclude(f"sigmoid-bias: {claim}", parts, SEEDS_UNIT)
    print_beside(beside, SEEDS_UNIT)
    means = {k: (mean([r["load"] for r in v]), mean([r["geo"] for r in v])) for k, v in res.items()}
    summary = (f"{verdict_parts(parts)}; beside the claim, {verdict_parts(beside)}. zoo-tiny-moe's routers swapped "
               f"to sigmoid-bias (its trained gate kept), then {settings(args)}. The bias arm uses the router's own "
               f"rule, b_e += gamma * sign(mean load - load_e) after every step (bias_update_speed {args.gamma:g}, "
               f"larger than the paper's 0.001 for a short run); the aux arm the Switch loss (weight {args.aux:g}) on "
               "the gate logits; the no-balancing arm neither. Mean max/mean load and perplexity geo-mean: "
               + "; ".join(f"{k} {v[0]:.3f}, {v[1]:.2f}" for k, v in means.items())
               + ". Wang et al. (arXiv:2408.15664) train 1B and 3B MoEs from scratch on 100B and 200B tokens.")
    return [("sigmoid-bias", claim, verdict, summary, rows, {**parts, **beside})]


def learned_control(base, tok, args) -> list:
    """The shipped learned top-2 router fine-tuned with its Switch loss, per seed: the control of token-hash and
    expert-choice, made once per run (deterministic, so the same in either)."""
    if getattr(args, "learned", None) is None:
        args.learned = []
        for seed in range(args.seeds):
            args.learned.append(trained(base, tok, args, seed, None, args.aux)[1])
            print(row("learned top-2 (as shipped)", args.learned[-1], seed=seed), flush=True)
    return args.learned


def versus_learned(base, tok, args, component: str, options: dict, aux: float, claim: str, what: str) -> list:
    label = f"{component} {options or ''}".strip()
    control = learned_control(base, tok, args)
    rows = [row("learned top-2 (as shipped) before tuning", evaluate(base, tok, args.windows))]
    torch.manual_seed(0)
    rows.append(row(f"{label} before tuning", evaluate(zoo.apply(copy.deepcopy(base), component, **options), tok,
                                                       args.windows)))
    mech = []
    for seed in range(args.seeds):
        mech.append(trained(base, tok, args, seed, lambda m: zoo.apply(m, component, **options), aux)[1])
        print(row(label, mech[-1], seed=seed), flush=True)
    rows += [row("learned top-2 (as shipped)", r, seed=s) for s, r in enumerate(control)]
    rows += [row(label, r, seed=s) for s, r in enumerate(mech)]
    show(rows)
    parts = {f"perplexity (geo-mean), {component} vs learned top-2": paired(mech, control, "geo")}
    verdict = conclude(f"{component}: {claim}", parts, SEEDS_UNIT)
    j = next(iter(parts.values()))
    summary = (f"{verdict_parts(parts)}. {what} Both fine-tuned the same ({settings(args)}). Perplexity geo-mean "
               f"{j['mechanism']:.2f} vs {j['control']:.2f} for the learned router (margin {j['margin']:.3g}, noise "
               f"{j['noise']:.3g}); the rule calls the claim held only when {component} is better by more than the "
               "noise, so a gap within the noise reads inconclusive. The experts were trained under the learned "
               "router, so the swap starts behind; the paper trains from scratch on billions of tokens.")
    return [(component, claim, verdict, summary, rows, parts)]


def token_hash(base, tok, args) -> list:
    return versus_learned(
        base, tok, args, "token-hash", {}, 0.0, "fixed hash routing (token id -> experts) is competitive with learned "
        "routing (Hash Layers)", "Hash routing (the zoo's balanced hash of the token id, the gate only weighting) "
        f"against zoo-tiny-moe's learned top-2 router, which keeps its Switch loss (weight {args.aux:g}, its training "
        "recipe); the hash arm has no balance loss (its routing carries no logits; the table is balanced by "
        "construction).")


def expert_choice(base, tok, args) -> list:
    return versus_learned(
        base, tok, args, "expert-choice", {"capacity_factor": 2.0}, args.aux, "expert choice routing (each expert "
        "picks its tokens) trains at least as well as token-choice top-k at equal compute", "Expert choice at "
        f"capacity factor 2 (top-2's compute) against top-2 token choice, both with the Switch loss (weight "
        f"{args.aux:g}) on their gate logits; its evaluation routes within each batch of held-out windows, as it is "
        "not causal.")


def per_draw(model, tok, args) -> list[dict]:
    """``model`` on draws 0..draws-1: [{domain: perplexity}]."""
    return [draw_geo(model, tok, i, args.windows)[1] for i in range(args.draws)]


def scored_topk(base, tok, args) -> list:
    rows, geos = [], {}
    for m in (4, 3, 2, 1):  # 4 of 4 groups: the same router with no limit, the control
        label = "all 4 groups (no limit)" if m == 4 else f"best {m} of 4 groups"
        ppls = per_draw(zoo.apply(copy.deepcopy(base), "scored-topk", n_group=4, topk_group=m), tok, args)
        geos[m] = [geo(p) for p in ppls]
        rows.append({"run": label, **{f"ppl {d}": round(mean([p[d] for p in ppls]), 3) for d in DOMAINS},
                     "ppl geo-mean": round(mean(geos[m]), 3),
                     "geo-mean by draw": "/".join(f"{g:.3f}" for g in geos[m])})
        print(rows[-1], flush=True)
    show(rows)

    def versus(m):  # the limit lives in the router's options, not its weights: the same model = the same numbers
        same = geos[m] == geos[4]
        return judge(geos[m], geos[4], paired=True, same_model=same,
                     why_same="limiting the groups changed no token's experts on these draws" if same else "")

    claim = ("group-limited routing (experts from the best M groups only) costs little quality once M >= 3 "
             "(DeepSeek-V2's device-limited routing)")
    parts = {"perplexity (geo-mean), best 3 of 4 groups vs no limit": versus(3)}
    beside = {f"perplexity (geo-mean), best {m} of 4 groups vs no limit" + BESIDE: versus(m) for m in (2, 1)}
    verdict = conclude(f"scored-topk: {claim}", parts, "paired draws")
    print_beside(beside, "paired draws")
    j = next(iter(parts.values()))
    summary = (f"{verdict_parts(parts)}; beside the claim, {verdict_parts(beside)}. scored-topk applied at inference "
               f"to zoo-tiny-moe (trained without group limits; DeepSeek-V2 trains with them) as 4 groups of 2 "
               f"experts (group score: the sum of its two best), top-2 from the best M groups, against the same "
               f"router with all 4 groups; {draw_settings(args)}. Best 3 of 4: perplexity geo-mean "
               f"{j['mechanism']:.3f} vs {j['control']:.3f} (margin {j['margin']:.3g}, noise {j['noise']:.3g}). "
               "'Costs little' can hold under the rule only as a gain beyond the noise; a cost within the noise reads "
               "inconclusive.")
    return [("scored-topk", claim, verdict, summary, rows, {**parts, **beside})]


def steer(base, tok, args) -> list:
    from routers import find_experts, random_like  # benchmarks/routers.py (not edited here)

    num_experts = max(m.num_experts for _, m in moe_layers(base))
    arms = ("code experts", "random (as code)", "English experts", "random (as English)")
    sel, rows, same = {a: [] for a in arms}, [], {"code": True, "English": True}
    for i in range(args.draws):  # calibration seed i, random seed i, evaluation draw i
        code, english = calibration(args, tok, "code", i), calibration(args, tok, "english", i)
        found = {"code experts": find_experts(base, code, english, tok, top=args.top),
                 "English experts": find_experts(base, english, code, tok, top=args.top)}
        found["random (as code)"] = random_like(found["code experts"], num_experts, i)
        found["random (as English)"] = random_like(found["English experts"], num_experts, i)
        same["code"] &= found["code experts"] == found["random (as code)"]
        same["English"] &= found["English experts"] == found["random (as English)"]
        ref = draw_geo(base, tok, i, args.windows)[1]
        for label in arms:
            p = draw_geo(zoo.apply(copy.deepcopy(base), "steer", disable=found[label]), tok, i, args.windows)[1]
            x = {d: p[d] / ref[d] for d in DOMAINS}
            sel[label].append(x["code"] / x["english"])
            rows.append({"run": f"disable {label}", "draw": i, "experts": str(found[label]),
                         **{f"ppl {d} x": round(x[d], 4) for d in DOMAINS},
                         "code x / english x": round(sel[label][-1], 4)})
            print(rows[-1], flush=True)
    show(rows)
    why = "the random draw picked the found experts"
    parts = {"code x / english x, code experts vs as many random (higher = selective)": judge(
                 sel["code experts"], sel["random (as code)"], lower_is_better=False, paired=True,
                 same_model=same["code"], why_same=why if same["code"] else ""),
             "code x / english x, English experts vs as many random (lower = selective)": judge(
                 sel["English experts"], sel["random (as English)"], paired=True, same_model=same["English"],
                 why_same=why if same["English"] else "")}
    claim = ("disabling the experts tied to a behaviour changes that behaviour selectively (Mixture of Tunable "
             "Experts)")
    verdict = conclude(f"steer: {claim}", parts, "paired draws")
    summary = (f"{verdict_parts(parts)}. find_experts contrasts {args.calibration_tokens} code tokens with as many "
               f"English ones (train split, calibration seed i) and returns {args.top} experts; those are disabled "
               "with steer and compared with as many random experts in the same layers (random seed i). Measure: "
               "code x / english x, the code perplexity's rise over the English one's against the base model on "
               f"the same draw (mean: code experts {mean(sel['code experts']):.3f} vs random "
               f"{mean(sel['random (as code)']):.3f}; English experts {mean(sel['English experts']):.3f} vs random "
               f"{mean(sel['random (as English)']):.3f}); {draw_settings(args)}. The paper steers behaviours of "
               "DeepSeek-R1 (e.g. refusals), not domains.")
    return [("steer", claim, verdict, summary, rows, parts)]


UNTESTABLE = {
    "sparsemixer": (
        "GRIN's gradient-informed training (SparseMixer-v2's sampled routing with a Heun third-order gradient "
        "estimate) trains MoEs better than top-k routing",
        "The zoo's sparsemixer implements GRIN's inference-time routing (Phi-3.5-MoE's) only: in training it selects "
        "as at inference and the gate gets gradients through each round's softmax, so the paper's estimator is "
        "absent. Measuring the claim needs that estimator and a training run from scratch long enough to compare "
        "convergence (the paper: billions of tokens)."),
    "language-conditioned": (
        "text-guided visual expert selection aligns visual tokens with the prompt's language and improves "
        "multilingual visual question answering (Parrot)",
        "zoo-tiny-mm's only text prompts are in one language (the digits task), so there is no multilingual "
        "benchmark to run; measuring the claim needs a vision-language model with multilingual instruction data "
        "and an evaluation such as the paper's MMMB, far beyond this machine."),
}


def untestable(component: str) -> list:
    claim, reason = UNTESTABLE[component]
    print(f"\n{component}: {claim}: untestable here ({reason})")
    return [(component, claim, "untestable here", reason, [], None)]


def print_beside(beside: dict, unit: str) -> None:
    """Comparisons shown beside a claim's verdict block, indented so they are not read as its parts."""
    for name, j in beside.items():
        print("    " + judgement_line(name, j, unit))


RUNS = {"topk-softmax": topk_softmax, "sigmoid-bias": sigmoid_bias, "token-hash": token_hash,
        "expert-choice": expert_choice, "scored-topk": scored_topk, "steer": steer}
DEFAULTS = {"steps": 20, "batch": 4, "seq_len": 128, "lr": 1e-3, "aux": 0.01, "seeds": 3, "draws": 4, "windows": 12,
            "gamma": 0.01, "router_std": 0.02, "calibration_tokens": 8192, "top": 4}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--component", default="all", choices=COMPONENTS + ("all",))
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    ap.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    ap.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    ap.add_argument("--aux", type=float, default=DEFAULTS["aux"], help="Switch balance loss weight (Switch's 0.01)")
    ap.add_argument("--gamma", type=float, default=DEFAULTS["gamma"], help="sigmoid-bias: bias update speed")
    ap.add_argument("--router-std", type=float, default=DEFAULTS["router_std"],
                    help="topk-softmax: std of the re-initialised routers")
    ap.add_argument("--calibration-tokens", type=int, default=DEFAULTS["calibration_tokens"],
                    help="steer: tokens per set for find_experts")
    ap.add_argument("--top", type=int, default=DEFAULTS["top"], help="steer: experts find_experts returns")
    # --windows: per evaluation draw, and the held-out windows the fine-tuned arms are evaluated on
    draw_args(ap, draws=DEFAULTS["draws"], windows=DEFAULTS["windows"])
    seed_args(ap, seeds=DEFAULTS["seeds"])
    return ap


def keep_freed_memory() -> None:
    """Let glibc keep freed memory for reuse (up to 1 GiB) and grow its heap 512 MiB at a time: a training step
    frees and re-makes hundreds of MB of temporaries (each expert's gradient slice is a zero-filled stack of all the
    experts), and fresh pages from the system cost more than a quick run's steps themselves."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD
    for option, value in ((-3, 1 << 30), (-1, 1 << 30), (-2, 1 << 29)):
        libc.mallopt(option, value)


def main(argv=None):
    started = time.perf_counter()
    keep_freed_memory()
    args = parser().parse_args(argv)
    args.train_chars = None
    if args.quick:  # the whole path at a tiny budget: 2 seeds / draws, 1 step, 1 window; records nothing
        args.seeds, args.draws, args.windows = min(args.seeds, 2), min(args.draws, 2), 1
        args.steps, args.batch, args.seq_len, args.calibration_tokens = 1, 2, 32, 256
        args.train_chars = 20_000
    if args.seeds < 2 or args.draws < 2:
        raise SystemExit("--seeds and --draws must be at least 2: one run has no noise to compare against")
    torch.set_num_threads(1)
    tok = zoo.load_tokenizer(MODEL)
    base = zoo.load(MODEL, dtype=torch.float32).eval()
    chosen = COMPONENTS if args.component == "all" else (args.component,)
    for component in chosen:  # each component recorded as soon as it is measured
        entries = RUNS[component](base, tok, args) if component in RUNS else untestable(component)
        if not args.quick:
            record_entries(args, entries)
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.quick else ", recorded: " + ", ".join(f"docs/claims/{c}.json"
                                                                              for c in chosen)))


def record_entries(args, entries: list) -> None:
    from zoo.evaluation.claims import record

    for component, claim, verdict, summary, rows, judgements in entries:
        if judgements is None:  # untestable here: nothing was run
            record(component, claim, verdict, summary, rows, f"python benchmarks/claims_routers.py --component "
                   f"{component}", "none (not run)")
        else:
            record(component, claim, verdict, summary, rows, command(args, component, component in TRAINED), MODEL,
                   judgements=judgements)


if __name__ == "__main__":
    main()
