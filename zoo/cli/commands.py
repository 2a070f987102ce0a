"""The ``moe-zoo`` command line (click). Plugins may add commands through ``register_commands``."""
from __future__ import annotations

import json

import click

from zoo.cli.helpers import COUNT, SEED, THREADS, calibration_spec, new_file, one_line, save_folder, step_option


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
    from zoo.components.plugins import plugin_report

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
    table = [("KIND", "NAME", "DISTRIBUTION", "SUMMARY")] + [
        (r["kind"], r["name"], r["distribution"], r["summary"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        click.echo("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[3]]).rstrip())


# What zoo.apply gives a router: hidden_size and num_experts are the layer's (not shown); these may be left out
ROUTER_FILLED = {"top_k": "experts per token; default: the layer's own top_k",
                 "vocab_size": "filled in from the model's vocabulary"}


@cli.command()
@click.argument("name")
def info(name):
    """Everything known about a component or a model NAME (a full name or its tag, e.g. zoo-tiny-moe), as JSON.
    A component's options come with their type, default, whether they are required and a line of help. A name two
    kinds share is written KIND:NAME (experts:channel-topk, compressor:channel-topk)."""
    from zoo.components.options import describe_options, suggest
    from zoo.components.registry import get_model, registry

    by_kind = registry.by_kind
    if name in by_kind["model"]:
        return _json(by_kind["model"][name].obj.info())
    kind, _, bare = name.rpartition(":")
    kinds = [k for k in by_kind if k != "model" and bare in by_kind[k]]
    if kind and kind not in by_kind:
        raise click.ClickException(f"no kind {kind!r}{suggest(kind, sorted(by_kind))} (write KIND:NAME)")
    if not kind and len(kinds) > 1:
        raise click.ClickException(f"{bare!r} names components of {len(kinds)} kinds ({', '.join(kinds)}): write "
                                   + " or ".join(f"{k}:{bare}" for k in kinds))
    try:
        reg = registry.get(kind or None, bare)
    except KeyError:
        try:
            return _json(get_model(name).info())
        except KeyError as exc:
            message = str(exc.args[0])
            if "ambiguous" not in message:
                known = {n for names in by_kind.values() for n in names}
                known |= {n.split(".", 1)[-1] for n in by_kind["model"]}  # model tags
                message = f"no component or model named {name!r}{suggest(name, sorted(known))}"
            raise click.ClickException(message) from None
    row = reg.info()
    if isinstance(reg.obj, type):
        router = reg.kind == "router"
        options = describe_options(reg.obj, skip=("hidden_size", "num_experts") if router else ())
        for option in options:
            if router and option["name"] in ROUTER_FILLED:
                option.update(required=False, help=option["help"] or ROUTER_FILLED[option["name"]])
        row["options"] = {option.pop("name"): option for option in options}
    _json(row)


@cli.command()
def kernels():
    """Build (the first time) or load the zoo's CPU kernels and say which instruction set they run; exits 1 where
    they cannot be built (torch's kernels serve then), with the reason."""
    import warnings

    from zoo.moe import kernels as k

    with warnings.catch_warnings():  # the reason is this command's own output
        warnings.simplefilter("ignore")
        try:
            ready = k.load()
        except ValueError as exc:  # a misspelt ZOO_KERNEL_ISA, a switch (ZOO_KERNEL_INT8_INPUTS, ...) not 0/1
            raise click.ClickException(str(exc)) from None
    if not ready:
        raise click.ClickException(f"zoo's CPU kernels are not available: {k.unavailable_reason()}")
    click.echo(f"zoo's CPU kernels are ready: instruction set {k.isa()} (the best this processor has: "
               f"{k.best_isa()}); 8-bit inputs {'on' if k.int8_inputs_on() else 'off'}; 2/3-bit experts on their "
               f"stored codes {'always' if k.stored_codes() else 'where measured as fast'}"
               + ("; exact inputs' codes read as subnormals" if k.isa() == "avx2" and k.subnormal_codes() else "")
               + ("; 3-bit rows on VBMI" if k.isa() == "avx512-bf16" and k.vbmi() else ""))


def _memory_size(ctx, param, value):
    """--max-memory must be a positive size (checked before any work)."""
    from zoo.io.memory import parse_bytes

    if value is None:
        return None
    try:
        size = parse_bytes(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a memory size: use e.g. 4GB, 512MiB or a number of bytes",
                                 ctx, param) from None
    if size < 1:
        raise click.BadParameter(f"{value!r}: the memory budget must be more than 0 bytes", ctx, param)
    return value


def stream_options(command):
    """--stream/--no-stream and --max-memory: work layer by layer from the shards when the model is too large."""
    command = click.option("--max-memory", callback=_memory_size,
                           help="Memory budget, e.g. 4GB (default: half of the available memory); "
                                "a checkpoint too large to work on in memory within it is streamed.")(command)
    return click.option("--stream/--no-stream", default=None,
                        help="Force layer-at-a-time work from the checkpoint's shards (or in memory).")(command)


def _device(ctx, param, value):
    """--device: checked (a device this process has) before any work; the CPU is the engine's default path."""
    from zoo.editing.device import resolve

    try:
        device = resolve(value)
    except ValueError as exc:
        raise click.ClickException(f"--device: {exc}") from None
    return None if device is None or device.type == "cpu" else device


def device_option(command):
    return click.option("--device", default="cpu", show_default=True, callback=_device, is_eager=True,
                        help="Where layers are computed (cuda, cuda:1, mps): each decoder layer is moved there, "
                             "worked on, and moved back to the CPU to be written.")(command)


def _streams(src, stream, max_memory) -> bool:
    from zoo.editing.stream import should_stream
    from zoo.io.memory import memory_budget

    try:
        budget = memory_budget(max_memory)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-memory") from None
    chosen = should_stream(src, budget) if stream is None else stream
    if chosen and stream is None:
        click.echo(f"streaming {src} layer by layer (budget {budget / 1e9:.1f} GB)", err=True)
    return chosen


def _either(src, stream, max_memory, streamed, in_memory):
    """``streamed()`` or ``in_memory()``, as the budget (or --stream/--no-stream) decides; a user's mistake
    becomes one line."""
    with one_line():
        return streamed() if _streams(src, stream, max_memory) else in_memory()


@cli.command()
@click.argument("src")
@click.argument("out", callback=save_folder)
@stream_options
@device_option
def convert(src, out, stream, max_memory, device):
    """Load SRC (folder, registry name or hub id), convert it to zoo blocks and save to OUT (converting computes
    nothing: --device is only checked)."""
    import zoo
    from zoo.editing import stream as streaming

    _apart(src, out)
    _either(src, stream, max_memory, lambda: streaming.convert(src, out),
            lambda: streaming.save(zoo.load(src), out, src))
    click.echo(f"saved {src} as a zoo model to {out}")


@cli.command()
@click.argument("src")
@click.argument("out")
@click.option("--format", "fmt", type=click.Choice(["native", "gguf", "compressed-tensors"]), default="native",
              show_default=True,
              help="native: the family's own transformers checkpoint (vLLM, TGI, plain transformers) in the folder "
                   "OUT; gguf: one GGUF file OUT (llama.cpp, Ollama); compressed-tensors: the native checkpoint with "
                   "int8-quantized experts and layers as W8A16 (vLLM, transformers), from a model in memory.")
@stream_options
def export(src, out, fmt, stream, max_memory):
    """Write SRC (a zoo model folder, registry name or hub id) in its family's native format, as GGUF or as
    compressed-tensors, to OUT.
    An adapter folder is merged into its base first."""
    import zoo
    from zoo.editing import stream as streaming

    def loaded():
        model = zoo.load(src)
        return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model

    if fmt == "gguf":
        from zoo.io.gguf_export import check_target_file, export_gguf, native_folder

        with one_line():
            check_target_file(out)
            folder = native_folder(src)  # a native checkpoint is read tensor by tensor: no load, any size
            report = export_gguf(folder if folder is not None else loaded(), out)
        if report.max_abs_change:
            click.echo(f"quantized experts: scales rounded to fp16, largest weight change {report.max_abs_change:.2e}")
        if report.padding:
            click.echo(f"padded layers {sorted(report.padding['layers'])} to {report.padding['num_experts']} experts "
                       f"the router never picks: {report.padding['bytes'] / 1e6:.2f} MB more")
        click.echo(f"exported {src} (gguf) to {out}")
        return
    save_folder(click.get_current_context(), None, out)
    _apart(src, out)
    if fmt == "compressed-tensors":
        if stream:
            raise click.BadParameter("compressed-tensors export works on a model in memory", param_hint="--stream")
        with one_line():
            zoo.export(loaded(), out, format=fmt)
        click.echo(f"exported {src} ({fmt}) to {out}")
        return
    def in_memory():
        from zoo.io.convert import export_padding

        model = loaded()
        padding = export_padding(model)
        zoo.export(model, out)
        if padding:
            click.echo(f"padded layers {sorted(padding['layers'])} to {padding['num_experts']} experts the router never "
                       f"picks: {padding['bytes'] / 1e6:.2f} MB more")

    _either(src, stream, max_memory, lambda: streaming.export(src, out), in_memory)
    click.echo(f"exported {src} ({fmt}) to {out}")


@cli.command()
@click.argument("src")
@click.argument("out", callback=save_folder)
def merge(src, out):
    """Fold the PEFT adapter folder SRC (``moe-zoo finetune``'s output) into its base model and save the plain zoo
    model to OUT, with the base's tokenizer and a card."""
    import zoo
    from zoo.editing import stream as streaming
    from zoo.io.adapter_folder import is_adapter_folder
    from zoo.io.outputs import check_output_apart

    with one_line():
        if not is_adapter_folder(src):
            raise ValueError(f"{src} is not an adapter folder (no adapter_config.json without a config.json): "
                             "nothing to merge")
        check_output_apart(out, src, what="OUT")  # neither the adapter's folder nor its base's
        model = zoo.load(src).merge_and_unload()
        streaming.save(model, out, model.config.name_or_path)
    click.echo(f"merged {src} into its base; saved to {out}")


def _tasks(ctx, param, value):
    """--tasks NAME[,NAME...]: the zoo's lm-eval task names, checked before any work."""
    from zoo.evaluation.harness import check_tasks

    if value is None:
        return None
    try:
        return check_tasks(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@cli.command("eval")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), callback=new_file,
              help="Write the expert-usage heatmap PNG here.")
@click.option("--windows", type=COUNT, default=24, show_default=True, help="Held-out windows of 256 tokens per domain.")
@click.option("--no-speed", is_flag=True, help="Skip the prefill/decode timing (a streamed model is never timed).")
@click.option("--tasks", callback=_tasks, metavar="NAME[,NAME...]",
              help="Also run the zoo's lm-evaluation-harness tasks on the model in memory, e.g. "
                   "zoo_continuation_code,zoo_perplexity_english (a wrong name lists them all).")
@click.option("--limit", type=COUNT, help="At most this many documents per --tasks task.")
@click.option("--kv-cache", type=click.Choice(["fp8", "int8", "int4"]),
              help="Also measure perplexity with keys and values at this precision: each window fed 32 tokens at a "
                   "time through the cache, beside the same loop at full precision (results under \"kv_cache\").")
@stream_options
@device_option
def eval_command(model, as_json, plot, windows, no_speed, tasks, limit, kv_cache, stream, max_memory, device):
    """Evaluate MODEL (folder or registry name): perplexity per domain, expert usage, speed, size, and with --tasks
    the zoo's lm-evaluation-harness tasks (results under "tasks")."""
    import zoo
    from zoo.editing import stream as streaming
    from zoo.evaluation.eval import evaluate, format_table, plot_usage

    def in_memory():
        loaded = zoo.load(model).eval()
        loaded = loaded if device is None else loaded.to(device)
        result = evaluate(loaded, max_windows=windows, measure_speed=not no_speed)
        if kv_cache:
            from zoo.runtime.kv_cache import kv_cache_table

            result["kv_cache"] = kv_cache_table(loaded, kv_cache, windows)
        return {**result, "tasks": _run_tasks(loaded, tasks, limit)} if tasks else result

    def streamed():
        if kv_cache:
            raise ValueError(f"--kv-cache measures the model in memory, and {model} is streamed (larger than the "
                             "memory budget; see --max-memory)")
        result = streaming.evaluate(model, max_windows=windows, device=device)
        # too large to hold: lm-eval runs on the model with its experts read from the checkpoint on demand
        return {**result, "tasks": _run_tasks(zoo.offload(model), tasks, limit)} if tasks else result

    if device is not None and (tasks or kv_cache):
        raise click.BadParameter("--tasks and --kv-cache run on the CPU; leave --device out", param_hint="--device")
    if limit is not None and not tasks:
        raise click.BadParameter("--limit goes with --tasks", param_hint="--limit")
    if kv_cache and stream:
        raise click.BadParameter("--kv-cache measures the model in memory; drop --stream", param_hint="--kv-cache")
    result = _either(model, stream, max_memory, streamed, in_memory)
    if plot:
        with one_line():
            plot_usage(result, plot, title=model)
    if as_json:
        return _json(result)
    click.echo(f"perplexity over {windows} windows of 256 tokens per domain, on held-out documents of the training "
               "sources and on out-of-domain text (modern English, third-party Python); another window count or "
               "length measures other text: compare like with like")
    click.echo(format_table({model: result}))
    for domain, layers in result["usage"].items():
        for layer in layers:
            click.echo(f"usage {domain:8} layer {layer['layer']}: {layer['counts']} "
                       f"(entropy {layer['entropy_bits']:.2f} of at most {layer['max_entropy_bits']:.2f} bits)")
    if "kv_cache" in result:
        kv = result["kv_cache"]
        for domain, row in kv["domains"].items():
            click.echo(f"kv cache {kv['precision']} {domain:8}: perplexity {row['perplexity']:.3f} vs "
                       f"{row['full_perplexity']:.3f} at full precision, cache {row['bytes'] / 1e6:.2f} MB vs "
                       f"{row['full_bytes'] / 1e6:.2f} MB a window ({kv['windows']} windows of 256 tokens, fed {kv['chunk']} "
                       "at a time)")
    if tasks:
        from zoo.evaluation.harness import format_tasks

        click.echo(f"\nlm-evaluation-harness tasks{f' (at most {limit} documents each)' if limit else ''}:")
        click.echo(format_tasks(result["tasks"]))


def _run_tasks(model, tasks, limit):
    from zoo.evaluation.harness import run_tasks

    return run_tasks(model, tasks, limit=limit)


def _apart(src, out) -> None:
    """OUT must not be SRC's folder (or its adapter's base), nor inside it: refused before any work."""
    from zoo.io.outputs import check_output_apart

    with one_line():
        check_output_apart(out, src, what="OUT")


@cli.command()
@click.argument("src")
@click.argument("steps", nargs=-1, required=True)
@click.option("--out", required=True, callback=save_folder, help="Folder to save the result to.")
@click.option("--calibration", callback=calibration_spec,
              help="Calibration data for the steps that use it: DOMAIN[:TOKENS] of the shipped "
                   "corpus (english, code, mixed; default mixed:8192).")
@stream_options
@device_option
def apply(src, steps, out, calibration, stream, max_memory, device):
    """Apply STEPS (``name:k=v,...``) to SRC in order and save to --out."""
    import zoo
    from zoo.editing import stream as streaming
    from zoo.editing.apply import find

    parsed = [step_option(s, "STEPS") for s in steps]
    for name, _ in parsed:
        with one_line():
            find(name)
    _apart(src, out)

    def streamed():
        streaming.apply(src, parsed, out, calibration=calibration, device=device)
        return f"applied {', '.join(name for name, _ in parsed)} layer by layer; saved to {out}"

    def in_memory():
        from zoo.editing.device import using

        model = zoo.load(src)
        for name, options in parsed:
            with one_line(f"step {name}: "), using(device):  # each layer calibrated and compressed on --device
                model = zoo.apply(model, name, calibration=calibration, **options)
            click.echo(f"applied {name} {options}")
        streaming.save(model, out, src)  # with the source's tokenizer, as the streamed path
        return f"saved to {out}"

    click.echo(_either(src, stream, max_memory, streamed, in_memory))


@cli.command()
@click.argument("model")
@click.option("--adapter", required=True, help="Adapter to train, as NAME[:k=v,...] (e.g. lora-experts:r=8).")
@click.option("--domain", type=click.Choice(["english", "code"]), required=True, help="Corpus domain to train on.")
@click.option("--steps", type=COUNT, default=100, show_default=True, help="Optimizer steps.")
@click.option("--lr", type=click.FloatRange(0, min_open=True), default=1e-3, show_default=True,
              help="Peak learning rate (warm-up, then cosine).")
@click.option("--batch-size", type=COUNT, default=8, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=2), default=256, show_default=True,
              help="Tokens per training window (at most the model's max_position_embeddings).")
@click.option("--windows", type=COUNT, default=24, show_default=True, help="Held-out windows per domain for perplexity.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--threads", type=THREADS, help="torch threads (default: torch's choice).")
@click.option("--merge", is_flag=True, help="Merge the adapter into the weights before saving (if it can).")
@click.option("--out", callback=save_folder, help="Folder to save to (default runs/finetune-<adapter>-<domain>).")
def finetune(model, adapter, domain, steps, lr, batch_size, seq_len, windows, seed, threads, merge, out):
    """Fine-tune MODEL with an adapter on one domain; print held-out perplexity before/after; save to --out."""
    from zoo.training.finetune import finetune as run

    name, options = step_option(adapter, "'--adapter'")
    out = out or save_folder(None, None, f"runs/finetune-{name}-{domain}")
    with one_line():
        result = run(model, name, options, domain=domain, steps=steps, lr=lr, batch_size=batch_size,
                     seq_len=seq_len, windows=windows, seed=seed, threads=threads, out=out, merge=merge)
    click.echo(result.table())
    click.echo(f"trained {result.trainable_params:,} parameters for {steps} steps in {result.seconds:.0f}s; "
               f"saved to {out}")


def _add_builtin_commands():
    from zoo.cli.compare import compare
    from zoo.cli.demo import demo
    from zoo.cli.generate import generate
    from zoo.cli.tour import tour
    from zoo.cli.train import train

    for command in (tour, train, demo, generate, compare):
        cli.add_command(command)


_add_builtin_commands()
from zoo.cli.plugin import add_commands; add_commands(cli)  # noqa: E402,E702  moe-zoo plugin new, moe-zoo install


def main(argv=None):
    from zoo.components.plugins import commands_hook

    commands_hook(cli)
    cli(argv)
