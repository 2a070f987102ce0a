"""The zoo's own language models side by side, held out (documents of the training sources never trained on) and out
of domain (text of other origins), under the one verdict rule:

* zoo-tiny-moe against its dense control zoo-tiny-dense (same active parameters, same 5.3M training tokens);
* zoo-tiny-upcycled (Sparse Upcycling: zoo-tiny-dense copied into 8 experts top-2, trained 5.3M more tokens)
  against zoo-tiny-moe (trained from scratch on as many tokens) and, when ``--dense-continued`` gives its folder,
  against zoo-tiny-dense trained on for the same tokens (``moe-zoo train configs/zoo-tiny-dense-continued.json``;
  not shipped). Without that folder the comparison is recorded as untestable here, with the reason.

The models are shipped, already trained and deterministic, so the repeats are evaluation draws: ``--draws`` disjoint
sets of ``--windows`` held-out windows of 256 tokens per domain (``claim_args.draws_geo``), the same for every model,
judged paired (``zoo.evaluation.claims.judge(paired=True)``). The measure of a draw is the geometric mean over the
domains of the held-out perplexity; the out-of-domain split, drawn the same way, is judged beside each claim, not in
its verdict. One trained model per arm: the noise is the evaluation's, not the training seed's.

Records docs/claims/zoo-tiny-moe.json, zoo-tiny-upcycled.json, Mixtral's claim in topk-softmax.json and the long-run
Sparse Upcycling claim in upcycle.json. ``--refresh-cards`` then re-renders the MoEs' cards (the shipped README.md and
its copy in docs/) from the recorded verdicts and the shipped eval.json; ``--cards-only`` does that alone.

    python benchmarks/own_models.py                  # 6 draws x 24 windows per domain and split, one thread
    python benchmarks/own_models.py --dense-continued runs/zoo-tiny-dense-continued/final --refresh-cards
    python benchmarks/own_models.py --quick          # 2 draws x 2 windows; records nothing
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, draw_args, draws_geo, geo, judgement_line, load_model, show, verdict_parts  # noqa: E402
import zoo  # noqa: E402
from zoo.components.registry import get_model  # noqa: E402
from zoo.data.corpus import DOMAINS  # noqa: E402
from zoo.data.tokens import eval_windows, token_stream  # noqa: E402
from zoo.evaluation import claims  # noqa: E402
from zoo.io.atomic import write_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MOE, DENSE, UPCYCLED, CONTINUED = "zoo-tiny-moe", "zoo-tiny-dense", "zoo-tiny-upcycled", "zoo-tiny-dense-continued"
CONTINUED_FOLDER = "runs/zoo-tiny-dense-continued/final"
# what training zoo-tiny-dense-continued costs (configs/zoo-tiny-dense-continued.json), for the untestable entry
CONTINUED_RECIPE = "1300 steps of 16 x 256 tokens (5.3M tokens) from zoo-tiny-dense"
MOE_CLAIM = "a sparse MoE beats its dense control at equal active parameters and training tokens"
MIXTRAL_CLAIM = "a sparse top-2 MoE matches or beats a dense model at far fewer active parameters (Mixtral)"
SCRATCH_CLAIM = ("upcycling a trained dense model beats training the MoE from scratch on as many MoE tokens "
                 "(Sparse Upcycling)")
CONTINUED_CLAIM = "the upcycled dense model trained on beats the dense model trained on for the same tokens (Sparse Upcycling)"
LONG_CLAIM = ("Sparse Upcycling, run long: the upcycled zoo-tiny-dense trained 1300 more steps beats zoo-tiny-dense "
              "trained the same 1300 more steps")


def ood_draws_geo(model, tokenizer, draws: int, windows: int, seq_len: int = 256, batch: int = 8) -> list[float]:
    """``claim_args.draws_geo`` on the out-of-domain split: draw i is windows ``[i * windows, (i + 1) * windows)``
    of each domain's ood stream; [geometric mean over domains of the perplexity, per draw]."""
    every = {d: eval_windows(token_stream(d, "ood", tokenizer), seq_len) for d in DOMAINS}
    short = {d: len(w) for d, w in every.items() if len(w) < draws * windows}
    if short:
        raise ValueError(f"{draws} draws of {windows} windows need {draws * windows} out-of-domain windows per "
                         f"domain; there are {short}")
    out = []
    model.eval()
    with torch.no_grad():
        for i in range(draws):
            ppl = {}
            for domain, ids_all in every.items():
                ids_all, total, count = ids_all[i * windows:(i + 1) * windows], 0.0, 0
                for j in range(0, len(ids_all), batch):
                    ids = ids_all[j:j + batch]
                    n = ids.numel() - ids.shape[0]
                    total, count = total + model(input_ids=ids, labels=ids).loss.float().item() * n, count + n
                ppl[domain] = math.exp(total / count)
            out.append(geo(ppl))
    return out


def measure(models: dict, tokenizer, args) -> dict:
    """{name: {"val": [geo per draw], "ood": [geo per draw], "ppl": {domain: held-out ppl over all the draws}}}."""
    out = {}
    for name, model in models.items():
        t = time.perf_counter()
        val, ppl = draws_geo(model, tokenizer, args.draws, args.windows)
        out[name] = {"val": val, "ood": ood_draws_geo(model, tokenizer, args.draws, args.windows), "ppl": ppl}
        print(f"{name}: held-out geo-mean by draw {'/'.join(f'{g:.3f}' for g in val)}, out of domain "
              f"{'/'.join(f'{g:.3f}' for g in out[name]['ood'])} ({time.perf_counter() - t:.0f} s)", flush=True)
    return out


def rows_of(m: dict) -> list[dict]:
    """One row per model: held-out perplexity per domain over all draws, the geo-means (mean over draws) by split."""
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return [{"model": name, **{f"ppl {d}": round(r["ppl"][d], 3) for d in DOMAINS},
             "held-out geo-mean": round(mean(r["val"]), 3),
             "held-out geo-mean by draw": "/".join(f"{g:.3f}" for g in r["val"]),
             "out-of-domain geo-mean": round(mean(r["ood"]), 3),
             "out-of-domain geo-mean by draw": "/".join(f"{g:.3f}" for g in r["ood"])} for name, r in m.items()]


def compare(m: dict, models: dict, a: str, b: str) -> tuple[dict, dict]:
    """({"a vs b, held-out": judge}, {"a vs b, out of domain (beside ...)": judge}), paired by evaluation draw."""
    same = claims.same_weights(models[a], models[b])
    why = "the two folders hold the same weights" if same else ""
    part = {f"{a} vs {b}, held-out geo-mean ppl": claims.judge(m[a]["val"], m[b]["val"], paired=True,
                                                                same_model=same, why_same=why)}
    beside = {f"{a} vs {b}, out-of-domain geo-mean ppl (beside the claim, not in its verdict)":
              claims.judge(m[a]["ood"], m[b]["ood"], paired=True, same_model=same, why_same=why)}
    return part, beside


def main(argv=None):
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--dense-continued", metavar="FOLDER", help="zoo-tiny-dense trained on for the upcycled "
                    f"model's tokens (configs/{CONTINUED}.json; {CONTINUED_FOLDER})")
    ap.add_argument("--refresh-cards", action="store_true", help="re-render the MoEs' cards after recording")
    ap.add_argument("--cards-only", action="store_true", help="re-render the cards from the recorded verdicts only")
    args = draw_args(ap, draws=6, windows=24).parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cards_only:
        return refresh_cards()
    if args.quick:  # a smoke run of the whole path: 2 draws of 2 windows; records nothing, leaves the cards alone
        args.draws, args.windows, args.no_record, args.refresh_cards = min(args.draws, 2), 2, True, False
    names = {MOE: MOE, DENSE: DENSE, UPCYCLED: UPCYCLED}
    if args.dense_continued:
        names[CONTINUED] = args.dense_continued
    models = {name: load_model(where) for name, where in names.items()}
    tok = zoo.load_tokenizer(MOE)
    m = measure(models, tok, args)
    rows = rows_of(m)
    settings = (f"{args.draws} disjoint evaluation draws of {args.windows} windows x 256 tokens per domain of the "
                f"held-out split (and of the out-of-domain text), the same for every model (paired); measure: the "
                f"geometric mean over domains of the perplexity; one trained model per arm, so the noise is the "
                f"evaluation's, not the training seed's; {args.threads} thread(s)")
    print(f"\n{settings}")
    show(rows)

    pairs = [(MOE, MOE_CLAIM, MOE, DENSE,
              "both trained on the same 5.3M tokens; the comparison is at equal active, not total, parameters"),
             (UPCYCLED, SCRATCH_CLAIM, UPCYCLED, MOE,
              f"{UPCYCLED} is {DENSE} (5.3M tokens) upcycled and trained 5.3M more; {MOE} trained 5.3M from scratch; "
              "the upcycled experts are twice as wide, so twice the active FFN, and its weights saw twice the tokens")]
    if CONTINUED in m:
        pairs.append((UPCYCLED, CONTINUED_CLAIM, UPCYCLED, CONTINUED,
                      f"both start from {DENSE} and train 1300 more steps on the same batches (5.3M tokens, lr 1e-3); "
                      "the upcycled model spends twice the dense FFN compute per token"))
    print()
    judged = []
    for component, claim, a, b, note in pairs:
        part, beside = compare(m, models, a, b)
        verdict = conclude(f"{component}: {claim}", part)
        for name, j in beside.items():
            print("  beside: " + judgement_line(name, j))
        judged.append((component, claim, a, b, note, part, beside, verdict))
    if CONTINUED not in m:
        print(f"\n{UPCYCLED}: {CONTINUED_CLAIM}: untestable here ({untestable_reason()})")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    command = "python benchmarks/own_models.py"
    command += f" --draws {args.draws}" if args.draws != 6 else ""
    command += f" --windows {args.windows}" if args.windows != 24 else ""
    mean = lambda xs: f"{sum(xs) / len(xs):.3f}"  # noqa: E731
    for component, claim, a, b, note, part, beside, verdict in judged:
        summary = (f"{verdict_parts(part)}; {verdict_parts(beside)}. Held-out geo-mean ppl {mean(m[a]['val'])} vs "
                   f"{mean(m[b]['val'])} ({a} vs {b}), out of domain {mean(m[a]['ood'])} vs {mean(m[b]['ood'])}; "
                   f"{note}. Settings: {settings}.")
        owners = [(component, claim)]
        if claim == MOE_CLAIM:
            owners.append(("topk-softmax", MIXTRAL_CLAIM))
            summary += " Mixtral's own comparison is against a dense model with 5x the active parameters."
        if b == CONTINUED:
            owners.append(("upcycle", LONG_CLAIM))
        cmd = command + (f" --dense-continued {CONTINUED_FOLDER}" if b == CONTINUED else "")
        for owner, text in owners:
            claims.record(owner, text, verdict, summary, rows, cmd, f"{a} vs {b}", judgements={**part, **beside})
    if CONTINUED not in m:
        for owner, text in ((UPCYCLED, CONTINUED_CLAIM), ("upcycle", LONG_CLAIM)):
            claims.record(owner, text, "untestable here", untestable_reason() + ".",
                          {"needs": CONTINUED_FOLDER, "made by": f"moe-zoo train configs/{CONTINUED}.json"},
                          command, f"{UPCYCLED} vs {CONTINUED}")
    print("recorded: docs/claims/zoo-tiny-moe.json, zoo-tiny-upcycled.json, topk-softmax.json, upcycle.json")
    if args.refresh_cards:
        refresh_cards()


def untestable_reason() -> str:
    return (f"{CONTINUED} (moe-zoo train configs/{CONTINUED}.json: {CONTINUED_RECIPE}) is not shipped and is not on "
            f"this machine; training it takes about an hour of one CPU core (zoo-tiny-dense trains at ~1.5 s a step "
            f"of 8 x 256 tokens on one thread), beyond this benchmark's budget. With the folder: --dense-continued {CONTINUED_FOLDER}")


def shipped_front_matter(old: str, new: str) -> str:
    """The ``new`` card's body under the ``old`` card's metadata block: the shipped folder's front matter
    (library_name moe-zoo, which tests/test_shipped.py pins) stays; what the verdicts change is the body."""
    head = old[:old.index("\n---\n", 4) + 5] if old.startswith("---\n") else ""
    return head + (new[new.index("\n---\n", 4) + 5:] if new.startswith("---\n") else new)


def refresh_cards() -> None:
    """The MoEs' cards (the shipped README.md and its copy in docs/), rendered from the shipped eval.json (the
    models' evaluation, written when they were made) and the verdicts recorded in docs/claims (the intro, and each
    component's "Does the paper's claim hold here?")."""
    recorded = {e["claim"]: e for c in (MOE, UPCYCLED) for e in claims.load(c)}

    def said(claim: str) -> str:
        e = recorded.get(claim)
        return f"*{claim}*: **{e['verdict']}**. {e['summary']}" if e else f"*{claim}*: not measured yet."

    intros = {
        MOE: f"trained from scratch by moe-zoo on its shipped corpus (Shakespeare and Python standard-library "
             f"source). Against its dense control `{DENSE}` (same active parameters, same tokens), "
             f"{said(MOE_CLAIM)}",
        UPCYCLED: f"Sparse Upcycling of `{DENSE}` (its FFN copied into 8 experts, top-2, random router), then trained "
                  f"by moe-zoo on its shipped corpus for as many tokens as `{MOE}` (`moe-zoo train "
                  f"configs/{UPCYCLED}.json`). Its experts share one origin, like those of MoEs upcycled from a dense "
                  f"model (Qwen1.5-MoE, for one). Against `{MOE}`, {said(SCRATCH_CLAIM)} Against `{DENSE}` trained "
                  f"on for the same tokens, {said(CONTINUED_CLAIM)}",
    }
    for name, intro in intros.items():
        folder = Path(get_model(name).local_path)
        results = json.loads((folder / "eval.json").read_text())
        card = zoo.card(zoo.load(name).eval(), results, model_name=name,
                        summary=f"`{name}`: {intro} A native checkpoint: plain transformers loads it.")
        write_text(folder / "README.md", shipped_front_matter((folder / "README.md").read_text(), card.content),
                   overwrite=True)
        shutil.copyfile(folder / "README.md", ROOT / "docs" / f"{name}-card.md")
        print(f"card: {folder / 'README.md'}, docs/{name}-card.md")


if __name__ == "__main__":
    main()
