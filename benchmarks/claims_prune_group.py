"""prune-group's paper claim on zoo-tiny-mm, recorded with zoo.evaluation.claims (docs/claims/prune-group.json).

REAP's claim: scoring experts by router-weighted output norm (REAP saliency) keeps quality better than scoring
them by routing frequency when one-shot pruning experts. Here within one modality group of zoo-tiny-mm (MoHAVE's
groups: vision 4 experts, audio 4): each group pruned to 3 and to 2 experts by REAP and by frequency (prune-group
draws its own multimodal calibration batches), then digit accuracy on the test split (unseen voices, held-out
images) with the image only, audio only, both, and audio at -5 dB with the image.

    python benchmarks/claims_prune_group.py          # a few minutes on one thread
"""
from __future__ import annotations

import copy

import numpy as np
import torch

import zoo  # noqa: F401  (loads the plugins first)

# isort: split
from zoo.evaluation.claims import record
from zoo_multimodal.evaluate_mm import accuracy, load_model, load_split

MODEL = "zoo-tiny-mm"
SNR = -5


def measure(model, processor, split, image_ids) -> dict:
    return {"image": accuracy(model, processor, split, "image"),
            "audio": accuracy(model, processor, split, "audio", image_ids=image_ids),
            "both": accuracy(model, processor, split, "both", image_ids=image_ids),
            f"both {SNR} dB": accuracy(model, processor, split, "both", snr=SNR, image_ids=image_ids)}


def main():
    torch.set_num_threads(1)
    base, processor = load_model(MODEL)
    split = load_split(processor, "test", snrs=(SNR,))
    rng = np.random.default_rng(0)
    labels = split.image_labels.numpy()
    image_ids = torch.tensor([rng.choice(np.flatnonzero(labels == int(d))) for d in split.audio_labels])
    ref = measure(base, processor, split, image_ids)
    rows = [{"group": "-", "kept": "all", "score": "-", **{k: round(v, 4) for k, v in ref.items()}}]
    print(rows[-1], flush=True)
    # the accuracy that depends on the pruned group: images for vision, audio for audio
    key = {"vision": "image", "audio": "audio"}
    duels = []
    for group in ("vision", "audio"):
        for keep in (3, 2):
            got = {}
            for score in ("reap", "frequency"):
                torch.manual_seed(0)
                model = zoo.apply(copy.deepcopy(base), "prune-group", group=group, num_experts=keep, score=score)
                got[score] = measure(model, processor, split, image_ids)
                rows.append({"group": group, "kept": f"{keep}/4", "score": score,
                             **{k: round(v, 4) for k, v in got[score].items()}})
                print(rows[-1], flush=True)
            duels.append((group, keep, got["reap"][key[group]], got["frequency"][key[group]]))
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r[k]) for k in keys))
    wins = sum(r > f for _, _, r, f in duels)
    ties = sum(r == f for _, _, r, f in duels)
    verdict = ("holds" if wins == len(duels) else "holds in part" if wins + ties >= len(duels) / 2 and wins
               else "does not hold")
    record("prune-group", "REAP saliency (router-weighted expert output norm) keeps quality better than routing "
           "frequency when pruning experts one-shot (REAP), here within one modality group", verdict,
           f"zoo-tiny-mm's vision and audio groups (4 experts each) pruned to 3 and 2 by each score on prune-group's "
           f"own multimodal calibration batches; digit accuracy on the test split (unseen voices, held-out images; "
           f"audio at {SNR} dB with the image too), one thread. Accuracy of the pruned modality, REAP vs frequency: "
           + ", ".join(f"{g} {k}/4: {r:.3f} vs {f:.3f}" for g, k, r, f in duels)
           + f" (REAP better in {wins} of {len(duels)}, equal in {ties}). The paper prunes 50% of experts of "
             "LLMs of 20B-1T parameters and scores on generative tasks.",
           rows, "python benchmarks/claims_prune_group.py", MODEL)


if __name__ == "__main__":
    main()
