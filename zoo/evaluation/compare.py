"""``moe-zoo compare MODEL``: a grid of compression recipes on one model, measured alike, as one table and one plot.

The grid composes three axes, as MoEXBench does (expert pruning x weight quantization x key/value cache precision),
and adds merging and decomposition alone at the pruning's expert count: every weights cell is applied once to a
fresh copy of the model and measured at every KV precision. One measure for all: the perplexity of each corpus
domain's first ``windows`` held-out windows of 256 tokens, fed 32 tokens at a time through the cache
(``zoo.runtime.kv_cache.kv_perplexity``; at full precision this is the one-pass perplexity), the geometric mean over
domains, the weights' bytes and the cache's bytes for one window. Every cell is appended to ``compare.jsonl`` in
the output folder as soon as it is measured: a rerun skips the cells already there (resumable). Then
``compare.csv``, ``compare.json`` and ``compare.png`` (quality against bytes, the Pareto front drawn and named),
and the best recipe under each budget with its ``moe-zoo apply`` line.

A checkpoint larger than the memory budget is streamed: each weights cell is written layer by layer
(``zoo.editing.stream.apply``) into the output folder's ``cells/`` and evaluated from its shards
(``zoo.editing.stream.evaluate``: one-pass perplexity, so the KV axis is full precision only).
"""
from __future__ import annotations

import copy
import csv
import io
import json
import math
import os
from pathlib import Path

from tqdm.auto import tqdm

from zoo.io.atomic import atomic_file, write_text

FILES = ("compare.jsonl", "compare.csv", "compare.json", "compare.png")
KV_PRECISIONS = ("full", "int8", "int4")


def default_grid(num_experts: int) -> list[tuple[str, list]]:
    """(label, recipe steps) of the weights cells for a model of ``num_experts`` experts per layer."""
    half, three_quarters = max(1, num_experts // 2), max(1, round(num_experts * 0.75))
    prunes = [("", []), (f"reap {three_quarters}", [("prune-reap", {"num_experts": three_quarters})]),
              (f"reap {half}", [("prune-reap", {"num_experts": half})]),
              (f"reap {half} global", [("prune-reap", {"num_experts": half, "allocation": "global"})])]
    quants = [("", []), ("int8", [("quantize", {"bits": 8})]), ("int4", [("quantize", {"bits": 4})])]
    cells = [(" + ".join(p for p in (pl, ql) if p) or "base", ps + qs) for pl, ps in prunes for ql, qs in quants]
    cells += [(f"hc-smoe {half}", [("hc-smoe", {"num_experts": half})]),
              (f"sub-moe {half}", [("sub-moe", {"num_experts": half})]),
              ("moe-svd 0.5", [("moe-svd", {"ratio": 0.5})])]
    return cells


def apply_line(model: str, steps: list) -> str:
    """The ``moe-zoo apply`` command that makes a cell's weights."""
    def step(name, options):
        return name + (":" + ",".join(f"{k}={v}" for k, v in options.items()) if options else "")

    return f"moe-zoo apply {model} " + " ".join(step(n, o) for n, o in steps) + " --out OUT" if steps else \
        f"(the model as it is: {model})"


def shipped_grid(model_name: str) -> list[dict] | None:
    """The cells of the grid shipped for one of the zoo's models (``zoo/_data/compare/<name>.json``, written by
    ``moe-zoo compare``), or None."""
    path = Path(__file__).resolve().parents[1] / "_data" / "compare" / f"{model_name}.json"
    return json.loads(path.read_text())["cells"] if path.is_file() else None


def cell_key(steps: list, kv: str) -> str:
    return json.dumps([steps, kv], sort_keys=True)


def compare(model_name: str, out, windows: int = 4, grid: list | None = None, kv: tuple = KV_PRECISIONS,
            stream: bool | None = None, max_memory=None, calibration=None, skip: tuple = ()) -> list[dict]:
    """Run the grid on ``model_name`` (a folder or registry name) into folder ``out``; returns every cell's row.
    ``skip``: labels of cells to leave out (e.g. one too slow for a large checkpoint)."""
    import zoo
    from zoo.editing import stream as streaming

    from zoo.runtime.kv_cache import check_precision

    for precision in kv:
        check_precision(precision)
    out = Path(out)
    streamed = streaming.should_stream(model_name, max_memory) if stream is None else stream
    if streamed and set(kv) - {"full"}:
        kv = ("full",)  # the cache needs the model in memory; a streamed evaluation is one pass
    base = None if streamed else zoo.load(model_name).eval()
    if grid is None:
        counts = _expert_count(base if base is not None else streaming.open_checkpoint(model_name).model)
        grid = default_grid(counts)
    labels = [label for label, _ in grid]
    for label in skip:
        if label not in labels:
            from zoo.components.options import suggest

            raise ValueError(f"no cell {label!r} in the grid (cells: {', '.join(labels)}){suggest(label, labels)}")
    grid = [(label, steps) for label, steps in grid if label not in skip]
    out.mkdir(parents=True, exist_ok=True)
    done = _measured(out / "compare.jsonl")
    todo = [(label, steps) for label, steps in grid if any(cell_key(steps, p) not in done for p in kv)]
    for label, steps in tqdm(todo, desc="compare: cells", disable=not todo):
        try:
            if streamed:
                rows = [_streamed_cell(model_name, out, label, steps, windows, calibration)]
            else:
                model = copy.deepcopy(base)
                for name, options in steps:
                    model = zoo.apply(model, name, calibration=calibration, **options)
                rows = [_cell(model, label, steps, precision, windows) for precision in kv
                        if cell_key(steps, precision) not in done]
                del model
        except ValueError as exc:  # a recipe this model cannot take (e.g. too few experts): said in the table
            if not steps:  # the model itself cannot be measured (e.g. its tokenizer does not fit): no cell can
                raise ValueError(f"{model_name} cannot be evaluated as it is, so no cell can: {exc}") from None
            rows = [{"cell": label, "kv": p, "steps": steps, "error": str(exc)} for p in kv]
        for row in rows:
            row["key"] = cell_key(steps, row["kv"])
            done[row["key"]] = row
        _write_jsonl(out / "compare.jsonl", done)
    rows = [r for r in done.values()]
    write_tables(out, rows, model_name)
    return rows


def _expert_count(model) -> int:
    from zoo.moe.layout import moe_layers

    return max(moe.num_experts for _, moe in moe_layers(model))


def _cell(model, label, steps, precision, windows) -> dict:
    from zoo.data.corpus import DOMAINS
    from zoo.data.tokens import eval_windows, token_stream
    from zoo.evaluation.eval import sizes
    from zoo.io.loading import tokenizer_for
    from zoo.runtime.kv_cache import kv_perplexity

    tok = tokenizer_for(model, required=True)
    ppl, cache = {}, 0
    for domain in DOMAINS:
        ids = eval_windows(token_stream(domain, "val", tok), 256)[:windows]
        ppl[domain], cache = kv_perplexity(model, ids, precision)
    size = sizes(model)
    return {"cell": label, "kv": precision, "steps": steps, **{f"ppl {d}": round(v, 4) for d, v in ppl.items()},
            "ppl geo-mean": round(_geo(ppl.values()), 4), "weight bytes": size["bytes"], "kv bytes": cache,
            "active params": size["active_params"]}


def _streamed_cell(src, out, label, steps, windows, calibration) -> dict:
    from zoo.editing import stream as streaming

    folder = src
    if steps:
        folder = out / "cells" / label.replace(" ", "_").replace("+", "and")
        if not folder.exists():
            streaming.apply(src, steps, folder, calibration=calibration)
    result = streaming.evaluate(os.fspath(folder), max_windows=windows, ood=False)
    ppl = result["perplexity"]
    return {"cell": label, "kv": "full", "steps": steps, **{f"ppl {d}": v for d, v in ppl.items()},
            "ppl geo-mean": round(_geo(ppl.values()), 4), "weight bytes": result["size"]["bytes"], "kv bytes": None,
            "active params": result["size"]["active_params"]}


def _geo(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _measured(path: Path) -> dict:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"]: r for r in rows if "key" in r and "error" not in r}  # failed cells are tried again


def _write_jsonl(path: Path, rows: dict) -> None:
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows.values()), overwrite=True)


def pareto(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both bytes (weights + cache) and quality (lower geo-mean perplexity)."""
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: (_bytes(r), r["ppl geo-mean"]))
    front, best = [], math.inf
    for r in ok:
        if r["ppl geo-mean"] < best:
            front.append(r)
            best = r["ppl geo-mean"]
    return front


def _bytes(row) -> int:
    return row["weight bytes"] + (row["kv bytes"] or 0)


def best_per_budget(rows: list[dict], fractions=(0.25, 0.5, 0.75, 1.0)) -> list[dict]:
    """For each budget (a fraction of the uncompressed cell's bytes): the best-quality cell within it."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return []
    full = max((_bytes(r) for r in ok if not r["steps"] and r["kv"] == "full"), default=max(map(_bytes, ok)))
    out = []
    for f in fractions:
        fits = [r for r in ok if _bytes(r) <= f * full]
        if fits:
            out.append({"budget": f, **min(fits, key=lambda r: r["ppl geo-mean"])})
    return out


def write_tables(out: Path, rows: list[dict], model_name: str) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r if k not in ("key", "steps")))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text(out / "compare.csv", text.getvalue(), overwrite=True)
    summary = {"model": model_name, "cells": rows, "pareto": [r["key"] for r in pareto(rows)],
               "best": [{"budget": b["budget"], "cell": b["cell"], "kv": b["kv"], "ppl geo-mean": b["ppl geo-mean"],
                         "bytes": _bytes(b), "apply": apply_line(model_name, b["steps"])}
                        for b in best_per_budget(rows)]}
    write_text(out / "compare.json", json.dumps(summary, indent=1) + "\n", overwrite=True)
    plot(rows, out / "compare.png", model_name)


def figure(rows: list[dict], title: str):
    """Quality against bytes, one marker per KV precision, the Pareto front drawn and named (a matplotlib figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    front = pareto(ok)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for precision, marker in zip(KV_PRECISIONS, "os^"):
        mine = [r for r in ok if r["kv"] == precision]
        if mine:
            ax.scatter([_bytes(r) / 1e6 for r in mine], [r["ppl geo-mean"] for r in mine], marker=marker,
                       label=f"kv {precision}", alpha=0.7)
    ax.plot([_bytes(r) / 1e6 for r in front], [r["ppl geo-mean"] for r in front], "k--", lw=1, label="Pareto front")
    for n, r in enumerate(front):  # alternate sides: neighbouring points of the front sit close together
        ax.annotate(f"{r['cell']} / kv {r['kv']}", (_bytes(r) / 1e6, r["ppl geo-mean"]), fontsize=7,
                    xytext=(4, 6 if n % 2 else -10), textcoords="offset points")
    ax.set_xlabel("MB (weights + key/value cache of one 256-token window)")
    ax.set_ylabel("perplexity (geometric mean over domains)")
    ax.set_title(f"compression recipes on {title}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    try:
        with atomic_file(path, overwrite=True) as staged:
            fig.savefig(staged, dpi=100, format="png")
    finally:
        plt.close(fig)
