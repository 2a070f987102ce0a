"""``moe-zoo demo NAME``: serve a Gradio Space locally, the zoo's own or a plugin's, by Space or component name."""
import click


@click.command()
@click.argument("name")
@click.option("--port", type=int, help="Port on 127.0.0.1 (default: Gradio's, 7860 or the next free one).")
def demo(name, port):
    """Launch the Gradio Space NAME (e.g. router-explorer, model-zoo) on 127.0.0.1. NAME may also be a
    component (e.g. top-p, or a plugin's): its Space is served, from the plugin's own package if it ships one.

    The Space runs offline on the embedded default model; set MOE_ZOO_MODEL to use another."""
    from zoo.demos.spaces import UnknownSpace, launch

    try:
        launch(name, port)
    except UnknownSpace as exc:
        raise click.ClickException(str(exc)) from None
