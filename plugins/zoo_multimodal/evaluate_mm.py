"""Evaluate a zoo_mm model on the test split (unseen voices, held-out images): accuracy per modality, per
SNR of added white noise (with and without the image), and expert-group usage per token modality."""
from __future__ import annotations

import numpy as np
import torch

from zoo_multimodal import digits as dm
from zoo_multimodal.dataset import batch, load_split
from zoo.moe.context import AUDIO, TEXT, VISION

SNRS = (20, 10, 5, 0, -5, -10)
PROMPT = "which digit ?"
MODALITY_NAMES = {TEXT: "text", VISION: "vision", AUDIO: "audio"}


def load_model(name_or_path):
    import os

    from transformers import AutoProcessor

    import zoo
    from zoo.io.loading import resolve_path

    path = resolve_path(os.fspath(name_or_path))
    return zoo.load(path).eval(), AutoProcessor.from_pretrained(path)


@torch.no_grad()
def accuracy(model, processor, split, mode, snr=None, image_ids=None, size=120) -> float:
    candidates = processor.digit_token_ids(dm.WORDS)
    digits = split.image_labels if mode == "image" else split.audio_labels
    right = 0
    for start in range(0, len(digits), size):
        d = digits[start:start + size]
        ids = torch.arange(start, start + len(d))
        inputs = batch(processor, split, d, [mode] * len(d), image_ids=ids if mode == "image" else image_ids[ids],
                       audio_ids=ids if mode != "image" else ids % len(split.audio_labels), snr=snr,
                       prompts=[PROMPT] * len(d), answers=False)
        right += (model.answer_probs(inputs, candidates).argmax(-1) == d).sum().item()
    return right / len(digits)


@torch.no_grad()
def group_usage(model, processor, split, image_ids, snr=None, size=120) -> list[dict]:
    """Per decoder layer: for each token modality, the group gate's mean probability and the share of tokens
    whose top group is each group."""
    layers = [layer.mlp for layer in model.model.layers]
    seen = [[] for _ in layers]
    hooks = [moe.router.register_forward_hook(lambda m, a, o, j=j: seen[j].append(m.group_probs(a[0])))
             for j, moe in enumerate(layers)]
    kinds = []
    try:
        d = split.audio_labels
        for start in range(0, len(d), size):
            ids = torch.arange(start, min(start + size, len(d)))
            inputs = batch(processor, split, d[ids], ["both"] * len(ids), image_ids=image_ids[ids], audio_ids=ids,
                           snr=snr, prompts=[PROMPT] * len(ids), answers=False)
            _, keys, kind = model.model(**{k: v for k, v in inputs.items() if k != "labels"})
            kinds.append(torch.where(keys.bool(), kind[None, :], -1).reshape(-1))
    finally:
        for h in hooks:
            h.remove()
    kinds = torch.cat(kinds)
    out = []
    for moe, probs in zip(layers, seen):
        probs = torch.cat(probs)
        groups = moe.experts.groups
        row = {}
        for m, name in MODALITY_NAMES.items():
            p = probs[kinds == m]
            top = torch.bincount(p.argmax(-1), minlength=len(groups)).double() / max(1, len(p))
            row[name] = {"mean_prob": dict(zip(groups, p.mean(0).tolist())), "top_share": dict(zip(groups, top.tolist()))}
        out.append(row)
    return out


def evaluate(name_or_path, snrs=SNRS) -> dict:
    model, processor = load_model(name_or_path)
    split = load_split(processor, "test", snrs=snrs)
    rng = np.random.default_rng(0)
    labels = split.image_labels.numpy()
    image_ids = torch.tensor([rng.choice(np.flatnonzero(labels == int(d))) for d in split.audio_labels])
    res = {"test": {"images": len(split.image_labels), "clips": len(split.audio_labels),
                    "voices": list(dm.TEST_VOICES)},
           "accuracy": {"image": accuracy(model, processor, split, "image"),
                        "audio": accuracy(model, processor, split, "audio", image_ids=image_ids),
                        "both": accuracy(model, processor, split, "both", image_ids=image_ids)},
           "snr": {str(s): {"audio": accuracy(model, processor, split, "audio", snr=s, image_ids=image_ids),
                            "both": accuracy(model, processor, split, "both", snr=s, image_ids=image_ids)}
                   for s in snrs},
           "group_usage": group_usage(model, processor, split, image_ids),
           "group_usage_noisy": {str(snrs[-1]): group_usage(model, processor, split, image_ids, snr=snrs[-1])}}
    return res


def format_results(res: dict) -> str:
    acc = res["accuracy"]
    lines = ["| condition | audio only | audio + image |", "|---|---|---|",
             f"| image only | - | {acc['image']:.3f} (image only) |", f"| clean audio | {acc['audio']:.3f} | {acc['both']:.3f} |"]
    lines += [f"| audio at {s} dB SNR | {r['audio']:.3f} | {r['both']:.3f} |" for s, r in res["snr"].items()]
    lines += ["", "Top-group share per token modality (rows) and expert group (columns), per layer:"]
    for i, layer in enumerate(res["group_usage"]):
        groups = list(next(iter(layer.values()))["top_share"])
        lines += [f"layer {i}: | modality | " + " | ".join(groups) + " |"]
        lines += [f"  | {m} | " + " | ".join(f"{v:.2f}" for v in u["top_share"].values()) + " |" for m, u in layer.items()]
    return "\n".join(lines)


def plot_usage(res: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    usage = res["group_usage"]
    fig, axes = plt.subplots(1, len(usage), figsize=(3.2 * len(usage), 3), squeeze=False)
    for ax, (i, layer) in zip(axes[0], enumerate(usage)):
        mods = list(layer)
        groups = list(layer[mods[0]]["mean_prob"])
        grid = np.array([[layer[m]["mean_prob"][g] for g in groups] for m in mods])
        ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
        for (r, c), v in np.ndenumerate(grid):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_yticks(range(len(mods)), [f"{m} tokens" for m in mods])
        ax.set_title(f"layer {i}: group gate")
    fig.suptitle("zoo_mm: mean group-gate probability per token modality (clean audio + image)")
    fig.tight_layout()
    from zoo.io.atomic import atomic_file

    try:
        with atomic_file(path) as staged:
            fig.savefig(staged, dpi=100, format="png")
    finally:
        plt.close(fig)
