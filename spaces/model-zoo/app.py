"""model-zoo: browse the registered models and components, and read their cards.

A model's card is its own README.md where its folder has one (the shipped checkpoints carry theirs), else
``zoo.card`` of the loaded model; either way the text is shown as markdown, without its YAML metadata. Set
``MOE_ZOO_MODEL`` to add another local model to the card list.
"""
import functools
import os

import gradio as gr

import zoo
from zoo.publishing.cards import render_component_card
from zoo.components.registry import registry
from zoo.demos.spaces import MAX_FILE_SIZE, one_at_a_time

MODEL = os.environ.get("MOE_ZOO_MODEL", "zoo-tiny-moe")


def models_table():
    rows = [[e.name, e.family, e.hub_id or "(shipped with moe-zoo)", e.license, e.summary] for e in zoo.list_models()]
    return {"headers": ["name", "family", "hub id", "license", "summary"], "data": rows}


def components_table():
    rows = [[c["kind"], c["name"], c["summary"], c["distribution"], c["space"]] for c in zoo.list_components()]
    return {"headers": ["kind", "name", "summary", "distribution", "space"], "data": rows}


def card_models() -> list[str]:
    """Models whose card can be rendered offline: the shipped checkpoints present here, and MOE_ZOO_MODEL."""
    shipped = [e.name for e in zoo.list_models() if e.local_path and os.path.isdir(e.local_path)]
    default = [e.name for e in zoo.list_models(f"*.{MODEL}")] or [MODEL]
    return list(dict.fromkeys(default + shipped))


def component_card(name: str) -> str:
    """The component's card section, rendered as it appears inside a model card."""
    reg = registry.get(None, name)
    family = name if reg.kind == "architecture" else "(the model's family)"
    context = {"family": family, "layout_summary": "listed per layer in each model's card", "recipe": []}
    return render_component_card(reg.obj, context)


def model_folder(name: str) -> str | None:
    """The local folder of a registered model or of a path (None for a hub model not on disk)."""
    entries = zoo.list_models(name) or zoo.list_models(f"*.{name}")
    folder = entries[0].local_path if entries and entries[0].local_path else name
    return folder if os.path.isdir(folder) else None


@one_at_a_time
@functools.cache
def model_card(name: str) -> str:
    """A model's card as markdown, without its YAML front matter: the README.md its folder ships, else
    ``zoo.card`` of the loaded model."""
    from huggingface_hub import ModelCard

    folder = model_folder(name)
    if folder and os.path.isfile(os.path.join(folder, "README.md")):
        return ModelCard.load(os.path.join(folder, "README.md")).text.strip()
    try:
        card = zoo.card(zoo.load(name), model_name=name.rsplit("/", 1)[-1])
    except (TypeError, ValueError, OSError) as exc:
        entries = zoo.list_models(name) or zoo.list_models(f"*.{name}")
        summary = f"{entries[0].summary}\n\n" if entries else ""
        return f"# {name}\n\n{summary}*No model card: {exc}*"
    return card.text.strip()


def build_demo() -> gr.Blocks:
    components = [c["name"] for c in zoo.list_components()]
    models = card_models()
    with gr.Blocks(title="moe-zoo", analytics_enabled=False) as demo:
        gr.Markdown("# moe-zoo\nThe models and components of this installation, and their cards.")
        with gr.Tab("Models"):
            models_df = gr.Dataframe(label="registered models", wrap=True)
            model = gr.Dropdown(models, value=models[0], label="model card (shipped checkpoints)")
            model_md = gr.Markdown(label="model card", elem_id="model-card")
        with gr.Tab("Components"):
            components_df = gr.Dataframe(label="registered components (plugins included)", wrap=True)
            component = gr.Dropdown(components, value=components[0], label="component card")
            component_md = gr.Markdown(label="component card")
        demo.load(models_table, None, models_df, api_name="models")
        demo.load(components_table, None, components_df, api_name="components")
        gr.on([demo.load, component.change], component_card, component, component_md, api_name="component_card")
        gr.on([demo.load, model.change], model_card, model, model_md, api_name="model_card")
    return demo


if __name__ == "__main__":
    build_demo().launch(max_file_size=MAX_FILE_SIZE)  # no file inputs; the limit still caps /upload
