"""Multimodal digits benchmark: accuracy of a zoo_mm model (default the shipped zoo-tiny-mm) on unseen voices
and held-out images, image only / audio only / both, audio with white noise at several SNRs with and without
the image, and expert-group usage per token modality (saved as a plot).

    python benchmarks/multimodal.py [MODEL] [--plot out/multimodal_groups.png] [--snrs 20,0,-10]

``--claim`` measures MoHAVE's claims instead: zoo_mm models are trained with the zoo-tiny-mm recipe for ``--steps``
steps from each of ``--seeds`` seeds, each seed once with the group-load biasing loss (groups bound to their
modalities) and once without, and evaluated: the share of each modality's tokens whose top group is the group that
serves it, accuracy with both modalities, and the gain from adding the image to noisy audio. Each claim part is
decided by the one rule (``zoo.evaluation.claims.judge``, paired by seed; ``combine`` for several parts) and
recorded in docs/claims/hierarchical-modality.json and docs/claims/modality-groups.json.

    python benchmarks/multimodal.py --claim --steps 800 --seeds 3
    python benchmarks/multimodal.py --claim --quick     # 2 seeds x 20 steps, lowest SNR only; records nothing

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


MODALITIES = ("text", "vision", "audio")


def bound_mean(res: dict) -> float:
    """The bound share of a run: the mean over modalities of ``bound_share``."""
    return sum(bound_share(res, m) for m in MODALITIES) / len(MODALITIES)


def _line(name: str, j: dict) -> str:
    """One part as decided: "<name>: <verdict>, margin .. vs noise .. over n seeds[, paired by seed] (..)"."""
    return (f"{name}: {j['verdict']}, margin {j['margin']:.4g} vs noise {j['noise']:.4g} over {j['repeats']} seeds"
            f"{', paired by seed' if j['paired'] else ''} ({j['reason']})")


def no_cost(j: dict) -> dict:
    """A "no cost" part read from ``judge``'s result: it holds unless the mechanism is worse by more than the noise
    (then it does not hold). Within the noise it holds only in that sense: a cost smaller than the noise is not
    excluded by these seeds, and the reason says so. ``judge_verdict`` keeps the rule's own verdict."""
    if j["verdict"] == "does not hold":
        return {**j, "judge_verdict": j["verdict"], "reason": f"costs accuracy: {j['reason']}"}
    reason = (f"no cost beyond the noise: {j['reason']} (a cost below the noise {j['noise']:.4g} is not excluded)"
              if j["verdict"] == "inconclusive" else f"no cost, rather a gain: {j['reason']}")
    return {**j, "verdict": "holds", "judge_verdict": j["verdict"], "reason": reason}


def claim(args) -> None:
    """MoHAVE's claims under the one rule: both arms (with / without the group-load biasing loss, everything else
    the same) are trained from each of ``--seeds`` seeds; each claim part is ``judge``'s verdict on the seeds'
    measures, paired by seed (``train(seed=s)`` seeds torch before the model is built and a numpy generator that
    alone draws the batches, so both arms of a seed start from the same weights and see the same batches in the same
    order; the test split and its image pairing are fixed), and a claim combines its parts (``combine``)."""
    import time

    from zoo.evaluation.claims import combine, judge
    from zoo_multimodal.commands import RECIPE
    from zoo_multimodal.dataset import load_split
    from zoo_multimodal.processing_zoo_mm import ZooMMProcessor
    from zoo_multimodal.train_mm import TRAIN_SNRS, train

    started = time.perf_counter()
    zoo.load_plugins()
    if args.quick:  # a smoke run of the whole path: 2 seeds, 20 steps, the lowest SNR only; records nothing
        args.seeds, args.steps, args.snrs = min(args.seeds, 2), min(args.steps, 20), args.snrs.split(",")[-1]
        args.no_record = True
    if args.seeds < 2:
        raise SystemExit("--seeds must be at least 2: one run has no noise to compare against")
    snrs = tuple(int(s) for s in args.snrs.split(","))
    low = str(min(snrs))
    processor = ZooMMProcessor()
    split = load_split(processor, "train", snrs=TRAIN_SNRS)  # the same training data for every run
    arms = (("without group-load biasing", 0.0), (f"group-load biasing {args.group_bias:g}", args.group_bias))
    rows, measures = [], {label: {"bound": [], "both": [], "gain": []} for label, _ in arms}
    for seed in range(args.seeds):
        for label, bias in arms:
            t = time.perf_counter()
            model, _, history = train(steps=args.steps, seed=seed, log_every=0, group_bias=bias, split=split,
                                      processor=processor, **RECIPE)
            with tempfile.TemporaryDirectory() as folder:
                model.save_pretrained(folder)
                processor.save_pretrained(folder)
                res = evaluate(folder, snrs=snrs)
            if not args.quick:
                print(f"\n{label}, seed {seed} (final train loss {sum(history[-50:]) / len(history[-50:]):.4f})\n"
                      f"{format_results(res)}")
            row = {"run": label, "seed": seed}
            for m in MODALITIES:
                row[f"{m} tokens in {m} group"] = round(bound_share(res, m), 3)
            row["bound share (mean)"] = round(bound_mean(res), 4)
            row["acc image"] = round(res["accuracy"]["image"], 3)
            row["acc audio"] = round(res["accuracy"]["audio"], 3)
            row["acc both"] = round(res["accuracy"]["both"], 3)
            row[f"acc audio {low}dB"] = round(res["snr"][low]["audio"], 3)
            row[f"acc both {low}dB"] = round(res["snr"][low]["both"], 3)
            row[f"image gain {low}dB"] = round(res["snr"][low]["both"] - res["snr"][low]["audio"], 4)
            rows.append(row)
            measures[label]["bound"].append(bound_mean(res))
            measures[label]["both"].append(res["accuracy"]["both"])
            measures[label]["gain"].append(res["snr"][low]["both"] - res["snr"][low]["audio"])
            print(f"{label}, seed {seed}: {time.perf_counter() - t:.0f} s", flush=True)
    control, mechanism = (measures[label] for label, _ in arms)

    def part(measure: str) -> dict:  # higher is better for every measure here
        return judge(mechanism[measure], control[measure], lower_is_better=False, paired=True)

    bound_part = part("bound")
    hm1 = {"bound share (mean over modalities of m tokens in m group)": bound_part,
           "accuracy with both modalities (no cost)": no_cost(part("both"))}
    hm2 = {f"image gain at {low} dB (acc both - acc audio)": part("gain")}
    mg = {"bound share (mean over modalities of m tokens in m group)": bound_part}
    claims = [("hierarchical-modality", "the group-load biasing loss makes each expert group serve its modality, at "
               "no accuracy cost", hm1),
              ("hierarchical-modality", "with modality groups the model leans on the image when the audio is noisy",
               hm2),
              ("modality-groups", "expert groups become modality-specific (each modality's tokens go to its own group)",
               mg)]
    verdicts = [combine(j["verdict"] for j in parts.values()) for _, _, parts in claims]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("\n" + " | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    for (component, text, parts), verdict in zip(claims, verdicts):
        print(f"\n{component}: {text}: {verdict}")
        for name, j in parts.items():
            print("  - " + _line(name, j))
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    seeds = ", ".join(map(str, range(args.seeds)))
    setting = (f"zoo_mm trained with the zoo-tiny-mm recipe for {args.steps} steps (batch 48, one thread) from seeds "
               f"{seeds}, each seed once with MoHAVE's group-load biasing loss (weight {args.group_bias:g}, each "
               "group bound to its modality) and once without, everything else the same; both arms of a seed start "
               "from the same weights and see the same batches, so each part is judged paired by seed (noise: the "
               "spread of the per-seed differences). Test split: unseen voices, held-out images. Bound share: the "
               "mean over modalities (text, vision, audio) of the mean over layers of a modality's real tokens whose "
               "top group is its own group (clean audio + image).")
    command = "python benchmarks/multimodal.py --claim" + (f" --steps {args.steps}" if args.steps != 800 else "") \
        + (f" --seeds {args.seeds}" if args.seeds != 3 else "")
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    share = lambda label: {m: round(mean([r[f"{m} tokens in {m} group"] for r in rows if r["run"] == label]), 3)  # noqa: E731
                           for m in MODALITIES}
    with_loss, without = share(arms[1][0]), share(arms[0][0])
    acc = hm1["accuracy with both modalities (no cost)"]
    gain = hm2[f"image gain at {low} dB (acc both - acc audio)"]
    cost = ("not worse beyond the noise (a cost below the noise is not excluded by these seeds)"
            if acc["judge_verdict"] == "inconclusive" else "better beyond the noise" if acc["judge_verdict"] == "holds"
            else "worse beyond the noise")
    summaries = [
        f"{setting} Bound share with the loss {bound_part['mechanism']:.3f} ({with_loss}), without "
        f"{bound_part['control']:.3f} ({without}): {bound_part['verdict']}; the loss optimises the very share "
        f"measured, so this part is near-tautological. Accuracy with both modalities {acc['mechanism']:.3f} with "
        f"the loss vs {acc['control']:.3f} without (margin {acc['margin']:+.3f}, noise {acc['noise']:.3f}): "
        f"{cost}.",
        f"{setting} The measure is the gain from adding the image at {low} dB SNR (acc both - acc audio), with the "
        f"loss vs without it: {gain['mechanism']:+.3f} vs {gain['control']:+.3f} (margin {gain['margin']:+.3f}, "
        f"noise {gain['noise']:.3f}). Both arms lean on the image when the audio is noisy; the claim is about "
        "what the groups add to that.",
        f"{setting} With the loss: {with_loss}; without: {without}."]
    for (component, text, parts), verdict, summary in zip(claims, verdicts, summaries):
        record(component, text, verdict, summary, rows, command, "zoo_mm (retrained)", judgements=parts)
    print("recorded: docs/claims/hierarchical-modality.json, docs/claims/modality-groups.json")


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
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (--claim; the judge needs at least 2)")
    parser.add_argument("--quick", action="store_true",
                        help="--claim smoke run: 2 seeds, 20 steps, the lowest SNR only; prints the verdicts, records nothing")
    parser.add_argument("--no-record", action="store_true", help="--claim: print the verdicts, record nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.claim or args.quick:
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
