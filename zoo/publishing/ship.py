"""Copy a trained checkpoint into the package as one of the zoo's own models: bf16 weights (half the bytes;
training ran under bf16 autocast), the tokenizer, the training history, and a model card with evaluation.

    python -m zoo.publishing.ship runs/zoo-tiny-moe/final zoo/_data/models/zoo-tiny-moe --name zoo-tiny-moe
    python -m zoo.publishing.ship runs/zoo-tiny-upcycled/final zoo/_data/models/zoo-tiny-upcycled --name zoo-tiny-upcycled \
        --max-shard-size 30MB       # shards: no file of the repository over 50 MiB
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch


def ship(src: str, dest: str, name: str, windows: int = 24, max_shard_size: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zoo
    from zoo.io.atomic import atomic_directory
    from zoo.evaluation.eval import evaluate, plot_usage
    from zoo.publishing.token_masking import masked_errors

    with masked_errors():  # src may be a hub id: its errors must not show a token
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
        tokenizer = AutoTokenizer.from_pretrained(src)
    with atomic_directory(dest) as tmp:
        model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        tokenizer.save_pretrained(tmp)
        shutil.copy2(os.path.join(src, "training.json"), tmp)
        try:
            model = zoo.convert(model)  # evaluation reads expert usage off the zoo block; the files stay native
        except TypeError:
            pass  # the dense control: no MoE blocks
        result = evaluate(model, tokenizer, max_windows=windows)
        with open(os.path.join(tmp, "eval.json"), "w") as f:
            json.dump(result, f, indent=1)
        if getattr(type(model), "zoo_family", None) is not None:
            card = zoo.card(model, result, model_name=name,
                            summary=f"`{name}`: trained by moe-zoo on its shipped corpus (Shakespeare and Python "
                                    "standard-library source). A native checkpoint: plain transformers loads it.")
            card.save(os.path.join(tmp, "README.md"))
            plot_usage(result, os.path.join(tmp, "expert_usage.png"), title=name)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dest")
    ap.add_argument("--name", required=True)
    ap.add_argument("--max-shard-size", help="split the weights into shards of at most this size (e.g. 30MB)")
    args = ap.parse_args(argv)
    result = ship(args.src, args.dest, args.name, max_shard_size=args.max_shard_size)
    print(json.dumps({k: v for k, v in result.items() if k != "usage"}, indent=1))


if __name__ == "__main__":
    main()
