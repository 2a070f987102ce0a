"""adapter-lab: fine-tune the embedded model live with any registered adapter, with the options it declares
(``zoo.components.controls``: mild and strong presets, and each option), on one domain, for a few steps, and see
held-out perplexity per domain before/after, the training loss, and expert usage before/after.

Each run attaches the adapter (``zoo.apply``) to a fresh copy of the base model and trains it with
``zoo.training.finetune.finetune``, the code behind ``moe-zoo finetune``. An adapter that builds an MoE from a dense model
(``accepts_dense``: upcycle, moefy) starts from ``zoo-tiny-dense``. Models load lazily, on first use.
Expert kinds such as MoFME's (``mofme``: one shared FFN, a FiLM per expert) are shown through the adapter that
builds them: ``upcycle`` with ``experts="mofme"``.
"""
import copy
import functools
import os

import gradio as gr
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

import zoo
from zoo.data.corpus import DOMAINS
from zoo.training.finetune import finetune
from zoo.components.registry import get_model
from zoo.demos.spaces import (MAX_FILE_SIZE, MAX_OPTION_VALUE, ControlPanel, check_number, integer_ticks,
                        one_at_a_time)

MODEL = os.environ.get("MOE_ZOO_MODEL", "zoo-tiny-moe")
DENSE = "zoo-tiny-dense"  # for adapters that build an MoE from a dense model (upcycle, moefy)
WINDOWS = int(os.environ.get("MOE_ZOO_LAB_WINDOWS", "4"))
BATCH, SEQ_LEN, MAX_STEPS = 4, 128, 60
MAX_LR = 1.0
PANEL: ControlPanel | None = None  # the adapter dropdown and each adapter's declared controls (build_demo)


def models() -> list[str]:
    dense = get_model(DENSE).local_path
    return [MODEL] + ([DENSE] if dense and os.path.isfile(os.path.join(dense, "config.json")) else [])


def model_name(cls) -> str:
    """The model an adapter trains: the dense one for adapters that build an MoE from it (when it is here)."""
    return DENSE if cls.accepts_dense and DENSE in models() else MODEL


@one_at_a_time
@functools.cache
def base(name: str):
    return zoo.load(name, dtype=torch.float32).eval()


@one_at_a_time
def run(adapter: str, options: dict | None, domain: str, steps: int, lr: float):
    steps = int(check_number(steps, "steps", 1, MAX_STEPS))
    lr = check_number(lr, "learning rate", 0, MAX_LR)
    if domain not in DOMAINS:
        raise gr.Error(f"domain must be one of {', '.join(DOMAINS)}; got {domain!r}")
    cls, options = PANEL.resolve(adapter, options)
    try:
        result = finetune(copy.deepcopy(base(model_name(cls))), adapter, options, domain=domain, steps=steps, lr=lr,
                          batch_size=BATCH, seq_len=SEQ_LEN, windows=WINDOWS, progress=False)
    except (ValueError, TypeError, KeyError) as exc:
        raise gr.Error(f"{adapter} {options}: {exc}") from None
    rows = [[d, round(result.before["perplexity"][d], 2), round(result.after["perplexity"][d], 2),
             f"{100 * (result.after['perplexity'][d] / result.before['perplexity'][d] - 1):+.1f}%"] for d in DOMAINS]
    table = {"headers": ["domain", "ppl before", "ppl after", "change"], "data": rows}
    return gr.update(value=table, visible=True), plot(result, domain, f"{adapter} on {domain}, {steps} steps")


def shares(result: dict, domain: str):
    """[layers, experts] share of routed tokens on the domain's held-out windows (None without MoE layers)."""
    layers = result["usage"].get(domain) or []
    if not layers:
        return None
    counts = torch.tensor([layer["counts"] for layer in layers], dtype=torch.float)
    return counts / counts.sum(1, keepdim=True).clamp(min=1)


def plot(result, domain: str, title: str):
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, (label, res) in zip(axes, [("before", result.before), ("after", result.after)]):
        share = shares(res, domain)
        if share is None:
            ax.text(0.5, 0.5, "no MoE layers", ha="center", va="center")
            ax.set_axis_off()
            continue
        im = ax.imshow(share.numpy(), cmap="viridis", aspect="auto", vmin=0)
        ax.set_title(f"expert usage {label} ({domain}, ppl {res['perplexity'][domain]:.1f})")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        integer_ticks(ax)
        fig.colorbar(im, ax=ax, label="share of routed tokens")
    steps, losses = zip(*result.history)
    axes[2].plot(steps, losses)
    axes[2].set_title("training loss (LM)")
    axes[2].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def build_demo() -> gr.Blocks:
    global PANEL
    with gr.Blocks(title="MoE adapter lab", analytics_enabled=False) as demo:
        gr.Markdown(f"# MoE adapter lab\nFine-tune `{MODEL}` live with any adapter on one domain and compare "
                    f"held-out perplexity before and after (batches of {BATCH} x {SEQ_LEN} tokens, "
                    f"{WINDOWS} held-out windows per domain). Adapters that build an MoE from a dense model start "
                    f"from `{DENSE}` (`upcycle` with `experts: mofme` builds MoFME's FiLM experts and "
                    f"uncertainty-aware router). Limits: numbers in options up to {MAX_OPTION_VALUE}, "
                    f"{MAX_STEPS} steps, learning rate up to {MAX_LR:g}.")
        PANEL = ControlPanel("adapter", lambda cls: base(model_name(cls)), default="lora-experts")
        with gr.Row():
            domain = gr.Radio(list(DOMAINS), value="code", label="train on")
            steps = gr.Slider(1, MAX_STEPS, value=10, step=1, label="steps")
            lr = gr.Number(2e-3, label="learning rate", minimum=0, maximum=MAX_LR)
            go = gr.Button("Fine-tune", variant="primary", elem_id="finetune")
        table = gr.Dataframe(label="held-out perplexity", elem_id="perplexity", visible=False)  # shown with a run
        usage = gr.Plot(label="expert usage and loss", format="png", elem_id="usage")
        PANEL.on_select([demo.load, PANEL.name.input, PANEL.preset.input])
        go.click(run, [PANEL.name, PANEL.options, domain, steps, lr], [table, usage], api_name="finetune")
    return demo


if __name__ == "__main__":
    build_demo().launch(max_file_size=MAX_FILE_SIZE)
