"""compression-lab: compress the embedded model with any registered compressor, with the options it declares
(``zoo.components.controls``: a mild and a strong preset, and each option), and see what it costs: expert bytes
against perplexity for every run so far (the Pareto view), and per-expert saliency with the experts the last
run pruned or merged marked. For the zoo's shipped models, the grid ``moe-zoo compare`` measured (pruning x
quantization x KV-cache precision, merging, decomposition) as a plot, and the best recipe within a chosen budget.

Each run applies the compressor with ``zoo.apply`` to a fresh copy of the base model, calibrated on a
small slice of the corpus' training split, and evaluates on a few held-out windows per domain
(``MOE_ZOO_LAB_WINDOWS``, ``MOE_ZOO_LAB_TOKENS``: smaller is faster).
"""
import copy
import functools
import os

import gradio as gr
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.editing import calibration  # noqa: E402
from zoo.editing.apply import NoChange  # noqa: E402
from zoo.evaluation.eval import evaluate  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402
from zoo.editing.stats import collect  # noqa: E402
from zoo.demos.spaces import MAX_FILE_SIZE, ControlPanel, apply_component, integer_ticks, one_at_a_time  # noqa: E402

MODEL = os.environ.get("MOE_ZOO_MODEL", "zoo-tiny-moe")
WINDOWS = int(os.environ.get("MOE_ZOO_LAB_WINDOWS", "4"))
CALIBRATION = calibration.corpus("mixed", tokens=int(os.environ.get("MOE_ZOO_LAB_TOKENS", "4096")))
PANEL: ControlPanel | None = None  # the compressor dropdown and each compressor's declared controls (build_demo)


@one_at_a_time
@functools.cache
def base():
    return zoo.load(MODEL).eval()


def expert_bytes(model) -> int:
    return sum(moe.experts.nbytes() for _, moe in moe_layers(model))


@one_at_a_time
@functools.cache
def base_result():
    model = base()
    return {"label": "base", "expert_bytes": expert_bytes(model),
            "perplexity": evaluate(model, max_windows=WINDOWS, measure_speed=False, ood=False)["perplexity"]}


def label(method: str, options: dict) -> str:
    return f"{method} " + ", ".join(f"{k}={v}" for k, v in options.items())


@one_at_a_time
def run(method: str, options: dict | None, history: list):
    """Compress a copy of the base model; the Pareto plot, the table of runs, the history, the saliency map."""
    _, options = PANEL.resolve(method, options)
    try:
        model = apply_component(copy.deepcopy(base()), method, options, calibration=CALIBRATION)
    except NoChange as exc:
        raise gr.Error(str(exc)) from None
    step = model.config.zoo_recipe[-1]
    result = {"label": label(method, options), "expert_bytes": expert_bytes(model),
              "perplexity": evaluate(model, max_windows=WINDOWS, measure_speed=False, ood=False)["perplexity"],
              "removed": removed_experts(step.get("results") or {})}
    history = [r for r in history if r["label"] != result["label"]] + [result]
    return pareto(history), gr.update(value=table(history), visible=True), history, saliency(result)


def removed_experts(results: dict) -> dict[int, list[int]]:
    """``{layer: [experts]}`` a step pruned (not ``kept``) or merged into another (``clusters`` past the first)."""
    n = {i: moe.num_experts for i, moe in moe_layers(base())}
    if "kept" in results:
        return {int(i): sorted(set(range(n[int(i)])) - set(kept)) for i, kept in results["kept"].items()}
    if "clusters" in results:
        return {int(i): sorted(e for group in groups for e in group[1:]) for i, groups in results["clusters"].items()}
    return {}


def pareto(history: list):
    """Expert bytes (x) against mean perplexity (y): lower-left is better."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in [base_result()] + history:
        ppl = sum(r["perplexity"].values()) / len(r["perplexity"])
        ax.scatter(r["expert_bytes"] / 1e6, ppl, s=60, marker="*" if r["label"] == "base" else "o")
        ax.annotate(r["label"], (r["expert_bytes"] / 1e6, ppl), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("expert bytes (MB)")
    ax.set_ylabel("perplexity (mean over domains)")
    ax.set_title(f"{MODEL}: size vs quality")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def table(history: list):
    rows = [[r["label"], round(r["expert_bytes"] / 1e6, 3)] + [round(v, 2) for v in r["perplexity"].values()]
            for r in [base_result()] + history]
    return {"headers": ["run", "expert MB"] + [f"ppl {d}" for d in base_result()["perplexity"]], "data": rows}


@one_at_a_time
@functools.cache
@torch.no_grad()
def expert_stats():
    """Per layer and expert of the base model: routing frequency and REAP saliency on the calibration slice."""
    stats = collect(base(), calibration.batches(CALIBRATION, zoo.load_tokenizer(MODEL)), desc="saliency")
    return [("routing frequency", [s.frequency for s in stats]), ("REAP saliency", [s.reap for s in stats])]


@one_at_a_time
def saliency(result: dict | None = None):
    """The base model's per-expert saliency; the experts ``result`` pruned or merged away are crossed out."""
    panels = expert_stats()
    layers = [i for i, _ in moe_layers(base())]
    removed = (result or {}).get("removed") or {}
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.2 + 0.4 * len(layers)), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels):
        im = ax.imshow(torch.stack([v.float() for v in values]).numpy(), cmap="magma", aspect="auto")
        for row, layer in enumerate(layers):
            gone = removed.get(layer, [])
            ax.scatter(gone, [row] * len(gone), marker="x", s=60, c="cyan", linewidths=2,
                       label="removed by the last run" if row == 0 and gone else None)
        ax.set_title(title)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_yticks(range(len(layers)), [str(i) for i in layers])
        integer_ticks(ax, "x")
        fig.colorbar(im, ax=ax)
    if removed:
        axes[0][0].legend(loc="upper center", bbox_to_anchor=(1.1, -0.25), fontsize=8, frameon=False)
        fig.suptitle(f"{result['label']}: x = experts removed")
    fig.tight_layout()
    return fig


def recipe_for_budget(budget: float):
    """The shipped grid's plot and the best recipe within ``budget`` (a fraction of the uncompressed bytes)."""
    from zoo.evaluation.compare import _bytes, apply_line, best_per_budget, figure, shipped_grid

    rows = shipped_grid(MODEL)
    if not rows:
        return None, (f"No recipe grid is shipped for `{MODEL}`: `moe-zoo compare {MODEL} --out DIR` measures one "
                      "(about a quarter of an hour on a laptop CPU for the zoo's tiny models).")
    fig = figure(rows, MODEL)
    full = max(_bytes(r) for r in rows if "error" not in r and not r["steps"] and r["kv"] == "full")
    fig.axes[0].axvline(budget * full / 1e6, color="red", lw=1, ls=":", label="budget")
    best = best_per_budget(rows, (budget,))
    if not best:
        return fig, f"No recipe of the grid fits in {budget:.0%} of the uncompressed bytes."
    b = best[0]
    return fig, (f"Best within {budget:.0%} of the bytes ({budget * full / 1e6:.1f} MB): **{b['cell']}** with a "
                 f"{b['kv']} key/value cache, perplexity {b['ppl geo-mean']:.2f} ({_bytes(b) / 1e6:.1f} MB).\n\n"
                 f"`{apply_line(MODEL, b['steps'])}`")


def expert_kinds() -> dict:
    """The expert kinds shown with this Space (what quantize, moe-svd and channel-topk turn experts into)."""
    rows = [[c["name"], c["summary"]] for c in zoo.list_components("experts") if c["space"] == "compression-lab"]
    return {"headers": ["expert kind", "what it stores"], "data": rows}


def build_demo() -> gr.Blocks:
    global PANEL
    with gr.Blocks(title="MoE compression lab", analytics_enabled=False) as demo:
        gr.Markdown(f"# MoE compression lab\nCompress `{MODEL}` with any compressor and compare expert bytes with "
                    f"perplexity on held-out text ({WINDOWS} windows per domain). Pick a compressor and a preset "
                    "(mild or strong), adjust its options, and run.")
        history = gr.State([])
        PANEL = ControlPanel("compressor", lambda cls: base(), default="prune-reap")
        go = gr.Button("Compress and evaluate", variant="primary", elem_id="compress")
        plot = gr.Plot(label="size vs quality", format="png", elem_id="pareto")
        results = gr.Dataframe(label="runs: expert MB and held-out perplexity per domain", elem_id="runs",
                               visible=False)  # shown with the first run
        sal = gr.Plot(label="per-expert saliency of the base model (x: removed by the last run)", format="png",
                      elem_id="saliency")
        with gr.Accordion("recipe grid: the best recipe within a budget (moe-zoo compare)", open=False):
            budget = gr.Slider(0.1, 1.0, value=0.5, step=0.05, label="budget: fraction of the uncompressed bytes",
                               elem_id="budget")
            grid_plot = gr.Plot(label="every recipe of the grid: bytes vs quality", format="png", elem_id="grid")
            recipe = gr.Markdown(elem_id="recipe")
        budget.change(recipe_for_budget, budget, [grid_plot, recipe], api_name="best_recipe")
        with gr.Accordion("expert kinds the compressors produce", open=False):
            gr.Dataframe(expert_kinds(), interactive=False, wrap=True, show_label=False)
        go.click(run, [PANEL.name, PANEL.options, history], [plot, results, history, sal], api_name="compress")
        PANEL.on_select([demo.load, PANEL.name.input, PANEL.preset.input])
        demo.load(saliency, None, sal, api_name="saliency")
    return demo


if __name__ == "__main__":
    build_demo().launch(max_file_size=MAX_FILE_SIZE)  # no file inputs; the limit still caps /upload
