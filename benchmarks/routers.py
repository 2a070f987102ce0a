"""Routers on zoo-tiny-moe (trained with top-2 softmax routing), in one table: average active experts per
token and held-out perplexity per domain, with ratios to the base model.

- expert-choice at a few capacity factors and top-p at a few p, against the base top-2 (issue #7, claim 4);
- steer (claim 5): ``zoo_routers.steer_experts.find_experts`` contrasts code with English on the corpus' train split, the
  experts found are disabled, and code vs English perplexity is compared with the base; controls: as many
  random experts disabled (same layers), and the experts found the other way round (English vs code).

    python benchmarks/routers.py                 # full table (a few minutes on one thread)
    python benchmarks/routers.py --windows 4     # fewer held-out windows, faster
"""
from __future__ import annotations

import argparse
import copy
import random

import torch

import zoo
from zoo.calibration import corpus
from zoo.data.corpus import DOMAINS
from zoo.data.tokens import eval_windows, token_stream
from zoo.eval import perplexity_and_usage
from zoo.layout import moe_layers
from zoo_routers.steer_experts import find_experts

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="zoo-tiny-moe")
    ap.add_argument("--windows", type=int, default=24, help="held-out windows of 256 tokens per domain")
    ap.add_argument("--calibration-tokens", type=int, default=16384, help="tokens per set for find_experts")
    ap.add_argument("--top", type=int, nargs="+", default=[4, 8], help="experts find_experts returns")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base, tok = zoo.load(args.model).eval(), zoo.load_tokenizer(args.model)
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
