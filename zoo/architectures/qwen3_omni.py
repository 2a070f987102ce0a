"""Qwen3-Omni (``qwen3_omni_moe``): one model holding two MoE language models and a speech decoder. The thinker
(``.thinker``: audio and vision encoders in front of an MoE text decoder) reads text, images, audio and video and
writes text. The talker (``.talker``: an MoE decoder of its own, with a small dense code predictor beside it) reads
what the thinker read and wrote, projected to its own width (``text_projection`` of the thinker's token embeddings
for text, ``hidden_projection`` of its hidden states for other inputs), and writes speech codes, which ``.code2wav``
(no MoE) turns into a waveform. There is no base model at ``.model``: the top model holds both.

The two decoders route differently. A thinker block is a plain top-k block: a softmax over its experts, the top k
picked and, with ``norm_topk_prob`` (the thinker's default), renormalised. A talker block adds a shared expert whose
output is scaled per token by a sigmoid gate (``shared_expert_gate``: one [1, H] row), and by default does not
renormalise. Each stack has its own config (``thinker_config.text_config``, ``talker_config.text_config``: widths,
expert counts, k and expert sizes may all differ), and each block is read off its own stack's config with the
generic adapter's probes, so a converted block keeps its stack's rule and shapes.

The zoo model is the top model itself (``base_attr = "base_model"``). ``zoo_layout`` lists the thinker's decoder
layers, then the talker's (``layer_paths``), as the encoder-decoder families list their two stacks: entry ``i`` is
thinker layer ``i`` for ``i < thinker_layers`` and talker layer ``i - thinker_layers`` after. The encoders, the code
predictor and code2wav stay native.

The native top model has no forward of its own (only ``generate``), but calibration runs a forward: the zoo model's
runs the thinker on ``input_ids`` and the talker on the same text as it reads a user turn's text (the thinker's
token embeddings through ``talker.text_projection``), so a compressor calibrates both stacks on one batch; the
thinker's logits are ``logits``, the talker's ``talker_logits``. Export writes the native layout back while each
stack's MoE layers share one block shape (the native config holds one expert count, k and expert size per stack;
the stacks may differ). Streaming from shards is not supported (two layer lists).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from zoo.architectures.family import Family, NotExportable
from zoo.architectures.generic import GenericFamily, block_spec, block_to_native, block_to_zoo, first_difference

STACKS = {"thinker": "thinker.model.language_model.layers", "talker": "talker.model.layers"}


class Qwen3Omni(GenericFamily):
    label = "Qwen3-Omni"
    base_attr = "base_model"  # transformers' base model of the omni model is the model itself: it holds both stacks
    has_base_model_class = False
    parallel_plans = False  # no plans: the native ones name the native blocks of the thinker's and talker's stacks
    stream_refused = "Qwen3-Omni's layout lists the layers of two decoders (thinker, talker), which streaming does not"

    def __init__(self):
        super().__init__("qwen3_omni_moe", "multimodal-lm",
                         summary="Qwen3-Omni (a thinker and a talker, each an MoE decoder: softmax top-k routing, the "
                                 "talker's blocks with a sigmoid-gated shared expert; a speech decoder beside them).",
                         paper="Qwen Team, Qwen3-Omni Technical Report, 2025. arXiv:2509.17765")
        self.layers_path, self.block_attr = STACKS["thinker"], "mlp"

    @property
    def model_class(self):
        from transformers import Qwen3OmniMoeForConditionalGeneration

        return Qwen3OmniMoeForConditionalGeneration

    def text_config(self, config):
        return config.thinker_config.text_config

    def native_logits(self, model, inputs: dict):
        """The native omni model has no forward: its thinker's logits, as the zoo model's forward gives them."""
        with torch.no_grad():
            return model.thinker(**inputs, use_cache=False).logits

    def model_attributes(self) -> dict:
        return {"forward": forward, "get_input_embeddings": lambda self: self.thinker.get_input_embeddings()}

    # ---- where the blocks are -------------------------------------------------------------------------------
    def discover(self, base) -> None:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeTalkerTextSparseMoeBlock, Qwen3OmniMoeThinkerTextSparseMoeBlock)

        self.block_class = (Qwen3OmniMoeThinkerTextSparseMoeBlock, Qwen3OmniMoeTalkerTextSparseMoeBlock)

    def layer_paths(self, base) -> list[str]:
        """The thinker's decoder layers, then the talker's (none where the model was built without a talker)."""
        return [f"{path}.{i}" for name, path in STACKS.items() if getattr(base, name, None) is not None
                for i in range(len(base.get_submodule(path)))]

    def layer_widths(self, config) -> list[int]:
        """Each listed layer's width (the talker is narrower than the thinker in the released models)."""
        stacks = [config.thinker_config.text_config] + ([config.talker_config.text_config]
                                                         if config.enable_audio_output else [])
        return [text.hidden_size for text in stacks for _ in range(text.num_hidden_layers)]

    def _meta_blocks(self, config) -> tuple[list[int], list]:
        with torch.device("meta"):
            model = self.model_class(config)
        self.discover(model)
        found = [(i, model.get_submodule(path).mlp) for i, path in enumerate(self.layer_paths(model))]
        return [i for i, b in found if isinstance(b, self.block_class)], [b for _, b in found
                                                                          if isinstance(b, self.block_class)]

    # ---- one block: read off its own stack's config ---------------------------------------------------------
    def stack_config(self, block, config):
        talker = type(block).__name__.startswith("Qwen3OmniMoeTalker")
        return (config.talker_config if talker else config.thinker_config).text_config

    def spec(self, block, config) -> dict:
        text = self.stack_config(block, config)
        key = json.dumps([type(block).__name__, text.to_dict()], sort_keys=True, default=str)
        if key not in self._specs:
            self._specs[key] = block_spec(block, text)
        return self._specs[key]

    def to_zoo_state(self, sd: dict) -> dict:
        return block_to_zoo(sd, self._spec_of(sd, native=True))

    def to_native_state(self, sd: dict) -> dict:
        return block_to_native(sd, self._spec_of(sd, native=False))

    def _spec_of(self, sd: dict, native: bool) -> dict:
        """The spec read last whose tensor names are ``sd``'s (a thinker block's and a talker block's differ: the
        talker's shared expert and its gate)."""
        for spec in reversed(list(self._specs.values())):
            splits = [k for pair in spec.get("splits", {}).values() for k in pair]
            names = (set(spec["renames"]) | set(spec.get("splits", {}))) if native else \
                {*spec["renames"].values(), *splits}
            if names == set(sd):
                return spec
        raise NotExportable(f"no {self.label} block holds the tensors {sorted(sd)}")

    def pad_native_state(self, state: dict, num_experts: int) -> dict:
        """Unchanged: each stack exports at its own expert count (``native_config`` refuses any other layout), which
        export's one count over all layers would take for padding where the stacks' counts differ."""
        return state

    # ---- export -----------------------------------------------------------------------------------------------
    def native_config(self, config, layout):
        moe = {i: e for i, e in enumerate(layout) if e}
        if not moe:
            raise NotExportable("the model has no MoE layer")
        Family._check_exportable_parts(self, config)
        values = {k: v for k, v in config.to_dict().items() if not k.startswith("zoo_") and k != "model_type"}
        native = self.config_class(**values)
        thinker_layers = config.thinker_config.text_config.num_hidden_layers
        for name in STACKS:
            part = {i: e for i, e in moe.items() if (i < thinker_layers) == (name == "thinker")}
            if not part:
                continue
            first_i, first = next(iter(part.items()))
            for i, e in part.items():
                if e != first:
                    raise NotExportable(f"layer {i} differs from layer {first_i} ({first_difference(e, first)}): a "
                                        f"native {self.label} config holds one block shape for the {name}'s layers")
            text = getattr(native, f"{name}_config").text_config  # set as attributes: the talker's are aliases
            text.num_experts, text.num_experts_per_tok = first["num_experts"], first["num_experts_per_tok"]
            text.moe_intermediate_size = first["experts_options"].get("intermediate_size")
        try:
            ids, blocks = self._meta_blocks(native)
            expected = {i: self.spec(block, native)["entry"] for i, block in zip(ids, blocks)}
        except Exception as exc:  # the config class's own validators, or a block it cannot build
            raise NotExportable(f"a native {self.label} config cannot hold this layout: {exc}") from None
        if set(expected) != set(moe):
            raise NotExportable(f"MoE layers {sorted(moe)} differ from the native pattern {sorted(expected)}")
        for i, e in moe.items():
            if _comparable(e) != _comparable(expected[i]):
                raise NotExportable(f"layer {i}: {first_difference(e, expected[i])}")
        return native


def _comparable(entry: dict) -> dict:
    """A layout entry without what cannot change its function: with every expert picked (k = E, a prune down to k),
    renormalising weights that already sum to one is a no-op, so the probe of a native block cannot tell it."""
    if entry["num_experts"] != entry["num_experts_per_tok"] or "norm_topk_prob" not in entry["router_options"]:
        return entry
    return {**entry, "router_options": {k: v for k, v in entry["router_options"].items() if k != "norm_topk_prob"}}


@dataclass
class Qwen3OmniOutput(ModelOutput):
    """The thinker's loss and logits, and the talker's logits on the same text (None without a talker)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    talker_logits: torch.Tensor | None = None


def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, **kwargs) -> Qwen3OmniOutput:
    """The thinker on ``input_ids`` (and any thinker input: ``pixel_values``, ``input_features``, ...), then the
    talker on the same text as it reads a user turn's text: the thinker's token embeddings through its
    ``text_projection``. The native model has no forward; this one lets calibration reach both stacks."""
    if input_ids is None:
        raise ValueError(f"{type(self).__name__}'s forward reads input_ids (the talker reads their embeddings)")
    thinker = self.thinker(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=use_cache,
                           **kwargs)
    talker_logits = None
    if getattr(self, "talker", None) is not None:
        embeds = self.talker.text_projection(self.thinker.get_input_embeddings()(input_ids))
        talker_logits = self.talker(inputs_embeds=embeds, attention_mask=attention_mask, use_cache=False).logits
    return Qwen3OmniOutput(loss=thinker.loss, logits=thinker.logits, talker_logits=talker_logits)
