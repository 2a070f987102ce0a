"""Llama 4 multimodal (``llama4``: ``Llama4ForConditionalGeneration``): a vision tower and projector in front of a
whole causal LM, ``.language_model`` (a ``Llama4ForCausalLM``, whose base model holds the decoder layers). Its MoE
blocks are the text model's (``zoo.architectures.llama4``: sigmoid top-k routing that scales each expert's input,
a shared expert), so they convert with that spec; only where they sit differs. There is no base model at
``.model``: the top model is its own base model (``base_attr = "base_model"``, as Qwen3-Omni), and the blocks sit
at ``language_model.model.layers.<i>.feed_forward``. The vision tower and projector stay native.

The zoo model has a forward of its own: in transformers 5.24 the native one fails on every call (it builds its
output from ``outputs.image_outputs``, a field the language model's output lacks; asking for a tuple fails too,
since its output-capturing decorator then calls ``to_tuple()`` on a tuple). The zoo's runs the same steps (image
features projected into the image tokens' embeddings, the language model on the embeddings, the label loss) and
returns the native output class with the image features it computed. Its router logits come off the zoo's routers
(the native recorder hooks ``Llama4Router``, which the zoo block replaces); Llama 4 computes no balance loss.
"""
from __future__ import annotations

import contextlib

import torch
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from zoo.architectures.generic import GenericFamily
from zoo.architectures.llama4 import Llama4Text
from zoo.moe.router_capture import recorded_router_logits

LAYERS = "language_model.model.layers"


class Llama4VL(Llama4Text):
    base_attr = "base_model"  # transformers' base model of the multimodal model is the model itself
    has_base_model_class = False  # its language model is a whole causal LM: it stays native, its blocks zoo

    def __init__(self):
        GenericFamily.__init__(self, "llama4", "image-text-to-text",
                               summary="Llama 4 multimodal (a vision tower in front of the Llama 4 decoder: sigmoid "
                                       "top-k routing scaling expert inputs, shared expert).",
                               paper="Meta AI, The Llama 4 herd, 2025")
        self.layers_path = LAYERS

    def discover(self, base) -> None:
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        self.layers_path, self.block_attr, self.block_class = LAYERS, "feed_forward", Llama4TextMoe

    def _meta_blocks(self, config) -> tuple[list[int], list]:
        with torch.device("meta"):
            model = self.model_class(config)
        self.discover(model)
        found = [(i, layer.feed_forward) for i, layer in enumerate(model.get_submodule(LAYERS))
                 if isinstance(layer.feed_forward, self.block_class)]
        return [i for i, _ in found], [b for _, b in found]

    def native_logits(self, model, inputs: dict):
        """transformers 5.24's forward fails on every call (see above): its own code, the decorators unwrapped."""
        import inspect

        with torch.no_grad():
            return inspect.unwrap(type(model).forward)(model, **inputs, use_cache=False, return_dict=False)[0]

    def model_attributes(self) -> dict:
        return {"forward": forward}


@can_return_tuple
@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
def forward(self, input_ids=None, pixel_values=None, attention_mask=None, position_ids=None, cache=None,
            inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0,
            mm_encoder_outputs=None, vision_feature_select_strategy=None, **kwargs):
    """``Llama4ForConditionalGeneration.forward`` as it would run without its output bug (module docstring): image
    features (from ``pixel_values`` or ``mm_encoder_outputs["image"]``) replace the image tokens' embeddings, the
    language model runs on the embeddings, and the loss is the label loss over the text vocabulary."""
    from transformers.models.llama4.modeling_llama4 import Llama4CausalLMOutputWithPast

    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if pixel_values is not None and (inputs_embeds is not None or mm_encoder_outputs is not None):
        raise ValueError("pixel_values cannot be given with inputs_embeds or mm_encoder_outputs")
    if vision_feature_select_strategy not in (None, "default", "full"):  # the native checks it, and reads it nowhere
        raise ValueError(f"Unexpected select feature strategy: {vision_feature_select_strategy}")
    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    encoded = dict(mm_encoder_outputs or {})
    if encoded.get("image") is None and pixel_values is not None:
        encoded["image"] = self.get_image_features(pixel_values=pixel_values, return_dict=True)
    image = encoded.get("image")
    if image is not None:
        features = image.last_hidden_state
        projected = self.multi_modal_projector(features.view(-1, features.size(-1)))
        projected = projected.to(inputs_embeds.device, inputs_embeds.dtype)
        mask = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds, image_features=projected)
        inputs_embeds = inputs_embeds.masked_scatter(mask, projected)
    if output_router_logits is None:
        output_router_logits = getattr(self.config.get_text_config(), "output_router_logits", False)
    with recorded_router_logits(self) if output_router_logits else contextlib.nullcontext([]) as recorded:
        out = self.language_model(attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                  inputs_embeds=inputs_embeds, use_cache=use_cache, output_router_logits=False,
                                  logits_to_keep=logits_to_keep, return_dict=True, **kwargs)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=out.logits, labels=labels, vocab_size=self.config.text_config.vocab_size,
                                  **kwargs)
    return Llama4CausalLMOutputWithPast(
        loss=loss, logits=out.logits, cache=out.cache, hidden_states=out.hidden_states, attentions=out.attentions,
        image_outputs=image, router_logits=tuple(lg for _, lg in recorded) if output_router_logits else None)
