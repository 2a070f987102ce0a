"""Multimodal digits benchmark: accuracy of a zoo_mm model (default the shipped zoo-tiny-mm) on unseen voices
and held-out images, image only / audio only / both, audio with white noise at several SNRs with and without
the image, and expert-group usage per token modality (saved as a plot).

    python benchmarks/multimodal.py [MODEL] [--plot out/multimodal_groups.png] [--snrs 20,0,-10]

``--claim`` measures MoHAVE's claims instead: two zoo_mm models are trained from the same seed with the
zoo-tiny-mm recipe for ``--steps`` steps, one with the group-load biasing loss (groups bound to their modalities)
and one without, and both are evaluated side by side: the share of each modality's tokens whose top group is the
group that serves it, and accuracy with noisy audio with and without the image. The verdicts are recorded in
docs/claims/hierarchical-modality.json and docs/claims/modality-groups.json.

    python benchmarks/multimodal.py --claim --steps 800

``--ship`` retrains the shipped zoo-tiny-mm with its recipe (``moe-zoo digits-mm train``: 800 steps, the group-load
biasing loss on) into its folder and rewrites its eval.json, group_usage.png and card.

    python benchmarks/multimodal.py --ship
"""
import argparse
import json
import os
import tempfile

import torch

import zoo  # noqa: F401  (loads the plugins first)

# isort: split
from zoo_multimodal.evaluate_mm import SNRS, evaluate, format_results, load_model, plot_usage


def bound_share(res: dict, modality: str) -> float:
    """Mean over layers of the share of ``modality``'s tokens whose top group is the group named after it."""
    layers = res["group_usage"]
    return sum(layer[modality]["top_share"][modality] for layer in layers) / len(layers)


def claim(args) -> None:
    from zoo.evaluation.claims import record
    from zoo_multimodal.commands import RECIPE
    from zoo_multimodal.train_mm import train

    zoo.load_plugins()
    snrs = tuple(int(s) for s in args.snrs.split(","))
    runs = {}
    for label, bias in (("without group-load biasing", 0.0), (f"group-load biasing {args.group_bias:g}", args.group_bias)):
        model, processor, history = train(steps=args.steps, seed=0, log_every=0, group_bias=bias, **RECIPE)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            processor.save_pretrained(folder)
            runs[label] = evaluate(folder, snrs=snrs)
        print(f"\n{label} (final train loss {sum(history[-50:]) / 50:.4f})\n{format_results(runs[label])}")
    low = str(min(snrs))
    rows = []
    for label, res in runs.items():
        row = {"run": label}
        for m in ("text", "vision", "audio"):
            row[f"{m} tokens in {m} group"] = round(bound_share(res, m), 3)
        row["acc image"] = round(res["accuracy"]["image"], 3)
        row["acc audio"] = round(res["accuracy"]["audio"], 3)
        row["acc both"] = round(res["accuracy"]["both"], 3)
        row[f"acc audio {low}dB"] = round(res["snr"][low]["audio"], 3)
        row[f"acc both {low}dB"] = round(res["snr"][low]["both"], 3)
        rows.append(row)
    plain, biased = rows
    bound = {m: biased[f"{m} tokens in {m} group"] for m in ("text", "vision", "audio")}
    before = {m: plain[f"{m} tokens in {m} group"] for m in ("text", "vision", "audio")}
    binds = all(v >= 0.9 for v in bound.values())
    robust = biased[f"acc both {low}dB"] > biased[f"acc audio {low}dB"]
    kept = biased["acc both"] >= plain["acc both"] - 0.02
    setting = (f"zoo_mm trained from seed 0 with the zoo-tiny-mm recipe for {args.steps} steps (batch 48, one "
               "thread), once with MoHAVE's group-load biasing loss (weight "
               f"{args.group_bias:g}, each group bound to its modality) and once without; test split: unseen voices, "
               "held-out images. Shares are the mean over layers of a modality's real tokens whose top group is its "
               "own group (clean audio + image).")
    command = f"python benchmarks/multimodal.py --claim --steps {args.steps}"
    verdict = "holds" if binds and kept else "holds in part" if binds or kept else "does not hold"
    record("hierarchical-modality", "the group-load biasing loss makes each expert group serve its modality, at no "
           "accuracy cost", verdict, setting + f" With it: {bound}; without: {before}. Accuracy with both "
           f"modalities {biased['acc both']} vs {plain['acc both']} without the loss.", rows, command, "zoo_mm (retrained)")
    verdict = "holds" if robust else "does not hold"
    record("hierarchical-modality", "with modality groups the model leans on the image when the audio is noisy",
           verdict, setting + f" At {low} dB SNR: audio only {biased[f'acc audio {low}dB']}, audio + image "
           f"{biased[f'acc both {low}dB']} (with the loss).", rows, command, "zoo_mm (retrained)")
    verdict = "holds" if binds else "holds in part" if all(bound[m] > before[m] for m in bound) else "does not hold"
    record("modality-groups", "expert groups become modality-specific (each modality's tokens go to its own group)",
           verdict, setting + f" With the loss: {bound}; without: {before}.", rows, command, "zoo_mm (retrained)")
    print(f"recorded: docs/claims/hierarchical-modality.json, docs/claims/modality-groups.json")


def ship(args) -> None:
    from pathlib import Path

    from click.testing import CliRunner

    from zoo.cli import cli
    from zoo.components.plugins import commands_hook
    from zoo.components.registry import get_model

    commands_hook(cli)  # the plugins' commands (digits-mm), as moe-zoo's main adds them
    folder = Path(get_model("zoo-tiny-mm").local_path)
    run = CliRunner().invoke(cli, ["digits-mm", "train", "--out", str(folder), "--steps", str(args.steps),
                                   "--group-bias", str(args.group_bias)], catch_exceptions=False)
    print(run.output)
    if run.exit_code:
        raise SystemExit(run.exit_code)
    results = evaluate(str(folder))
    print(format_results(results))
    (folder / "eval.json").write_text(json.dumps(results, indent=1) + "\n")
    plot_usage(results, folder / "group_usage.png")
    model, _ = load_model(str(folder))
    acc = results["accuracy"]
    rows = [f"| image only | – | {acc['image']:.3f} |", f"| clean audio | {acc['audio']:.3f} | {acc['both']:.3f} |"]
    rows += [f"| audio at {s} dB SNR | {r['audio']:.3f} | {r['both']:.3f} |" for s, r in results["snr"].items()]
    test = results["test"]
    summary = (
        "A small multimodal decoder (text + image patches + audio frames) with MoHAVE modality-group experts and "
        "Parrot language-conditioned visual experts, trained with MoHAVE's group-load biasing loss (each decoder "
        "layer's group gate bound to the modality its group serves).\n\n## Evaluation\n\nDigit accuracy on the "
        f"held-out split ({test['images']} images, {test['clips']} clips from the unseen voices "
        f"{', '.join(test['voices'])}), from `moe-zoo digits-mm eval` (`eval.json`):\n\n"
        "| condition | audio only | audio + image |\n|---|---|---|\n" + "\n".join(rows) + "\n\n"
        "Expert-group usage per modality: `group_usage.png`.")
    zoo.card(model, model_name="zoo-tiny-mm", summary=summary).save(folder / "README.md")
    print(f"shipped: {folder}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="zoo-tiny-mm")
    parser.add_argument("--plot", default="out/multimodal_groups.png")
    parser.add_argument("--snrs", default=",".join(map(str, SNRS)))
    parser.add_argument("--claim", action="store_true", help="train with and without group-load biasing, record")
    parser.add_argument("--ship", action="store_true", help="retrain the shipped zoo-tiny-mm and refresh its card")
    parser.add_argument("--steps", type=int, default=800, help="training steps per model (--claim, --ship)")
    parser.add_argument("--group-bias", type=float, default=0.1, help="weight of the group-load biasing loss")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.claim:
        return claim(args)
    if args.ship:
        return ship(args)
    results = evaluate(args.model, snrs=tuple(int(s) for s in args.snrs.split(",")))
    print(format_results(results))
    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plot_usage(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
