"""The zoo's own MoE against its dense control (same active parameters, same training tokens), in domain (held-out
documents of the training sources) and out of domain (text of other origins), side by side in one run; records
the verdict in docs/claims/zoo-tiny-moe.json and, with --refresh-cards, rewrites the shipped models' eval.json and
the MoE's card (README.md, and its copies in docs/) with both evaluations and what holds where.

    python benchmarks/own_models.py                  # 24 windows of 256 tokens per domain and split
    python benchmarks/own_models.py --refresh-cards
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

import zoo
from zoo import claims
from zoo.data.corpus import DOMAINS
from zoo.eval import evaluate, plot_usage
from zoo.registry import get_model

ROOT = Path(__file__).resolve().parents[1]
MOE, DENSE = "zoo-tiny-moe", "zoo-tiny-dense"
SPLITS = {"perplexity": "held-out", "perplexity_ood": "out of domain"}


def rows_of(results: dict) -> list[dict]:
    return [{"split": label, "domain": d, MOE: results[MOE][key][d], DENSE: results[DENSE][key][d],
             "moe / dense": round(results[MOE][key][d] / results[DENSE][key][d], 4)}
            for key, label in SPLITS.items() for d in DOMAINS]


def where(rows: list[dict], better: bool) -> str:
    picked = [f"{r['domain']} {r['split']}" for r in rows if (r["moe / dense"] < 1) == better]
    return ", ".join(picked) or "nowhere"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--refresh-cards", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = {name: zoo.load(name).eval() for name in (MOE, DENSE)}
    with torch.no_grad():
        results = {name: evaluate(m, max_windows=args.windows) for name, m in models.items()}
    rows = rows_of(results)
    print(f"{'split':15}{'domain':9}{MOE:>14}{DENSE:>16}{'moe / dense':>13}")
    for r in rows:
        print(f"{r['split']:15}{r['domain']:9}{r[MOE]:14.2f}{r[DENSE]:16.2f}{r['moe / dense']:13.3f}")
    wins = sum(r["moe / dense"] < 1 for r in rows)
    verdict = "holds" if wins == len(rows) else "does not hold" if wins == 0 else "holds in part"
    summary = (f"The MoE has the lower perplexity on {where(rows, True)}; the dense control on {where(rows, False)} "
               f"({args.windows} windows of 256 tokens per domain and split; both trained on the same 5.3M tokens).")
    print(f"\nverdict: {verdict}. {summary}")
    command = "python benchmarks/own_models.py" + (f" --windows {args.windows}" if args.windows != 24 else "")
    claims.record(MOE, "a sparse MoE beats its dense control at equal active parameters and training tokens",
                  verdict, summary, rows, command, f"{MOE} vs {DENSE}")
    if args.refresh_cards:
        refresh_cards(models, results, summary)


def refresh_cards(models: dict, results: dict, summary: str) -> None:
    """The shipped folders' eval.json (both models) and the MoE's card and usage plot, with both evaluations."""
    for name, result in results.items():
        folder = Path(get_model(name).local_path)
        (folder / "eval.json").write_text(json.dumps(result, indent=1) + "\n")
    folder = Path(get_model(MOE).local_path)
    card = zoo.card(models[MOE], results[MOE], model_name=MOE, summary=(
        f"`{MOE}`: trained by moe-zoo on its shipped corpus (Shakespeare and Python standard-library source). A "
        f"native checkpoint: plain transformers loads it. Against its dense control `{DENSE}` (same active "
        f"parameters, same tokens): {summary}"))
    card.save(folder / "README.md")
    plot_usage(results[MOE], str(folder / "expert_usage.png"), title=MOE)
    shutil.copyfile(folder / "README.md", ROOT / "docs" / f"{MOE}-card.md")
    shutil.copyfile(folder / "eval.json", ROOT / "docs" / f"{MOE}-eval.json")
    shutil.copyfile(folder / "expert_usage.png", ROOT / "docs" / f"{MOE}-expert-usage.png")


if __name__ == "__main__":
    main()
