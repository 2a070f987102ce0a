"""The main job for now: the zoo's core story on a tiny random Mixtral, in a few seconds.

Convert (lossless), list the plugins, apply a recipe step, save with the recipe, reload through the Auto
classes and check the logits. Trained checkpoints replace the random model once the zoo ships its own.
"""
from __future__ import annotations

import json

import click
import torch


@click.command()
@click.option("--out", default="out/tour", show_default=True, help="Where to save the result.")
def tour(out):
    """Convert a tiny Mixtral, apply topk-softmax:top_k=1, save, reload and compare."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    import zoo
    from zoo.layout import moe_layers

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    native = MixtralForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = native(input_ids=ids).logits
        model = zoo.convert(native)
        diff = (model(input_ids=ids).logits - ref).abs().max().item()
    click.echo(f"converted {type(model).__name__}: {len(moe_layers(model))} SparseMoE blocks, "
               f"max |logit diff| vs native = {diff:.2e}")
    click.echo("\ncomponents:")
    for c in zoo.list_components():
        click.echo(f"  {c['kind']:12} {c['name']:18} {c['summary']}")
    zoo.apply(model, "topk-softmax", top_k=1)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    model.save_pretrained(out)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        reload_diff = (loaded(input_ids=ids).logits - after).abs().max().item()
    click.echo(f"\napplied topk-softmax top_k=1; recipe: {json.dumps(loaded.config.zoo_recipe)}")
    click.echo(f"saved to {out}; reloaded {type(loaded).__name__}, max |logit diff| = {reload_diff:.2e}")
