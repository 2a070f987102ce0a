"""Earth-Adapter's claim on zoo-tiny-mm: the frequency-guided mixture of adapters copes with artifact-like
disturbances better than the same adapters without the frequency split.

The paper's setting, at the zoo's scale: a frozen backbone trained on clean images (the shipped zoo-tiny-mm, trained
on clean sklearn digits) is adapted, parameter-efficiently, to imagery covered by periodic, structured artifacts
(remote sensing's stripe noise and grid patterns), and measured on held-out images of that imagery. Every image,
rescaled to [0, 1] by the processor, gets one artifact added: bright horizontal stripes, vertical stripes, or a grid
of lines, of period 2 or 4 pixels, random phase, amplitude U(0.4, 0.8) (``artifact``).

Arms: ``earth-adapter`` (``split="frequency"``: DFT over the 4 x 4 patch grid, low / high / spatial experts, a
per-token router) against ``split="none"`` (the same three experts, router and parameter count, each expert reading
the unsplit features: the control lacking only the frequency split). Both arms of a seed start from the same adapter
weights (``torch.manual_seed(seed)``) and see the same images with the same artifacts in the same order (a numpy
generator seeded by the seed), so the judge pairs them by seed. Training: image-only examples, the answer's
language-model loss, AdamW on the adapter alone (the backbone frozen, in eval mode), warm-up then cosine, lr 5e-2:
the control arm's best on a validation split carved from the training images (of 1e-2, 3e-2, 5e-2, 1e-1 and 3e-1;
1e-1 scored the same within a point, 3e-1 diverged), so the control is not held back by the rate.
The measure: digit accuracy on the held-out test images (359), each with ``--draws`` fixed artifact draws (the
same for every run), read as ``zoo_mm``'s evaluation does (answer probabilities over the ten digit words, prompt
"which digit ?"). Clean test accuracy and the frozen base's accuracies are shown alongside, not judged.

    python benchmarks/earth_adapter.py            # the recorded run: 3 seeds x 2 arms (a few CPU minutes)
    python benchmarks/earth_adapter.py --quick    # 2 seeds x 8 steps, 60 test images; records nothing
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from claim_args import conclude, seed_args, show, verdict_parts  # noqa: E402

import zoo  # noqa: E402  (loads the plugins first)

# isort: split
from zoo_multimodal import digits as dm  # noqa: E402
from zoo_multimodal.evaluate_mm import PROMPT, load_model  # noqa: E402

KINDS = ("rows", "columns", "grid")
PERIODS = (2, 4)
AMPLITUDE = (0.4, 0.8)
TEST_SEED = 12345  # the test images' artifact draws, the same for every run
ARMS = (("earth-adapter", "frequency"), ("plain adapter (split=none)", "none"))


def artifact(rng: np.random.Generator, side: int) -> np.ndarray:
    """One ``[side, side]`` additive pattern: stripes (rows or columns, half of each period bright) or a grid of
    one-pixel lines, of a random period, phase and amplitude."""
    kind, period = KINDS[rng.integers(len(KINDS))], PERIODS[rng.integers(len(PERIODS))]
    amplitude = rng.uniform(*AMPLITUDE)
    y = (np.arange(side) + rng.integers(period)) % period
    x = (np.arange(side) + rng.integers(period)) % period
    if kind == "rows":
        on = np.broadcast_to((y < period // 2)[:, None], (side, side))
    elif kind == "columns":
        on = np.broadcast_to((x < period // 2)[None, :], (side, side))
    else:
        on = (y == 0)[:, None] | (x == 0)[None, :]
    return amplitude * on.astype(np.float32)


def to_patches(images: torch.Tensor, patch: int) -> torch.Tensor:
    """``[N, side, side]`` -> ``[N, P, patch*patch]`` in the processor's patch order."""
    n = images.shape[0]
    return images.unfold(1, patch, patch).unfold(2, patch, patch).reshape(n, -1, patch * patch)


def corrupt(pixels: torch.Tensor, rng: np.random.Generator, side: int, patch: int) -> torch.Tensor:
    """Processed images ``[N, P, patch*patch]`` with one fresh artifact each."""
    patterns = torch.from_numpy(np.stack([artifact(rng, side) for _ in range(len(pixels))]))
    return pixels + to_patches(patterns, patch)


def image_inputs(processor, pixels, prompts, answers=None) -> dict:
    """Image-only inputs (no audio part)."""
    return {**processor._text(prompts, answers), "pixel_values": pixels,
            "image_mask": torch.ones(len(pixels), dtype=torch.long)}


@torch.no_grad()
def accuracy(model, processor, pixels, labels, size: int = 256) -> float:
    candidates = processor.digit_token_ids(dm.WORDS)
    model.eval()
    right = 0
    for start in range(0, len(pixels), size):
        pix, lab = pixels[start:start + size], labels[start:start + size]
        probs = model.answer_probs(image_inputs(processor, pix, [PROMPT] * len(pix)), candidates)
        right += int((probs.argmax(-1) == lab).sum())
    return right / len(pixels)


def train_arm(base, processor, split: str, seed: int, train_pix, train_labels, args) -> tuple:
    """``base`` with an earth-adapter (``split``) trained on artifact-corrupted training images; (model, last loss)."""
    side, patch = base.config.image_size, base.config.patch_size
    torch.manual_seed(seed)  # the adapter's initial weights: the same for both arms of a seed
    model = zoo.apply(copy.deepcopy(base), "earth-adapter", dim=args.dim, cutoff_ratio=args.cutoff_ratio, split=split)
    rng = np.random.default_rng(seed)  # batches, prompts and artifacts: the same for both arms of a seed
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    model.eval()  # the frozen backbone as at inference (no dropout anywhere); gradients still reach the adapter
    losses = []
    for _ in range(args.steps):
        idx = torch.from_numpy(rng.integers(len(train_pix), size=args.batch))
        pix = corrupt(train_pix[idx], rng, side, patch)
        prompts = [dm.PROMPTS[i] for i in rng.integers(len(dm.PROMPTS), size=args.batch)]
        loss = model(**image_inputs(processor, pix, prompts, [dm.WORDS[int(d)] for d in train_labels[idx]])).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    tail = losses[-20:]
    return model, sum(tail) / len(tail)


def main(argv=None):
    started = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo-tiny-mm")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-2)
    ap.add_argument("--dim", type=int, default=16, help="bottleneck width of each adapter expert")
    ap.add_argument("--cutoff-ratio", type=float, default=0.3)
    ap.add_argument("--draws", type=int, default=4, help="artifact draws per held-out test image")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    args = seed_args(ap).parse_args(argv)
    test_images = None
    if args.quick:  # the whole path at a tiny budget: 2 seeds x 8 steps, 60 test images, 1 draw; records nothing
        args.seeds, args.steps, args.batch, args.draws, args.no_record = min(args.seeds, 2), 8, 16, 1, True
        test_images = 60
    if args.seeds < 2:
        ap.error("--seeds must be at least 2: one run has no noise to compare against")
    torch.set_num_threads(args.threads)

    base, processor = load_model(args.model)
    side, patch = base.config.image_size, base.config.patch_size
    images, labels = dm.load_images()
    split = dm.image_split(len(images))
    pixels = {s: torch.stack([processor.image_patches(im) for im in images[i]]) for s, i in split.items()}
    targets = {s: torch.as_tensor(labels[i]) for s, i in split.items()}
    if test_images:
        pixels["test"], targets["test"] = pixels["test"][:test_images], targets["test"][:test_images]
    rng = np.random.default_rng(TEST_SEED)
    test_pix = torch.cat([corrupt(pixels["test"], rng, side, patch) for _ in range(args.draws)])
    test_lab = targets["test"].repeat(args.draws)

    rows = [{"run": f"base ({args.model}, frozen, no adapter)", "seed": "-",
             "acc corrupted": round(accuracy(base, processor, test_pix, test_lab), 4),
             "acc clean": round(accuracy(base, processor, pixels["test"], targets["test"]), 4)}]
    measures = {label: [] for label, _ in ARMS}
    params = {}
    for seed in range(args.seeds):
        for label, how in ARMS:
            t = time.perf_counter()
            model, loss = train_arm(base, processor, how, seed, pixels["train"], targets["train"], args)
            params[label] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            acc = accuracy(model, processor, test_pix, test_lab)
            measures[label].append(acc)
            rows.append({"run": label, "seed": seed, "acc corrupted": round(acc, 4),
                         "acc clean": round(accuracy(model, processor, pixels["test"], targets["test"]), 4),
                         "train loss": round(loss, 4), "adapter params": params[label]})
            print(f"{label}, seed {seed}: corrupted acc {acc:.4f}, train loss {loss:.4f}, "
                  f"{time.perf_counter() - t:.0f} s", flush=True)

    from zoo.evaluation.claims import judge

    (mech, _), (ctrl, _) = ARMS
    judgements = {f"{mech} vs {ctrl} (accuracy on held-out artifact-corrupted images)":
                  judge(measures[mech], measures[ctrl], lower_is_better=False, paired=True)}
    print()
    show(rows)
    print()
    verdict = conclude("earth-adapter", judgements, "seeds, paired by seed")
    print(f"\n{'quick run, ' if args.quick else ''}{time.perf_counter() - started:.0f} s"
          + (", nothing recorded" if args.no_record else ""))
    if args.no_record:
        return
    from zoo.evaluation.claims import record

    j = next(iter(judgements.values()))
    seeds = ", ".join(map(str, range(args.seeds)))
    setting = (f"{args.model} frozen (trained on clean digits); an earth-adapter (dim {args.dim}, cutoff ratio "
               f"{args.cutoff_ratio:g}, on the 4 x 4 patch grid of the vision encoder's output) trained {args.steps} "
               f"steps of {args.batch} image-only examples (AdamW lr {args.lr:g}, warm-up then cosine) on training "
               "images each with a fresh periodic artifact (row stripes, column stripes or a line grid, period 2 or 4 "
               f"px, amplitude U{AMPLITUDE} on [0, 1] images), seeds {seeds}; the control is split=none (the same "
               f"experts, router and {params[ctrl]} trainable parameters, no DFT split), paired by seed (same initial "
               "weights, same batches and artifacts). Measure: accuracy on the 359 held-out test images with "
               f"{args.draws} fixed artifact draws each ({len(test_lab)} examples)")
    given = (("steps", args.steps, 300), ("batch", args.batch, 64), ("lr", args.lr, 5e-2), ("dim", args.dim, 16),
             ("cutoff-ratio", args.cutoff_ratio, 0.3), ("draws", args.draws, 4), ("seeds", args.seeds, 3))
    command = "python benchmarks/earth_adapter.py" + "".join(f" --{k} {v}" for k, v, default in given if v != default)
    base_row = rows[0]
    diffs = ", ".join(f"{m - c:+.4f}" for m, c in zip(measures[mech], measures[ctrl]))
    summary = (f"{verdict_parts(judgements)}: corrupted-test accuracy {j['mechanism']:.4f} with the frequency split "
               f"vs {j['control']:.4f} without (margin {j['margin']:+.4f}, noise {j['noise']:.4f}: the spread of the "
               f"per-seed differences {diffs}); the frozen base "
               f"scores {base_row['acc corrupted']:.4f} corrupted and {base_row['acc clean']:.4f} clean. {setting}. "
               "Scope: the paper adapts a large frozen ViT (DINOv2) at every block for segmentation; here one "
               "adapter sits on a tiny encoder's 4 x 4 patch grid, where the 0.3 cutoff leaves the grid mean (DC) "
               "as the low band.")
    record("earth-adapter", "Earth-Adapter's frequency-split mixture of adapters copes with periodic artifacts better "
           "than the same adapters without the split (accuracy on held-out artifact-corrupted images)", verdict,
           summary, rows, command, args.model, judgements=judgements)
    print("recorded: docs/claims/earth-adapter.json")


if __name__ == "__main__":
    main()
