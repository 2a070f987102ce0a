"""Multimodal digits benchmark: accuracy of a zoo_mm model (default the shipped zoo-tiny-mm) on unseen voices
and held-out images, image only / audio only / both, audio with white noise at several SNRs with and without
the image, and expert-group usage per token modality (saved as a plot).

    python benchmarks/multimodal.py [MODEL] [--plot out/multimodal_groups.png] [--snrs 20,0,-10]
"""
import argparse

import torch

import zoo  # noqa: F401  (loads the plugins first)

# isort: split
from zoo_multimodal.evaluate_mm import SNRS, evaluate, format_results, plot_usage


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="zoo-tiny-mm")
    parser.add_argument("--plot", default="out/multimodal_groups.png")
    parser.add_argument("--snrs", default=",".join(map(str, SNRS)))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = evaluate(args.model, snrs=tuple(int(s) for s in args.snrs.split(",")))
    print(format_results(results))
    import os

    os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
    plot_usage(results, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
