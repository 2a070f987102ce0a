"""The ``moe-zoo`` command line (click). Plugins may add commands through ``register_commands``."""
from __future__ import annotations

import json
import sys

import click


def _json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@click.group()
@click.version_option(package_name="moe-zoo")
def cli():
    """moe-zoo: load, change and share Mixture-of-Experts models."""


@cli.command()
@click.argument("pattern", default="*")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models(pattern, as_json):
    """List registered models matching PATTERN (fnmatch over arch.tag names)."""
    import zoo

    entries = zoo.list_models(pattern)
    if as_json:
        return _json([e.info() for e in entries])
    for e in entries:
        click.echo(f"{e.name:32} {e.hub_id or '(shipped with moe-zoo)':40} {e.family:12} {e.license}")


@cli.command()
@click.option("--all", "show_all", is_flag=True, help="Include the first-party plugins.")
def plugins(show_all):
    """Installed plugins as JSON: name, version, hooks, components (and the error of a broken one)."""
    from zoo.plugins import plugin_report

    _json(plugin_report(include_defaults=show_all))


@cli.command()
@click.argument("kind", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def components(kind, as_json):
    """List components (routers, experts, compressors, adapters, architectures), optionally of one KIND."""
    import zoo

    kind = {"routers": "router", "compressors": "compressor", "adapters": "adapter",
            "architectures": "architecture"}.get(kind, kind)
    try:
        rows = zoo.list_components(kind)
    except KeyError as exc:
        raise click.UsageError(str(exc.args[0])) from None
    if as_json:
        return _json(rows)
    for r in rows:
        click.echo(f"{r['kind']:12} {r['name']:18} {r['summary']}")


@cli.command()
@click.argument("name")
def info(name):
    """Everything known about a component or a model NAME, as JSON."""
    from zoo.options import accepted_options
    from zoo.plugins import load_plugins, registry

    load_plugins()
    if name in registry.by_kind["model"]:
        return _json(registry.by_kind["model"][name].obj.info())
    try:
        reg = registry.get(None, name)
    except KeyError as exc:
        raise click.ClickException(str(exc.args[0])) from None
    row = reg.info()
    if isinstance(reg.obj, type):
        row["options"] = accepted_options(reg.obj, skip=("hidden_size", "num_experts"))
    _json(row)


def stream_options(command):
    """--stream/--no-stream and --max-memory: work layer by layer from the shards when the model is too large."""
    command = click.option("--max-memory", help="Memory budget, e.g. 4GB (default: half of the available memory); "
                                                "a checkpoint too large to work on in memory within it is streamed.")(command)
    return click.option("--stream/--no-stream", default=None,
                        help="Force layer-at-a-time work from the checkpoint's shards (or in memory).")(command)


def _streams(src, stream, max_memory) -> bool:
    from zoo.stream import memory_budget, should_stream

    try:
        budget = memory_budget(max_memory)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-memory") from None
    chosen = should_stream(src, budget) if stream is None else stream
    if chosen and stream is None:
        click.echo(f"streaming {src} layer by layer (budget {budget / 1e9:.1f} GB)", err=True)
    return chosen


def _user_errors():
    """The exceptions a user's mistake raises: printed as one line, not a traceback."""
    from zoo.architectures.family import NotExportable
    from zoo.checkpoint import CheckpointError

    return (KeyError, ValueError, TypeError, NotExportable, CheckpointError, FileNotFoundError)


def _either(src, stream, max_memory, streamed, in_memory):
    """``streamed()`` or ``in_memory()``, as the budget (or --stream/--no-stream) decides; a user's mistake
    becomes one line."""
    try:
        return streamed() if _streams(src, stream, max_memory) else in_memory()
    except _user_errors() as exc:
        raise click.ClickException(str(exc).strip("'\"")) from None


@cli.command()
@click.argument("src")
@click.argument("out")
@stream_options
def convert(src, out, stream, max_memory):
    """Load SRC (folder, registry name or hub id), convert it to zoo blocks and save to OUT."""
    import zoo
    from zoo import stream as streaming

    _either(src, stream, max_memory, lambda: streaming.convert(src, out),
            lambda: zoo.load(src).save_pretrained(out))
    click.echo(f"saved {src} as a zoo model to {out}")


@cli.command()
@click.argument("src")
@click.argument("out")
@stream_options
def export(src, out, stream, max_memory):
    """Write SRC in its family's native format (for vLLM, TGI, plain transformers) to OUT."""
    import zoo
    from zoo import stream as streaming

    _either(src, stream, max_memory, lambda: streaming.export(src, out),
            lambda: zoo.export(zoo.load(src), out))
    click.echo(f"exported {src} to {out}")


@cli.command("eval")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write the expert-usage heatmap PNG here.")
@click.option("--windows", default=24, show_default=True, help="Held-out windows of 256 tokens per domain.")
@click.option("--no-speed", is_flag=True, help="Skip the prefill/decode timing (a streamed model is never timed).")
@stream_options
def eval_command(model, as_json, plot, windows, no_speed, stream, max_memory):
    """Evaluate MODEL (folder or registry name): perplexity per domain, expert usage, speed, size."""
    import zoo
    from zoo import stream as streaming
    from zoo.eval import evaluate, format_table, plot_usage

    result = _either(model, stream, max_memory, lambda: streaming.evaluate(model, max_windows=windows),
                     lambda: evaluate(zoo.load(model).eval(), max_windows=windows, measure_speed=not no_speed))
    if plot:
        plot_usage(result, plot, title=model)
    if as_json:
        return _json(result)
    click.echo(format_table({model: result}))
    for domain, layers in result["usage"].items():
        for layer in layers:
            click.echo(f"usage {domain:8} layer {layer['layer']}: {layer['counts']} "
                       f"(entropy {layer['entropy_bits']:.2f}/{layer['max_entropy_bits']:.0f} bits)")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and quotes, so JSON values such as ``disable={"1":[0,2]}`` stay whole."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def parse_step(step: str) -> tuple[str, dict]:
    """``name:k=v,k2=v2`` -> (name, options); values are parsed as JSON where they can be."""
    name, _, rest = step.partition(":")
    options = {}
    for item in filter(None, _split_top_level(rest)):
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"option {item!r} in step {step!r} must look like key=value")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return name.strip(), options


@cli.command()
@click.argument("src")
@click.argument("steps", nargs=-1, required=True)
@click.option("--out", required=True, help="Folder to save the result to.")
@click.option("--calibration", help="Calibration data for the steps that use it: DOMAIN[:TOKENS] of the shipped "
                                    "corpus (english, code, mixed; default mixed:8192).")
@stream_options
def apply(src, steps, out, calibration, stream, max_memory):
    """Apply STEPS (``name:k=v,...``) to SRC in order and save to --out."""
    import zoo
    from zoo import stream as streaming
    from zoo.apply import find

    if calibration is not None:
        from zoo.calibration import corpus

        domain, _, tokens = calibration.partition(":")
        try:
            calibration = corpus(domain, tokens=int(tokens or 8192))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--calibration") from None
    parsed = [parse_step(s) for s in steps]
    for name, _ in parsed:
        try:
            find(name)
        except KeyError as exc:
            raise click.ClickException(str(exc)) from None
    if _streams(src, stream, max_memory):
        try:
            streaming.apply(src, parsed, out, calibration=calibration)
        except _user_errors() as exc:
            raise click.ClickException(str(exc).strip("'\"")) from None
        click.echo(f"applied {', '.join(name for name, _ in parsed)} layer by layer; saved to {out}")
        return
    model = zoo.load(src)
    for name, options in parsed:
        try:
            model = zoo.apply(model, name, calibration=calibration, **options)
        except (ValueError, TypeError) as exc:
            raise click.ClickException(f"step {name}: {exc}") from None
        click.echo(f"applied {name} {options}")
    model.save_pretrained(out)
    click.echo(f"saved to {out}")


@cli.command()
@click.argument("model")
@click.option("--adapter", required=True, help="Adapter to train, as NAME[:k=v,...] (e.g. lora-experts:r=8).")
@click.option("--domain", type=click.Choice(["english", "code"]), required=True, help="Corpus domain to train on.")
@click.option("--steps", default=100, show_default=True, help="Optimizer steps.")
@click.option("--lr", default=1e-3, show_default=True, help="Peak learning rate (warm-up, then cosine).")
@click.option("--batch-size", default=8, show_default=True)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--windows", default=24, show_default=True, help="Held-out windows per domain for perplexity.")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", type=int, help="torch threads (default: torch's choice).")
@click.option("--merge", is_flag=True, help="Merge the adapter into the weights before saving (if it can).")
@click.option("--out", help="Folder to save to (default runs/finetune-<adapter>-<domain>).")
def finetune(model, adapter, domain, steps, lr, batch_size, seq_len, windows, seed, threads, merge, out):
    """Fine-tune MODEL with an adapter on one domain; print held-out perplexity before/after; save to --out."""
    from zoo.finetune import finetune as run

    name, options = parse_step(adapter)
    out = out or f"runs/finetune-{name}-{domain}"
    try:
        result = run(model, name, options, domain=domain, steps=steps, lr=lr, batch_size=batch_size,
                     seq_len=seq_len, windows=windows, seed=seed, threads=threads, out=out, merge=merge)
    except (KeyError, ValueError, TypeError) as exc:
        raise click.ClickException(f"{name}: {exc}") from None
    click.echo(result.table())
    click.echo(f"trained {result.trainable_params:,} parameters for {steps} steps in {result.seconds:.0f}s; "
               f"saved to {out}")


def _add_builtin_commands():
    from zoo.demo_cli import demo
    from zoo.generate_cli import generate
    from zoo.tour import tour
    from zoo.train_cli import train

    for command in (tour, train, demo, generate):
        cli.add_command(command)


_add_builtin_commands()


def main():
    from zoo.plugins import commands_hook

    commands_hook(cli)
    cli()


if __name__ == "__main__":
    sys.exit(main())
