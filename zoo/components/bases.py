"""Component base classes. Capabilities are declared here, on the bases, with their defaults: a component
overrides what it has. The name -> class registry the plugins fill is ``zoo.components.registry``."""
from __future__ import annotations

from zoo.components.controls import DemoControls
from zoo.components.options import check_options


class Component(DemoControls):
    """Metadata every component class carries, and the demo controls a Space builds from it
    (``demo_controls(model)``, ``demo_presets(model)``, ``demo_unfit(model)``: see ``zoo.components.controls``)."""

    name: str = ""  # unique, lowercase, dashes
    summary: str = ""  # one line
    paper: str = ""  # citation or URL, where there is one
    card: str = ""  # its card template, e.g. "cards/<name>.md" (a Jinja template; see docs/plugins/cards.md)
    space: str = ""  # the demo Space that shows it, e.g. "compression-lab"

    def __init__(self, **options):
        check_options(type(self), options)
        self.options = options


class Compressor(Component):
    """``compress(model, calibration=None) -> model``. Validate options in ``__init__``.

    A compressor that implements the per-layer contract (``compress_layer``; see ``zoo.editing.layerwise`` and
    docs/plugins/compressor.md) gets ``compress`` for free and works on checkpoints streamed from their shards
    too. One that overrides ``compress`` alone works on models in memory only.
    """

    kind = "compressor"
    needs_calibration = False  # uses calibration data (the CLI and the card say so)
    inputs_for: tuple[str, ...] = ()  # "observe", "compress": the phases that receive the layer's input tokens
    needs_plan = False  # observe every layer, then plan(), before compress_layer
    targets_linears = False  # also hand it the plain linear layers outside the MoE blocks (compress_linear)
    build_module = None  # classmethod (replaced, spec) -> the empty module a saved ``zoo_spec()`` describes
    # What the step leaves in every MoE layer, for judging the later steps of one recipe before any runs (streamed,
    # all steps are checked up front; in memory each step sees the model the one before left): the ``name`` of the
    # experts kind it produces (e.g. "quantized"), and the expert count it leaves (None: unchanged).
    experts_after: str | None = None
    experts_count_after: int | None = None

    @property
    def layerwise(self) -> bool:
        return type(self).compress_layer is not Compressor.compress_layer

    def check_layers(self, layers: list[int]) -> None:
        """Raise (before anything changes) if the options name layers other than the MoE ``layers``."""

    def check_layer(self, index: int, block) -> None:
        """Raise (before anything changes) if layer ``index``'s block cannot be compressed."""

    def observe(self, index: int, block, inputs) -> None:
        """Statistics pass: look at layer ``index`` (``inputs [T, H]`` or None)."""

    def plan(self) -> None:
        """Once, after every layer was observed: decide what the global view decides (a bit budget, a ranking)."""

    def compress_layer(self, index: int, block, inputs):  # pragma: no cover - abstract
        """Return the compressed block of layer ``index`` (a new ``SparseMoE``, or ``block`` unchanged)."""
        raise NotImplementedError

    def check_linear(self, name: str, linear) -> None:
        """Raise (before anything changes) if the plain linear layer at ``name`` cannot be compressed."""

    def compress_linear(self, name: str, linear):
        """With ``targets_linears``: the module that replaces the plain ``nn.Linear`` at ``name`` (an attention
        projection, a dense layer's MLP, the LM head), or ``linear`` itself. A new module records itself in
        ``config.zoo_modules`` through ``zoo_spec()`` naming this compressor, whose ``build_module`` rebuilds it."""
        return linear

    def compress(self, model, calibration=None):
        from zoo.editing.layerwise import compress_in_memory

        if not self.layerwise:
            raise NotImplementedError(f"{type(self).__name__} implements neither compress nor compress_layer")
        return compress_in_memory(model, [self], calibration)


class Adapter(Component):
    """``attach(model) -> model``. Optional capabilities, each declared here with its default:

    - ``accepts_dense``: ``attach`` receives the model as given (a dense model to upcycle), not converted;
    - ``train_step(model)``: called after each optimiser step of ``moe-zoo finetune`` (weight averaging);
    - ``loss(model, input_ids, attention_mask=None) -> (loss, lm_loss)``: the training loss, when the adapter
      owns it (a router trained by policy gradient);
    - ``merge(model) -> model``: fold the adapter into the base weights;
    - ``load_saved(model, folder) -> model`` (static): put a saved adapter folder back on its base model, when
      ``peft.PeftModel.from_pretrained`` is not how it should load (``zoo.load`` of the folder calls it);
    - ``build_module(replaced, spec)`` (classmethod): rebuild, empty, a module the adapter put outside the
      MoE blocks (it has ``zoo_spec()``; see ``zoo.moe.layout.read_modules``).
    """

    kind = "adapter"
    accepts_dense = False
    train_step = None
    loss = None
    merge = None
    load_saved = None
    build_module = None

    def attach(self, model):  # pragma: no cover - abstract
        raise NotImplementedError
