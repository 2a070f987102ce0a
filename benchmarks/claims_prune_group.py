"""prune-group's paper claim on zoo-tiny-mm, recorded with zoo.evaluation.claims (docs/claims/prune-group.json).

REAP's claim: scoring experts by router-weighted output norm (REAP saliency) keeps quality better than scoring
them by routing frequency when one-shot pruning experts. Here within one modality group of zoo-tiny-mm (MoHAVE's
groups: vision 4 experts, audio 4): each group pruned to 3 and to 2 experts by REAP and by frequency, the same
pruning with only the score changed (the control lacks only REAP's saliency), then digit accuracy of the pruned
modality (images for vision, audio clips for audio) on the test split (unseen voices, held-out images).

Each part is decided by the one rule (``zoo.evaluation.claims.judge``). Pruning is calibrated, so the repeats are
calibration draws: repeat i of both arms is scored on prune-group's multimodal calibration batches of seed i and
evaluated on disjoint evaluation draw i (a fixed shuffle of the test split's images and clips cut into ``--draws``
parts; paired). Accuracy with both modalities, and with the audio at -5 dB, is shown beside.

    python benchmarks/claims_prune_group.py            # 3 draws of ~120 images and clips, about a minute per draw
    python benchmarks/claims_prune_group.py --quick    # 2 draws of 40, both groups to 2 experts; records nothing
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np
import torch

import zoo  # noqa: F401  (loads the plugins first)

# isort: split
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, verdict_parts  # noqa: E402
from zoo.evaluation.claims import judge, record, same_weights
from zoo_multimodal.dataset import Split, calibration_batches
from zoo_multimodal.evaluate_mm import accuracy, load_model, load_split

MODEL = "zoo-tiny-mm"
SNR = -5
KEY = {"vision": "image", "audio": "audio"}  # the accuracy that depends on the pruned group
CLAIM = ("REAP saliency (router-weighted expert output norm) keeps quality better than routing frequency when "
         "pruning experts one-shot (REAP), here within one modality group")


def draws(split: Split, count: int, size: int | None = None) -> list[tuple[Split, torch.Tensor]]:
    """``count`` disjoint parts of ``split`` (a fixed shuffle of its images and of its clips, cut in order), each with
    an image of the clip's digit from the same part for every clip (the audio-visual inputs)."""
    rng = np.random.default_rng(0)
    images, clips = rng.permutation(len(split.image_labels)), rng.permutation(len(split.audio_labels))
    out = []
    for i in range(count):
        im = torch.as_tensor(np.array_split(images, count)[i][:size])
        cl = torch.as_tensor(np.array_split(clips, count)[i][:size])
        part = Split(split.images[im], split.image_labels[im], {k: v[cl] for k, v in split.audio.items()},
                     split.audio_labels[cl])
        labels = part.image_labels.numpy()
        image_ids = torch.tensor([rng.choice(np.flatnonzero(labels == int(d))) for d in part.audio_labels])
        out.append((part, image_ids))
    return out


def measure(model, processor, part, image_ids, snrs) -> dict:
    got = {"image": accuracy(model, processor, part, "image"),
           "audio": accuracy(model, processor, part, "audio", image_ids=image_ids),
           "both": accuracy(model, processor, part, "both", image_ids=image_ids)}
    return {**got, **{f"both {s} dB": accuracy(model, processor, part, "both", snr=s, image_ids=image_ids)
                      for s in snrs}}


def main(argv=None):
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=3, help="calibration / disjoint evaluation draws (the repeats)")
    ap.add_argument("--quick", action="store_true", help="2 draws of 40, both groups to 2 experts; records nothing")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    size, keeps, snrs = (40, (2,), ()) if args.quick else (None, (3, 2), (SNR,))
    args.draws = min(args.draws, 2) if args.quick else args.draws
    base, processor = load_model(MODEL)
    parts = draws(load_split(processor, "test", snrs=snrs), args.draws, size)
    acc, same = {}, {}
    for i, (part, image_ids) in enumerate(parts):  # repeat i: calibration seed i, evaluation draw i
        cal = calibration_batches(base, seed=i)
        acc.setdefault(("-", "all", "-"), []).append(measure(base, processor, part, image_ids, snrs))
        for group in ("vision", "audio"):
            for keep in keeps:
                models = {}
                for score in ("reap", "frequency"):
                    torch.manual_seed(i)
                    models[score] = zoo.apply(copy.deepcopy(base), "prune-group", group=group, num_experts=keep,
                                              score=score, calibration=cal)
                    acc.setdefault((group, keep, score), []).append(
                        measure(models[score], processor, part, image_ids, snrs))
                same[group, keep] = same.get((group, keep), True) and same_weights(models["reap"],
                                                                                   models["frequency"])
        print(f"draw {i}: {time.perf_counter() - started:.0f} s", flush=True)
    rows = [{"group": g, "kept": k if k == "all" else f"{k}/4", "score": s,
             **{m: round(sum(a[m] for a in per) / len(per), 4) for m in per[0]},
             "pruned modality by draw": "/".join(f"{a[KEY.get(g, 'image')]:.3f}" for a in per)}
            for (g, k, s), per in acc.items()]
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    judgements = {}
    for group in ("vision", "audio"):
        for keep in keeps:
            reap, freq = ([a[KEY[group]] for a in acc[group, keep, s]] for s in ("reap", "frequency"))
            judgements[f"{group} {keep}/4: REAP vs frequency"] = judge(
                reap, freq, lower_is_better=False, paired=True, same_model=same[group, keep],
                why_same="both scores kept the same experts" if same[group, keep] else "")
    verdict = conclude(CLAIM, judgements, "paired draws")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.quick else ""))
    if args.quick:
        return
    n = "/".join(str(len(p.image_labels)) for p, _ in parts), "/".join(str(len(p.audio_labels)) for p, _ in parts)
    record("prune-group", CLAIM, verdict,
           f"{verdict_parts(judgements)}. zoo-tiny-mm's vision and audio groups (4 experts each) pruned to 3 and 2 by "
           f"each score; repeat i of both arms scored on prune-group's multimodal calibration batches of seed i (4 x "
           f"32) and evaluated on disjoint evaluation draw i of the test split (unseen voices, held-out images; "
           f"{n[0]} images and {n[1]} clips per draw); measure: accuracy of the pruned modality (higher is better), "
           f"paired by draw; one thread. The paper prunes 50% of experts of LLMs of 20B-1T parameters and scores on "
           f"generative tasks.", rows, "python benchmarks/claims_prune_group.py"
           + (f" --draws {args.draws}" if args.draws != 3 else ""), MODEL, judgements=judgements)


if __name__ == "__main__":
    main()
