"""router-explorer: which experts fire for each token, in each MoE layer, under any registered router and
the options it declares (``zoo.components.controls``: top-k, p, the experts steer switches off, ...).

Every analysis applies the chosen router (``zoo.apply``, gate weights kept) to a fresh copy of the base
model, so nothing accumulates between runs. A router that cannot run on the model says why instead of showing
a result. Set ``MOE_ZOO_MODEL`` to explore another model.
"""
import copy
import functools
import math
import os

import gradio as gr
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.editing.apply import NoChange  # noqa: E402
from zoo.moe.layout import moe_layers  # noqa: E402
from zoo.demos.spaces import (MAX_FILE_SIZE, MAX_PROMPT_CHARS, ControlPanel, apply_component, cut_text,  # noqa: E402
                        one_at_a_time)

MODEL = os.environ.get("MOE_ZOO_MODEL", "zoo-tiny-moe")
MAX_TOKENS = 48
EXAMPLE = "To be, or not to be, that is the question.\ndef question(x):\n    return not x"


@one_at_a_time
@functools.cache
def base():
    """The base model and its tokenizer, loaded once, on first use."""
    return zoo.load(MODEL).eval(), zoo.load_tokenizer(MODEL)


def model_router() -> str:
    """The name of the base model's own router (the dropdown's value on page load)."""
    return moe_layers(base()[0])[0][1].router.name


PANEL: ControlPanel | None = None  # the router dropdown and each router's declared controls (build_demo)


def panel() -> ControlPanel:
    if PANEL is None:
        raise RuntimeError("build_demo() builds the router controls first")
    return PANEL


@torch.no_grad()
def route(text: str, router: str, options: dict | None = None):
    """Apply ``router`` with ``options``; return token labels, per-layer [T, E] routing weights, perplexity."""
    text = cut_text(text, MAX_PROMPT_CHARS)  # only the first MAX_TOKENS tokens are used: never tokenise more
    _, options = panel().resolve(router, options)  # bounded, and a router that does not fit the model says so
    model, tok = base()
    fresh = copy.deepcopy(model)
    try:
        model = apply_component(fresh, router, options)
    except NoChange:  # the model's own router and options: analyse it as it is (apply left the copy untouched)
        model = fresh
    ids = torch.tensor([[tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids[:MAX_TOKENS]])
    if ids.shape[1] < 2:
        raise gr.Error("Type some text first.")
    layers = moe_layers(model)
    grids = {i: torch.zeros(ids.shape[1], moe.num_experts) for i, moe in layers}

    def record(module, args, routing, i):
        keep = routing.indices < grids[i].shape[1]  # index == num_experts marks an empty slot
        rows = torch.arange(routing.indices.shape[0])[:, None].expand_as(keep)
        grids[i][rows[keep], routing.indices[keep]] = routing.weights[keep].float()

    for i, moe in layers:  # hooks on the throwaway copy: nothing to remove
        moe.router.register_forward_hook(functools.partial(record, i=i))
    logits = model(input_ids=ids, output_router_logits=False).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()  # the LM loss alone, no aux loss
    labels = [tok.decode([t]).replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") for t in ids[0, 1:]]
    return labels, {i: g[1:] for i, g in grids.items()}, math.exp(loss)  # drop the BOS row


def heatmap(labels, grids, title):
    """One panel per layer: tokens down, experts across, colour = routing weight (white = not picked)."""
    fig, axes = plt.subplots(1, len(grids), figsize=(1.2 + 2.6 * len(grids), 1.4 + 0.22 * len(labels)),
                             squeeze=False, sharey=True)
    vmax = max(1.0, max(float(g.max()) for g in grids.values()))
    for ax, (i, g) in zip(axes[0], grids.items()):
        im = ax.imshow(g.numpy(), cmap="Blues", vmin=0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(f"layer {i}")
        ax.set_xlabel("expert")
        ax.set_xticks(range(g.shape[1]))  # integer expert ticks
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].set_yticks(range(len(labels)), labels, fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="routing weight", shrink=0.8)
    fig.suptitle(title)
    return fig


@one_at_a_time
def analyze(text: str, router: str, options: dict | None = None):
    """Heatmap, perplexity and the per-token expert assignment (one column per layer)."""
    labels, grids, ppl = route(text, router, options)
    shown = ", ".join(f"{k}={v}" for k, v in (options or {}).items())
    fig = heatmap(labels, grids, f"{router}" + (f" ({shown})" if shown else "")[:80] + f": perplexity {ppl:.2f}")
    rows = [[t] + [", ".join(str(e) for e in g[n].nonzero().flatten().tolist()) for g in grids.values()]
            for n, t in enumerate(labels)]
    table = {"headers": ["token"] + [f"layer {i}" for i in grids], "data": rows}
    return fig, round(ppl, 4), table


def build_demo() -> gr.Blocks:
    global PANEL
    with gr.Blocks(title="MoE router explorer", analytics_enabled=False) as demo:
        gr.Markdown(f"# MoE router explorer\nWhich experts does each token go to? Model: `{MODEL}`. "
                    f"Pick a router and a preset, change its options, and watch the assignment and the perplexity "
                    f"change (first {MAX_TOKENS} tokens of at most {MAX_PROMPT_CHARS:,} characters).")
        with gr.Row():
            text = gr.Textbox(EXAMPLE, label="text", lines=4, scale=3, elem_id="text", max_length=MAX_PROMPT_CHARS)
            with gr.Column(scale=2):
                PANEL = ControlPanel("router", lambda cls: base()[0], default="topk-softmax")
                ppl = gr.Number(label="perplexity of the text", precision=2, elem_id="perplexity")
                run = gr.Button("Analyze", variant="primary", elem_id="analyze")
        plot = gr.Plot(label="expert assignment", format="png", elem_id="heatmap")
        table = gr.Dataframe(label="experts per token and layer", wrap=True, elem_id="assignment")
        inputs, outputs = [text, PANEL.name, PANEL.options], [plot, ppl, table]
        gr.on([run.click, text.submit], analyze, inputs, outputs, api_name="analyze", trigger_mode="always_last")
        demo.load(model_router, None, PANEL.name, api_name="defaults").then(
            PANEL.select, [PANEL.name, PANEL.preset], PANEL.outputs(), api_visibility="private").then(
            analyze, inputs, outputs, api_visibility="undocumented")
        PANEL.on_select([PANEL.name.input, PANEL.preset.input]).then(
            analyze, inputs, outputs, api_visibility="undocumented")
    return demo


if __name__ == "__main__":
    build_demo().launch(max_file_size=MAX_FILE_SIZE)
