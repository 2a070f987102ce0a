"""``moe-zoo generate``: greedy text from a model, decoded with the compiled static-cache step (driven by
``zoo.decode.greedy``, which skips ``generate``'s per-step bookkeeping and stops at EOS)."""
import click


@click.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--quantize", "bits", type=click.Choice(["8", "4", "3"]), help="Quantize the experts first.")
@click.option("--compile/--no-compile", "use_compile", default=True, show_default=True,
              help="Static KV cache and a torch.compile'd decode step (the first call compiles).")
@click.option("--threads", type=int, help="torch threads (default: torch's choice).")
def generate(model, prompt, max_new_tokens, bits, use_compile, threads):
    """Continue PROMPT with MODEL (a registry name or folder); prints the text and the decode speed."""
    import torch

    import zoo
    from zoo.decode import timed_greedy

    if threads:
        torch.set_num_threads(threads)
    try:
        lm, tok = zoo.load(model).eval(), zoo.load_tokenizer(model)
    except (OSError, KeyError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if bits:
        zoo.apply(lm, "quantize", bits=int(bits))
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        run = timed_greedy(lm, ids, max_new_tokens, compile=use_compile, repeats=1, eos_token_id=tok.eos_token_id)
    click.echo(tok.decode(run["tokens"][0], skip_special_tokens=True))
    click.echo(f"[decode {run['decode_tok_s']:.0f} tok/s, first token {run['first_token_s'] * 1e3:.0f} ms, "
               f"warm-up{' and compile' if use_compile else ''} {run['warmup_s']:.1f} s]", err=True)
