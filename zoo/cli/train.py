"""``moe-zoo train``: train one of the zoo's own models from a JSON config, with flag overrides."""
import json
import os

import click


def _folder(value, what):
    """OUT holds OUT/checkpoint and OUT/final: it must not be a file (checked before any work)."""
    if value is not None and os.path.exists(value) and not os.path.isdir(value):
        raise click.BadParameter(f"{value!r} is a file, not a folder", param_hint=what)
    return value


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", type=click.IntRange(min=1), help="Override the number of steps.")
@click.option("--out", callback=lambda ctx, param, value: _folder(value, "--out"), help="Override the output folder.")
@click.option("--threads", type=click.IntRange(1, os.cpu_count()), help="torch threads (default: torch's choice).")
@click.option("--arch", type=click.Choice(["mixtral", "qwen3_moe", "dense"]), help="Override the layout.")
@click.option("--no-resume", is_flag=True, help="Start over even if a checkpoint exists.")
def train(config, steps, out, threads, arch, no_resume):
    """Train from CONFIG (see configs/); resumes from OUT/checkpoint; writes OUT/final."""
    from zoo.cli.helpers import one_line
    from zoo.training.train import TrainConfig, train as run

    with one_line(f"{config}: "):
        with open(config) as f:
            if not isinstance(json.load(f), dict):
                raise ValueError("expected a JSON object of TrainConfig fields (see configs/)")
        cfg = TrainConfig.from_json(config, steps=steps, out=out, threads=threads, arch=arch)
    _folder(cfg.out, f"'out' in {config}")
    with one_line():
        history = run(cfg, resume=not no_resume)
    last = history["val"][-1]
    click.echo(f"done: {history['tokens']:,} tokens in {history['seconds']:.0f}s; final val " +
               ", ".join(f"{k} {v:.3f}" for k, v in last.items() if k != "step"))
