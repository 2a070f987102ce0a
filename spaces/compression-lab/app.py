"""compression-lab: compress the embedded model with any compressor at a chosen strength and see what it
costs: expert bytes against perplexity for every run so far (the Pareto view), and per-expert saliency.

Each run applies the compressor with ``zoo.apply`` to a fresh copy of the base model, calibrated on a
small slice of the corpus' training split, and evaluates on a few held-out windows per domain.
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
from zoo import calibration  # noqa: E402
from zoo.eval import evaluate  # noqa: E402
from zoo.layout import moe_layers  # noqa: E402
from zoo.stats import collect  # noqa: E402
from zoo.spaces import MAX_FILE_SIZE  # noqa: E402

MODEL = os.environ.get("MOE_ZOO_MODEL", "zoo-tiny-moe")
WINDOWS = int(os.environ.get("MOE_ZOO_LAB_WINDOWS", "4"))
CALIBRATION = calibration.corpus("mixed", tokens=4096)
# strength -> options, per compressor (fewer experts, or fewer bits)
STRENGTHS = {"mild": {"experts": 0.75, "bits": 8}, "strong": {"experts": 0.5, "bits": 4}}


@functools.cache
def base():
    return zoo.load(MODEL).eval()


def expert_bytes(model) -> int:
    return sum(moe.experts.nbytes() for _, moe in moe_layers(model))


@functools.cache
def base_result():
    model = base()
    return {"label": "base", "expert_bytes": expert_bytes(model),
            "perplexity": evaluate(model, max_windows=WINDOWS, measure_speed=False)["perplexity"]}


def options_for(method: str, strength: str) -> dict:
    s = STRENGTHS[strength]
    if method == "quantize":
        return {"bits": s["bits"]}
    n = max(1, round(moe_layers(base())[0][1].num_experts * s["experts"]))
    return {"num_experts": n}


def run(method: str, strength: str, history: list):
    options = options_for(method, strength)
    try:
        model = zoo.apply(copy.deepcopy(base()), method, calibration=CALIBRATION, **options)
    except (ValueError, TypeError) as exc:
        raise gr.Error(f"{method} {options}: {exc}") from None
    result = {"label": f"{method} {strength}", "expert_bytes": expert_bytes(model),
              "perplexity": evaluate(model, max_windows=WINDOWS, measure_speed=False)["perplexity"]}
    history = [r for r in history if r["label"] != result["label"]] + [result]
    return pareto(history), table(history), history


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


@torch.no_grad()
def saliency():
    """Per layer and expert: routing frequency and REAP saliency on the calibration slice."""
    model = base()
    stats = collect(model, calibration.batches(CALIBRATION, zoo.load_tokenizer(MODEL)), desc="saliency")
    fig, axes = plt.subplots(1, 2, figsize=(9, 2.2 + 0.4 * len(stats)), squeeze=False)
    for ax, (title, values) in zip(axes[0], [("routing frequency", [s.frequency for s in stats]),
                                             ("REAP saliency", [s.reap for s in stats])]):
        im = ax.imshow(torch.stack([v.float() for v in values]).numpy(), cmap="magma", aspect="auto")
        ax.set_title(title)
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return fig


def build_demo() -> gr.Blocks:
    methods = [c["name"] for c in zoo.list_components("compressor")]
    kinds = [c["name"] for c in zoo.list_components("experts") if c["space"] == "compression-lab"]
    with gr.Blocks(title="MoE compression lab", analytics_enabled=False) as demo:
        gr.Markdown(f"# MoE compression lab\nCompress `{MODEL}` and compare expert bytes with perplexity "
                    "on held-out text. Mild = 25% fewer experts or 8 bits; strong = 50% fewer experts or 4 bits. ")
        gr.Dropdown(kinds, value=kinds[0] if kinds else None, label="expert kinds the compressors produce",
                    interactive=False)
        history = gr.State([])
        with gr.Row():
            method = gr.Dropdown(methods, value=methods[0], label="compressor")
            strength = gr.Radio(list(STRENGTHS), value="mild", label="strength")
            go = gr.Button("Compress and evaluate", variant="primary", elem_id="compress")
        plot = gr.Plot(label="size vs quality", format="png", elem_id="pareto")
        results = gr.Dataframe(label="runs", elem_id="runs")
        sal = gr.Plot(label="per-expert saliency", format="png", elem_id="saliency")
        go.click(run, [method, strength, history], [plot, results, history], api_name="compress")
        demo.load(saliency, None, sal, api_name="saliency")
    return demo


if __name__ == "__main__":
    build_demo().launch(max_file_size=MAX_FILE_SIZE)  # no file inputs; the limit still caps /upload
