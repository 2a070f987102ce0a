"""The zoo's own language models side by side, in domain (held-out documents of the training sources) and out of
domain (text of other origins), in one run:

* zoo-tiny-moe against its dense control zoo-tiny-dense (same active parameters, same 5.3M training tokens);
* zoo-tiny-upcycled (Sparse Upcycling: zoo-tiny-dense copied into 8 experts top-2, trained 5.3M more tokens)
  against zoo-tiny-moe (trained from scratch on as many tokens) and, when ``--dense-continued`` gives its folder,
  against zoo-tiny-dense trained on for the same tokens (``moe-zoo train configs/zoo-tiny-dense-continued.json``;
  not shipped: only its numbers are).

Records the verdicts in docs/claims/zoo-tiny-moe.json and docs/claims/zoo-tiny-upcycled.json (and the long-run
Sparse Upcycling claim in docs/claims/upcycle.json); with --refresh-cards, rewrites the shipped models' eval.json
and the MoEs' cards (README.md, and copies in docs/) with both evaluations and what holds where.

    python benchmarks/own_models.py                  # 24 windows of 256 tokens per domain and split
    python benchmarks/own_models.py --dense-continued runs/zoo-tiny-dense-continued/final --refresh-cards
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

import zoo
from zoo.evaluation import claims
from zoo.data.corpus import DOMAINS
from zoo.evaluation.eval import evaluate, plot_usage
from zoo.components.registry import get_model

ROOT = Path(__file__).resolve().parents[1]
MOE, DENSE, UPCYCLED, CONTINUED = "zoo-tiny-moe", "zoo-tiny-dense", "zoo-tiny-upcycled", "zoo-tiny-dense-continued"
SPLITS = {"perplexity": "held-out", "perplexity_ood": "out of domain"}


def rows_of(results: dict, a: str, b: str) -> list[dict]:
    """Per split and domain: both models' perplexity and their ratio ``a / b``."""
    return [{"split": label, "domain": d, a: results[a][key][d], b: results[b][key][d],
             f"{a} / {b}": round(results[a][key][d] / results[b][key][d], 4)}
            for key, label in SPLITS.items() for d in DOMAINS]


def judged(rows: list[dict], a: str, b: str) -> tuple[str, str]:
    """(verdict, where each model is better) for "``a`` beats ``b``" over every split and domain."""
    ratio = f"{a} / {b}"
    wins = [r for r in rows if r[ratio] < 1]
    verdict = "holds" if len(wins) == len(rows) else "does not hold" if not wins else "holds in part"

    def where(picked):
        return ", ".join(f"{r['domain']} {r['split']}" for r in picked) or "nowhere"
    return verdict, (f"{a} has the lower perplexity on {where(wins)}; {b} on "
                     f"{where([r for r in rows if r[ratio] >= 1])}")


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["  ".join(f"{k:>15}" for k in keys)]
    lines += ["  ".join(f"{v:>15.3f}" if isinstance(v, float) else f"{v:>15}" for v in r.values()) for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dense-continued", metavar="FOLDER", help="zoo-tiny-dense trained on for the upcycled "
                    "model's tokens (configs/zoo-tiny-dense-continued.json)")
    ap.add_argument("--refresh-cards", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = {MOE: MOE, DENSE: DENSE, UPCYCLED: UPCYCLED}
    if args.dense_continued:
        names[CONTINUED] = args.dense_continued
    models = {name: zoo.load(where).eval() for name, where in names.items()}
    tok = zoo.load_tokenizer(MOE)
    with torch.no_grad():
        results = {name: evaluate(m, tok, max_windows=args.windows) for name, m in models.items()}
    settings = f"{args.windows} windows of 256 tokens per domain and split"
    command = "python benchmarks/own_models.py" + (f" --windows {args.windows}" if args.windows != 24 else "")
    summaries = {}

    def compare(a, b, owner, claim, note, also=()):
        rows = rows_of(results, a, b)
        verdict, where = judged(rows, a, b)
        print(f"\n{claim}\n{table(rows)}\nverdict: {verdict}. {where}")
        summary = f"{where} ({settings}; {note})."
        for component, text in ((owner, claim), *also):
            claims.record(component, text, verdict, summary, rows,
                          command + (" --dense-continued runs/zoo-tiny-dense-continued/final" if b == CONTINUED
                                     else ""), f"{a} vs {b}")
        return summary

    summaries[MOE] = compare(MOE, DENSE, MOE, "a sparse MoE beats its dense control at equal active parameters "
                             "and training tokens", "both trained on the same 5.3M tokens; a comparison at equal active, not "
                             "total, parameters: Mixtral's own is against a dense model with 5x the active parameters",
                             also=[("topk-softmax", "a sparse top-2 MoE matches or beats a dense model at far fewer "
                                    "active parameters (Mixtral)")])
    summaries[UPCYCLED] = compare(
        UPCYCLED, MOE, UPCYCLED, "upcycling a trained dense model beats training the MoE from scratch on as many "
        "MoE tokens (Sparse Upcycling)", f"{UPCYCLED} is {DENSE} (5.3M tokens) upcycled and trained 5.3M more; "
        f"{MOE} trained 5.3M from scratch; the upcycled experts are twice as wide, so twice the active FFN")
    if CONTINUED in results:
        note = (f"both start from {DENSE} and train 1300 more steps on the same batches (5.3M tokens, lr 1e-3); the "
                "upcycled model spends twice the dense FFN compute per token")
        summaries[CONTINUED] = compare(UPCYCLED, CONTINUED, UPCYCLED, "the upcycled dense model trained on beats "
                                       "the dense model trained on for the same tokens (Sparse Upcycling)", note)
        compare(UPCYCLED, CONTINUED, "upcycle", "Sparse Upcycling, run long: the upcycled zoo-tiny-dense trained "
                "1300 more steps beats zoo-tiny-dense trained the same 1300 more steps", note)
    if args.refresh_cards:
        refresh_cards(models, results, summaries)


def refresh_cards(models: dict, results: dict, summaries: dict) -> None:
    """The shipped folders' eval.json and the MoEs' cards and usage plots, with both evaluations."""
    for name, result in results.items():
        if name != CONTINUED:
            (Path(get_model(name).local_path) / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    intros = {
        MOE: f"trained from scratch by moe-zoo on its shipped corpus (Shakespeare and Python standard-library "
             f"source). Against its dense control `{DENSE}` (same active parameters, same tokens): {summaries[MOE]}",
        UPCYCLED: f"Sparse Upcycling of `{DENSE}` (its FFN copied into 8 experts, top-2, random router), then trained "
                  f"by moe-zoo on its shipped corpus for as many tokens as `{MOE}` (`moe-zoo train "
                  f"configs/{UPCYCLED}.json`). Its experts share one origin, like those of MoEs upcycled from a dense "
                  f"model (Qwen1.5-MoE, for one). Against `{MOE}`: {summaries[UPCYCLED]}"
                  + (f" Against `{DENSE}` trained on for the same tokens: {summaries[CONTINUED]}"
                     if CONTINUED in summaries else ""),
    }
    for name, intro in intros.items():
        folder = Path(get_model(name).local_path)
        card = zoo.card(models[name], results[name], model_name=name,
                        summary=f"`{name}`: {intro} A native checkpoint: plain transformers loads it.")
        card.save(folder / "README.md")
        plot_usage(results[name], str(folder / "expert_usage.png"), title=name)
        shutil.copyfile(folder / "README.md", ROOT / "docs" / f"{name}-card.md")
        shutil.copyfile(folder / "eval.json", ROOT / "docs" / f"{name}-eval.json")
        shutil.copyfile(folder / "expert_usage.png", ROOT / "docs" / f"{name}-expert-usage.png")


if __name__ == "__main__":
    main()
