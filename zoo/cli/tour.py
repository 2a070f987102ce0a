"""The main job: the zoo's core story on its embedded default model, in a few minutes on 2 cores.

Load ``zoo-tiny-moe``, list the installed plugins, apply a recipe, evaluate before and after through the
one harness, save the result with its rendered model card, and print the before/after table.
"""
from __future__ import annotations

import json
import os

import click


@click.command()
@click.option("--model", "name", default="zoo-tiny-moe", show_default=True, help="Registry name or folder.")
@click.option("--step", "steps", multiple=True, default=["prune-reap:num_experts=6", "quantize:bits=8"],
              show_default=True, help="Recipe step NAME[:k=v,...]; repeat for several.")
@click.option("--out", default="out", show_default=True, help="Folder for the result and its card.")
@click.option("--windows", default=16, show_default=True, help="Held-out windows of 256 tokens per domain.")
@click.option("--no-speed", is_flag=True, help="Skip the speed measurement.")
def tour(name, steps, out, windows, no_speed):
    """Load, list plugins, apply a recipe, evaluate before/after, save with a card, print the table."""
    import zoo
    from zoo.io.atomic import atomic_directory, write_text
    from zoo.cli.helpers import step_option
    from zoo.evaluation.eval import evaluate, format_table, plot_usage
    from zoo.components.plugins import plugin_report

    model = zoo.load(name).eval()
    click.echo(f"loaded {name}: {type(model).__name__}")
    click.echo("\nplugins:")
    for p in plugin_report(include_defaults=True):
        status = f"ERROR {p['error'].splitlines()[-1]}" if "error" in p else ", ".join(p["components"])
        click.echo(f"  {p['name']} ({p['distribution']} {p['version']}): {status}")
    before = evaluate(model, max_windows=windows, measure_speed=not no_speed)
    for step in steps:
        step_name, options = step_option(step, "--step")
        model = zoo.apply(model, step_name, **options)
        click.echo(f"\napplied {step_name} {json.dumps(options)}")
    after = evaluate(model, max_windows=windows, measure_speed=not no_speed)
    dest = os.path.join(out, f"{os.path.basename(name.rstrip('/'))}-{'-'.join(s.split(':')[0] for s in steps)}")
    with atomic_directory(dest) as tmp:  # the model, its card, plot and numbers: one save, all or nothing
        model.save_pretrained(tmp, model_card=zoo.card(model, after, model_name=os.path.basename(dest)))
        plot_usage(after, os.path.join(tmp, "expert_usage.png"), title=f"{name} after {', '.join(steps)}")
        write_text(os.path.join(tmp, "eval.json"), json.dumps({"before": before, "after": after}, indent=1))
    click.echo("\n" + format_table({"before": before, "after": after}))
    click.echo(f"\nsaved to {dest} (weights, README.md model card, expert_usage.png, eval.json)")
