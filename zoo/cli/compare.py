"""``moe-zoo compare``: a grid of compression recipes on one model (``zoo.evaluation.compare``), as a table, a plot
and the best recipe per budget."""
import click

from zoo.cli.helpers import calibration_spec, save_folder


@click.command()
@click.argument("model")
@click.option("--out", required=True, callback=save_folder,
              help="Folder for compare.jsonl/csv/json/png (a rerun into it skips the cells already measured).")
@click.option("--windows", type=click.IntRange(min=1), default=4, show_default=True,
              help="Held-out windows of 256 tokens per domain for each cell.")
@click.option("--kv", "kv", default="full,int8,int4", show_default=True,
              help="Key/value cache precisions, comma-separated (full, fp8, int8, int4).")
@click.option("--calibration", callback=calibration_spec,
              help="Calibration data of the cells that use it: DOMAIN[:TOKENS] of the shipped corpus (english, code, "
                   "mixed; default mixed:8192). Fewer tokens: faster cells on a large checkpoint.")
@click.option("--skip", multiple=True, metavar="CELL",
              help="Leave out a cell of the grid by its label (repeatable), e.g. --skip 'sub-moe 4' on a large model.")
@click.option("--stream/--no-stream", default=None, help="Force layer-at-a-time cells from the shards (or in memory).")
def compare(model, out, windows, kv, calibration, skip, stream):
    """Compress MODEL with every recipe of the grid (pruning x quantization x KV precision, merging and decomposition
    at the pruning's expert count) and measure each cell alike: perplexity per domain, bytes, the Pareto front."""
    from zoo.cli.helpers import one_line
    from zoo.evaluation.compare import _bytes, apply_line, best_per_budget, compare as run

    precisions = tuple(p.strip() for p in kv.split(",") if p.strip())
    with one_line():
        rows = run(model, out, windows=windows, kv=precisions, stream=stream, calibration=calibration,
                   skip=tuple(skip))
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: (r["ppl geo-mean"], r["weight bytes"]))
    click.echo(f"{'cell':32} {'kv':5} {'ppl geo-mean':>12} {'MB':>9}")
    for r in ok:
        click.echo(f"{r['cell']:32} {r['kv']:5} {r['ppl geo-mean']:12.3f} {_bytes(r) / 1e6:9.3f}")
    for r in rows:
        if "error" in r:
            click.echo(f"{r['cell']:32} {r['kv']:5} not run: {r['error']}")
    for b in best_per_budget(rows):
        click.echo(f"best within {b['budget']:.0%} of the bytes: {b['cell']} (kv {b['kv']}, ppl {b['ppl geo-mean']:.3f})"
                   f": {apply_line(model, b['steps'])}")
    click.echo(f"table, plot and JSON in {out}/compare.*")
