"""``moe-zoo train``: train one of the zoo's own models from a JSON config, with flag overrides."""
import click


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", type=int, help="Override the number of steps.")
@click.option("--out", help="Override the output folder.")
@click.option("--threads", type=int, help="torch threads (default: torch's choice).")
@click.option("--arch", type=click.Choice(["mixtral", "qwen3_moe", "dense"]), help="Override the layout.")
@click.option("--no-resume", is_flag=True, help="Start over even if a checkpoint exists.")
def train(config, steps, out, threads, arch, no_resume):
    """Train from CONFIG (see configs/); resumes from OUT/checkpoint; writes OUT/final."""
    from zoo.train import TrainConfig, train as run

    cfg = TrainConfig.from_json(config, steps=steps, out=out, threads=threads, arch=arch)
    history = run(cfg, resume=not no_resume)
    last = history["val"][-1]
    click.echo(f"done: {history['tokens']:,} tokens in {history['seconds']:.0f}s; final val " +
               ", ".join(f"{k} {v:.3f}" for k, v in last.items() if k != "step"))
