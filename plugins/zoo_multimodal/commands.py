"""``moe-zoo digits-mm generate|train|eval``: regenerate the data, train zoo-tiny-mm, evaluate it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click

from zoo.io.atomic import write_text
from zoo.cli.helpers import new_file, one_line, save_folder

RECIPE = {"hidden_size": 64, "num_hidden_layers": 3, "moe_intermediate_size": 128, "group_sizes": [2, 4, 4], "top_groups": 1,
              "num_experts_per_tok": 2, "vision_experts": 4, "vision_experts_per_tok": 1}


@click.group("digits-mm")
def digits_mm():
    """Multimodal digits: sklearn images + espeak-ng speech + prompts (zoo_mm, zoo-tiny-mm)."""


@digits_mm.command()
@click.argument("out", required=False)
@click.option("--check", is_flag=True, help="Exit 1 unless the checksums match the shipped manifest.")
def generate(out, check):
    """Regenerate the set deterministically into OUT (default: the cache) with checksums."""
    from zoo_multimodal.digits import main

    if out is not None and os.path.exists(out) and not os.path.isdir(out):
        raise click.BadParameter(f"{out!r} is a file, not a folder", param_hint="OUT")
    with one_line():
        main((["--check"] if check else []) + (["--", out] if out else []))


@digits_mm.command()
@click.option("--out", required=True, callback=save_folder, help="Folder to save the model and its processor to.")
@click.option("--steps", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=3e-3, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True)
@click.option("--threads", type=click.IntRange(1, os.cpu_count()), default=1, show_default=True)
@click.option("--group-bias", type=click.FloatRange(0), default=0.1, show_default=True,
              help="Weight of MoHAVE's group-load biasing loss (0: off, groups not bound to modalities).")
def train(out, steps, batch_size, lr, seed, threads, group_bias):
    """Train a zoo_mm model with the zoo-tiny-mm recipe and save it (model, processor, training.json)."""
    import torch

    from zoo_multimodal.train_mm import TRAIN_SNRS
    from zoo_multimodal.train_mm import train as run

    torch.set_num_threads(threads)
    model, processor, history = run(steps=steps, batch_size=batch_size, lr=lr, seed=seed, group_bias=group_bias,
                                    **RECIPE)
    model.config.zoo_recipe = [{"name": "train", "kind": "training", "options": {
        "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "group_bias": group_bias,
        "noise_snrs": list(TRAIN_SNRS),
        "data": "moe-zoo digits-mm generate (train voices, train images)"}, "calibration": None}]
    model.save_pretrained(out)
    processor.save_pretrained(out)
    write_text(Path(out, "training.json"), json.dumps({"recipe": RECIPE, "loss": history[::10]}) + "\n",
               overwrite=True)
    click.echo(f"saved to {out}; final loss {sum(history[-50:]) / 50:.4f}")


@digits_mm.command("eval")
@click.argument("model")
@click.option("--plot", type=click.Path(dir_okay=False), callback=new_file, help="Write the group-usage figure here.")
@click.option("--json", "as_json", type=click.Path(dir_okay=False), callback=new_file, help="Write the results here.")
def eval_command(model, plot, as_json):
    """Accuracy per modality and per SNR, and expert-group usage per modality."""
    from transformers import AutoConfig

    from zoo.io.loading import resolve_path
    from zoo_multimodal.evaluate_mm import evaluate, format_results, plot_usage

    with one_line():
        kind = AutoConfig.from_pretrained(resolve_path(model)).model_type
        if kind != "zoo_mm":
            raise ValueError(f"{model!r} is a {kind} model; digits-mm eval needs a zoo_mm model (e.g. zoo-tiny-mm)")
        results = evaluate(model)
    click.echo(format_results(results))
    with one_line():
        if plot:
            plot_usage(results, plot)
        if as_json:
            write_text(as_json, json.dumps(results, indent=1) + "\n")
