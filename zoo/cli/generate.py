"""``moe-zoo generate``: greedy text from a model, decoded with the compiled static-cache step (driven by
``zoo.runtime.decode.greedy``, which skips ``generate``'s per-step bookkeeping and stops at EOS)."""
import os

import click


def _prompt(ctx, param, value):
    if not value.strip():
        raise click.BadParameter("the prompt is empty: give the text to continue", ctx, param)
    return value


@click.command()
@click.argument("model")
@click.argument("prompt", callback=_prompt)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="At most this many new tokens (prompt + new tokens must fit the model's positions).")
@click.option("--step", "steps", multiple=True,
              help="Apply a recipe step NAME[:k=v,...] first, e.g. quantize:bits=8; repeat for several.")
@click.option("--compile/--no-compile", "use_compile", default=True, show_default=True,
              help="Static KV cache and a torch.compile'd decode step (the first call compiles).")
@click.option("--threads", type=click.IntRange(1, os.cpu_count()), help="torch threads (default: torch's choice).")
@click.option("--kv-cache", type=click.Choice(["fp8", "int8", "int4"]),
              help="Keep keys and values at this precision (a growing cache: the steps run eagerly).")
@click.option("--huge-pages", is_flag=True,
              help="Move the weights onto 2 MB pages first (Linux; a few percent faster decode, ~2.5 s a GB once).")
def generate(model, prompt, max_new_tokens, steps, use_compile, threads, kv_cache, huge_pages):
    """Continue PROMPT with MODEL (a registry name or folder); prints the text and the decode speed."""
    import torch

    import zoo
    from zoo.cli.helpers import one_line, step_option
    from zoo.runtime.decode import check_decode, timed_greedy
    from zoo.io.loading import tokenizer_for

    if threads:
        torch.set_num_threads(threads)
    parsed = [step_option(s, "--step") for s in steps]
    with one_line():
        lm = zoo.load(model).eval()
        tok = tokenizer_for(lm, required=True)  # the model's own, checked to fit its vocabulary
        ids = tok(prompt, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise ValueError(f"the prompt {prompt!r} has no tokens for this model's tokenizer")
        check_decode(lm, ids, max_new_tokens)  # before any step or compiling
        for name, options in parsed:
            with one_line(f"--step {name}: "):
                lm = zoo.apply(lm, name, **options)
        if huge_pages:
            from zoo.runtime.huge_pages import collapse_to_huge_pages

            click.echo(f"weights on huge pages: {collapse_to_huge_pages(lm) / 2**20:.0f} MiB", err=True)
        use_compile = use_compile and kv_cache is None
        if use_compile:  # the first call compiles: say so, or the wait looks like a hang
            click.echo("compiling the decode step (first call, ~30-60 s)...", err=True)
        with torch.no_grad():
            run = timed_greedy(lm, ids, max_new_tokens, compile=use_compile, repeats=1,
                               eos_token_id=tok.eos_token_id, kv_cache=kv_cache)
    click.echo(tok.decode(run["tokens"][0], skip_special_tokens=True))
    click.echo(f"[decode {run['decode_tok_s']:.0f} tok/s, first token {run['first_token_s'] * 1e3:.0f} ms, "
               f"warm-up{' and compile' if use_compile else ''} {run['warmup_s']:.1f} s]", err=True)
