"""multimodal-digits: draw a digit and/or say one; see zoo-tiny-mm's answer and which expert groups fired."""
import functools
import os

import gradio as gr
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

import zoo  # noqa: F401  (loads the plugins: zoo_mm, its processor and components)
from zoo.demos.spaces import (MAX_AUDIO_SECONDS, MAX_FILE_SIZE, MAX_IMAGE_PIXELS, check_audio, check_number, check_text,
                        one_at_a_time)

MODEL = os.environ.get("MOE_ZOO_MM_MODEL", "zoo-tiny-mm")
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MODALITIES = ("text", "vision", "audio")
MAX_PROMPT_CHARS = 200  # the model was trained on short questions ("which digit ?")


@one_at_a_time
@functools.cache
def base():
    from zoo_multimodal.evaluate_mm import load_model

    return load_model(MODEL)


def components() -> list[str]:
    """Every registered component that names this Space (zoo_mm and its parts, plugins' included)."""
    return [c["name"] for c in zoo.list_components() if c["space"] == "multimodal-digits"]


def card(name):
    from zoo.publishing.cards import render_component_card
    from zoo.components.registry import registry

    kind = next(c["kind"] for c in zoo.list_components() if c["name"] == name and c["space"] == "multimodal-digits")
    return render_component_card(registry.get(kind, name).obj, {"family": "zoo_mm", "layout_summary": "see the model",
                                                                  "recipe": []})


def crop_digit(image):
    """A drawn or uploaded digit, grey with bright ink, cropped to its ink and padded to a square."""
    if isinstance(image, dict):  # Sketchpad / ImageEditor value
        image = image.get("composite")
    if image is None:
        return None
    if np.shape(image)[0] * np.shape(image)[1] > MAX_IMAGE_PIXELS:
        raise gr.Error(f"the image is too large: {np.shape(image)[1]} x {np.shape(image)[0]} pixels, "
                       f"at most {MAX_IMAGE_PIXELS:,} pixels.")
    x = np.asarray(image, dtype=np.float32)
    if x.ndim == 3:
        alpha = x[..., 3:4] / 255.0 if x.shape[-1] == 4 else 1.0
        x = (x[..., :3].mean(-1, keepdims=True) * alpha + 255.0 * (1 - alpha))[..., 0]
    x = (x - x.min()) / max(1e-6, float(x.max() - x.min()))
    if x.mean() > 0.5:
        x = 1 - x
    rows, cols = np.nonzero(x > 0.2)
    if len(rows) == 0:
        return None
    x = x[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
    side = int(max(x.shape) * 1.15) + 1
    out = np.zeros((side, side), dtype=np.float32)
    r, c = (side - x.shape[0]) // 2, (side - x.shape[1]) // 2
    out[r:r + x.shape[0], c:c + x.shape[1]] = x
    return out * 16


@one_at_a_time
@torch.no_grad()
def answer(image, audio, prompt, snr):
    prompt = check_text(prompt, "prompt", MAX_PROMPT_CHARS)
    snr = None if snr is None else check_number(snr, "SNR", -10, 40)
    image = crop_digit(image)
    samples, rate = None, 22050
    if audio is not None:
        rate, samples = audio
        check_audio(rate, samples, "the spoken digit")
        samples = np.asarray(samples, dtype=np.float32)
        if samples.ndim == 2:
            samples = samples.mean(-1)
        if snr is not None and snr < 40:
            from zoo_multimodal.digits import add_noise

            samples = add_noise(samples, float(snr))
    if image is None and samples is None:
        raise gr.Error("Draw or upload a digit, or record or upload a spoken digit.")
    model, processor = base()
    inputs = processor(text=[prompt or "which digit ?"], images=[image], audio=[samples], sampling_rate=rate)
    seen, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.mlp.router.register_forward_hook(lambda m, a, o: seen.append(m.group_probs(a[0]))))
    vision = []
    if model.model.vision_moe is not None:
        hooks.append(model.model.vision_moe.router.register_forward_hook(lambda m, a, o: vision.append(o.indices[0])))
    try:
        probs = model.answer_probs(inputs, processor.digit_token_ids(WORDS))[0]
        _, keys, kinds = model.model(**{k: v for k, v in inputs.items() if k != "labels"})
    finally:
        for h in hooks:
            h.remove()
    present = keys[0].bool()
    usage = {}
    for m, name in enumerate(MODALITIES):
        sel = present & (kinds == m)
        if sel.any():
            usage[name] = torch.stack([p[:len(sel)][sel] for p in seen[:len(model.model.layers)]]).mean((0, 1))
    return ({w: float(p) for w, p in zip(WORDS, probs)}, usage_plot(usage, model.model.layers[0].mlp.experts.groups),
            [[name, *(f"{v:.2f}" for v in u.tolist())] for name, u in usage.items()] +
            [["visual experts (language-conditioned)", ", ".join(str(int(e)) for e in vision[0]) if vision and
              image is not None else "-", "", ""]])


def usage_plot(usage, groups):
    fig, ax = plt.subplots(figsize=(6, 3))
    width = 0.8 / max(1, len(usage))
    for i, (name, u) in enumerate(usage.items()):
        ax.bar(np.arange(len(groups)) + i * width, u.numpy(), width, label=f"{name} tokens")
    ax.set_xticks(np.arange(len(groups)) + width * (len(usage) - 1) / 2, [f"{g} group" for g in groups])
    ax.set_ylim(0, 1)
    ax.set_ylabel("group gate probability")
    ax.set_title("which expert groups fired (mean over layers and tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def build_demo() -> gr.Blocks:
    with gr.Blocks(title="MoE multimodal digits") as demo:
        gr.Markdown("# Multimodal digits\nDraw or upload a digit and/or record or upload a spoken digit word; "
                    "`zoo-tiny-mm` answers, and the plot shows which modality expert groups its "
                    "hierarchical-modality router used for each kind of token. Limits: speech up to "
                    f"{MAX_AUDIO_SECONDS} s, uploads up to {MAX_FILE_SIZE.upper()}, prompt up to "
                    f"{MAX_PROMPT_CHARS} characters.")
        with gr.Row():
            image = gr.Sketchpad(label="digit (draw, or upload in the editor)", type="numpy", elem_id="digit")
            with gr.Column():
                audio = gr.Audio(sources=["upload", "microphone"], type="numpy", label="spoken digit", elem_id="speech")
                prompt = gr.Textbox("which digit ?", label="prompt", max_length=MAX_PROMPT_CHARS)
                snr = gr.Slider(-10, 40, value=40, step=5, label="add white noise to the speech: SNR in dB (40 = none)")
                go = gr.Button("Answer", variant="primary", elem_id="answer")
        with gr.Row():
            label = gr.Label(num_top_classes=3, label="answer", elem_id="answer-label")
            plot = gr.Plot(label="expert groups", elem_id="groups")
        table = gr.Dataframe(headers=["tokens", "text group", "vision group", "audio group"], label="group usage")
        with gr.Accordion("components", open=False):
            names = components()
            component = gr.Dropdown(names, value=names[0], label="component")
            text = gr.Markdown()
            gr.on([demo.load, component.change], card, component, text, api_name="component_card")
        go.click(answer, [image, audio, prompt, snr], [label, plot, table], api_name="answer")
    return demo


if __name__ == "__main__":
    build_demo().launch(max_file_size=MAX_FILE_SIZE)
