"""UBMoE's claim on zoo-tiny-dense: the uni-bi MoE embeds text better than the unidirectional model while it
generates better than the fully bidirectionally tuned model (and about as well as the unidirectional one).

Three arms per seed, all from zoo-tiny-dense:

* uni: the model as it is; its embeddings are read as it runs, causal attention, mean pooling;
* full-bi: every decoder-layer weight (attention, FFN, norms) tuned with ``ubmoe``'s stage 1 (unsupervised SimCSE
  under bidirectional attention: each window twice, two dropout masks, the batch's other windows as negatives);
  embeddings with bidirectional attention, generation with its causal forward;
* ubmoe: ``zoo.apply(dense, "ubmoe", ...)``: the FFNs alone tuned the same way (same steps, lr, batches, dropout
  masks' seed) become the second expert of every layer, beside the original FFN, a top-1 router between them
  trained on the language-model loss; embeddings are ``ubmoe.embed`` (bidirectional attention, the tuned expert).

Measures, on held-out text (the val split) only: embedding quality as passage-continuation retrieval, each of
``--passages`` consecutive windows of ``--passage-len`` tokens per domain split in half, the first half the query
and the second halves of all passages of that domain the candidates (cosine similarity of the embeddings; MRR and
recall@1, averaged over the two domains); generation as perplexity on windows of 256 tokens (geometric mean over
domains), judged on its log, the mean token loss (the arms' perplexities differ by an order of magnitude).
Seed s draws the training batches, the dropout masks and the router's init, and is measured on
evaluation draw s (disjoint passages and windows): the arms of a seed see the same text, so each comparison is
judged paired by seed (``zoo.evaluation.claims.judge``; noise: the spread of the per-seed differences).

    python benchmarks/ubmoe.py               # the recorded run: 3 seeds x 3 arms (about 8 CPU minutes, one thread)
    python benchmarks/ubmoe.py --quick       # 2 seeds x 2 steps, few passages; records nothing
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, draw_geo, seed_args, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokenizer import load_tokenizer  # noqa: E402
from zoo.data.tokens import eval_windows, token_stream  # noqa: E402
from zoo.evaluation.claims import judge  # noqa: E402
from zoo_adapters.ubmoe import embed  # noqa: E402
from zoo_adapters.ubmoe_train import contrastive_tune, corpus_batches, decoder_of  # noqa: E402

MODEL = "zoo-tiny-dense"
CLAIM = ("UBMoE (each FFN beside its bidirectionally, contrastively tuned copy, a top-1 router between them) embeds "
         "text better than the unidirectional model while generating better than the fully bidirectionally tuned "
         "model")
KEEPS = "UBMoE's generation perplexity is no worse than the unidirectional model's"
SCOPE = ("Scope: a tiny (6M-parameter) decoder, a few dozen contrastive steps on the zoo's two-domain corpus and "
         "a continuation-retrieval proxy for embedding quality; the paper tunes Qwen2.5 models (0.5B-14B) on a "
         "full contrastive dataset and scores STS/MTEB embeddings and generation benchmarks")


def passages(tokenizer, draw: int, count: int, length: int) -> dict:
    """Draw ``draw``: held-out windows ``[draw * count, (draw + 1) * count)`` of ``length`` tokens per domain."""
    out = {}
    for d in DOMAINS:
        every = eval_windows(token_stream(d, "val", tokenizer), length)
        if (draw + 1) * count > len(every):
            raise ValueError(f"draw {draw} needs {(draw + 1) * count} held-out {d} passages of {length} tokens; the "
                             f"split has {len(every)}")
        out[d] = every[draw * count:(draw + 1) * count]
    return out


@torch.no_grad()
def retrieval(reader, drawn: dict, batch: int = 32) -> dict:
    """{domain: (MRR, recall@1)}: each passage's first half retrieves its own second half among the domain's."""
    out = {}
    for d, rows in drawn.items():
        half = rows.shape[1] // 2
        q = torch.cat([reader(r[:, :half]) for r in rows.split(batch)])
        k = torch.cat([reader(r[:, half:]) for r in rows.split(batch)])
        sim = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).T
        rank = (sim > sim.diag()[:, None]).sum(1) + 1
        out[d] = (float((1.0 / rank.float()).mean()), float((rank == 1).float().mean()))
    return out


def measure(model, reader, tokenizer, args, draw: int) -> dict:
    model.eval()
    found = retrieval(reader, passages(tokenizer, draw, args.passages, args.passage_len))
    ppl, per_domain = draw_geo(model, tokenizer, draw, args.windows)
    return {"retrieval": found, "mrr": sum(m for m, _ in found.values()) / len(found),
            "r@1": sum(r for _, r in found.values()) / len(found), "ppl": ppl, "ppl_domains": per_domain}


def full_bi(dense, args, tokenizer, seed: int):
    """Every decoder-layer weight tuned with ubmoe's stage 1 (the same batches, lr and masks' seed as ubmoe's)."""
    model = copy.deepcopy(dense)
    params = list(decoder_of(model).layers.parameters())
    contrastive_tune(model, params, corpus_batches(tokenizer, args.batch, args.seq_len, seed), args.steps, args.lr,
                     args.temperature, args.dropout, seed, desc=f"full-bi s{seed}")
    return model


def ubmoe(dense, args, seed: int):
    return zoo.apply(copy.deepcopy(dense), "ubmoe", bi_steps=args.steps, bi_lr=args.lr, temperature=args.temperature,
                     dropout=args.dropout, router_steps=args.router_steps, router_lr=args.router_lr,
                     batch_size=args.batch, seq_len=args.seq_len, seed=seed)


def main(argv=None):
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="contrastive steps (full-bi and ubmoe's FFN copy)")
    p.add_argument("--lr", type=float, default=1e-3, help="contrastive learning rate")
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=16, help="windows per contrastive / router step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per training window")
    p.add_argument("--router-steps", type=int, default=60)
    p.add_argument("--router-lr", type=float, default=1e-2)
    p.add_argument("--passages", type=int, default=128, help="held-out passages per domain per draw")
    p.add_argument("--passage-len", type=int, default=96, help="tokens per passage (query: first half)")
    p.add_argument("--windows", type=int, default=8, help="held-out perplexity windows of 256 tokens per domain")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-record", action="store_true")
    args = seed_args(p).parse_args(argv)
    if args.quick:  # the whole path at a tiny budget; records nothing
        args.seeds, args.steps, args.router_steps, args.batch = min(args.seeds, 2), 2, 2, 4
        args.passages, args.windows, args.no_record = 8, 1, True
    if args.seeds < 2:
        p.error("--seeds must be at least 2: one run has no noise to compare against")
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    dense = zoo.load(MODEL, dtype=torch.float32).eval()

    arms = ("uni", "full-bi", "ubmoe")
    results = {a: [] for a in arms}
    info = []  # ubmoe's embeddings with the routers choosing (not judged: the paper reads the tuned expert)
    for seed in range(args.seeds):
        t0 = time.perf_counter()
        results["uni"].append(measure(dense, lambda ids: embed(dense, ids, attention="causal"), tokenizer, args, seed))
        bi = full_bi(dense, args, tokenizer, seed)
        results["full-bi"].append(measure(bi, lambda ids: embed(bi, ids), tokenizer, args, seed))
        del bi
        moe = ubmoe(dense, args, seed)
        results["ubmoe"].append(measure(moe, lambda ids: embed(moe, ids), tokenizer, args, seed))
        info.append(retrieval(lambda ids: embed(moe, ids, expert="router"),
                              passages(tokenizer, seed, args.passages, args.passage_len)))
        share = moe.config.zoo_recipe[-1]["results"]["bi expert share"]
        del moe
        print(f"seed {seed}: " + "; ".join(f"{a} MRR {results[a][-1]['mrr']:.4f} ppl {results[a][-1]['ppl']:.3f}"
                                           for a in arms)
              + f"; bi expert share per layer {share}; {time.perf_counter() - t0:.0f} s", flush=True)

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rows = []
    for a in arms:
        rs = results[a]
        rows.append({"arm": a, **{f"MRR {d}": round(mean([r["retrieval"][d][0] for r in rs]), 4) for d in DOMAINS},
                     "MRR": round(mean([r["mrr"] for r in rs]), 4), "R@1": round(mean([r["r@1"] for r in rs]), 4),
                     **{f"ppl {d}": round(mean([r["ppl_domains"][d] for r in rs]), 3) for d in DOMAINS},
                     "ppl geo-mean": round(mean([r["ppl"] for r in rs]), 3)})
    rows.append({"arm": "ubmoe, routers choose the FFN (info)",
                 **{f"MRR {d}": round(mean([r[d][0] for r in info]), 4) for d in DOMAINS},
                 "MRR": round(mean([mean([m for m, _ in r.values()]) for r in info]), 4),
                 "R@1": round(mean([mean([k for _, k in r.values()]) for r in info]), 4)})
    settings = (f"{args.steps} contrastive steps of {args.batch} windows x {args.seq_len} tokens at lr {args.lr} "
                f"(temperature {args.temperature}, dropout {args.dropout}), {args.router_steps} router steps at lr "
                f"{args.router_lr}; retrieval over {args.passages} held-out passages of {args.passage_len} tokens per "
                f"domain per seed, perplexity on {args.windows} held-out windows of 256 tokens per domain per seed; "
                f"seeds {', '.join(map(str, range(args.seeds)))}, {torch.get_num_threads()} thread(s)")
    print(f"\n{settings}\n")
    show(rows)
    print()

    # generation is judged on log perplexity (the mean held-out token loss): the arms' perplexities differ by an
    # order of magnitude, and a ratio is what stays comparable across draws
    measures = {a: ([r["mrr"] for r in results[a]], [math.log(r["ppl"]) for r in results[a]]) for a in arms}
    parts = {"ubmoe vs uni (retrieval MRR)": judge(measures["ubmoe"][0], measures["uni"][0], lower_is_better=False,
                                                   paired=True),
             "ubmoe vs full-bi (log ppl geo-mean)": judge(measures["ubmoe"][1], measures["full-bi"][1], paired=True)}
    keeps = {"ubmoe vs uni (log ppl geo-mean)": judge(measures["ubmoe"][1], measures["uni"][1], paired=True)}
    verdict = conclude("ubmoe", parts, "seeds, paired by seed")
    kverdict = conclude("ubmoe generation kept", keeps, "seeds, paired by seed")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    defaults = (("steps", args.steps, 40), ("lr", args.lr, 1e-3), ("batch", args.batch, 16),
                ("seq-len", args.seq_len, 32), ("router-steps", args.router_steps, 60),
                ("router-lr", args.router_lr, 1e-2), ("passages", args.passages, 128),
                ("passage-len", args.passage_len, 96), ("windows", args.windows, 8), ("seeds", args.seeds, 3),
                ("dropout", args.dropout, 0.1), ("temperature", args.temperature, 0.05))
    command = "python benchmarks/ubmoe.py" + "".join(f" --{k} {v}" for k, v, d in defaults if v != d)
    text = "; ".join(f"{r['arm']} MRR {r['MRR']:.4f}" + (f", ppl {r['ppl geo-mean']:.3f}" if "ppl geo-mean" in r
                                                          else "") for r in rows)
    record("ubmoe", CLAIM, verdict,
           f"{verdict_parts(parts)}. Means over seeds: {text}. The full-bi arm is the same contrastive tuning applied "
           "to every decoder-layer weight (the bidirectionally fine-tuned model); the ubmoe arm's tuned FFNs are "
           "read bidirectionally for embeddings and routed per token for generation; generation is judged on log "
           f"perplexity (the mean held-out token loss). {settings}. {SCOPE}.",
           rows, command, MODEL, judgements=parts)
    record("ubmoe", KEEPS, kverdict,
           f"{verdict_parts(keeps)}: ppl geo-mean {mean([r['ppl'] for r in results['ubmoe']]):.3f} (ubmoe) vs "
           f"{mean([r['ppl'] for r in results['uni']]):.3f} (uni), judged on its log (the mean token loss). "
           "'holds' would mean better than the original, 'does not hold' worse by more than the noise; "
           f"'inconclusive' means within the noise of it. {settings}. {SCOPE}.",
           rows, command, MODEL, judgements=keeps)

if __name__ == "__main__":
    main()
