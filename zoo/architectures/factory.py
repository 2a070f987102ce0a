"""One factory makes the zoo config/model classes of every family from the family's own classes."""
from __future__ import annotations

import os
import sys

from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

from zoo.atomic import atomic_directory
from zoo.layout import (
    apply_attention,
    apply_layout,
    apply_modules,
    moe_layers,
    sync_layout,
)
from zoo.moe import Router, model_load_balancing_loss
from zoo.moe.init import init_zoo_module, initialize_missing_keys

_CLASSES: dict[str, tuple] = {}


def zoo_classes(family):
    """(config class, base-model class, causal-LM class) of ``zoo_<family>``; registered with the Auto classes."""
    if family.name in _CLASSES:
        return _CLASSES[family.name]
    module = sys.modules[__name__]
    base_cfg, lm = family.config_class, family.model_class
    cfg_cls = type(f"Zoo{base_cfg.__name__}", (base_cfg,), {
        "__module__": __name__,
        "__annotations__": {"zoo_layout": list | None, "zoo_recipe": list | None},
        "zoo_layout": None, "zoo_recipe": None,
        "model_type": f"zoo_{family.name}",
    })
    inner_native = _inner_class(lm)
    recorders = {**inner_native._can_record_outputs, "router_logits": OutputRecorder(Router, index=2)}
    inner_cls = type(f"Zoo{inner_native.__name__}", (inner_native,), {
        "__module__": __name__, "config_class": cfg_cls, "_can_record_outputs": recorders,
        "_zoo_family": family, "_init_weights": _init_weights,
    })
    lm_cls = type(f"Zoo{lm.__name__}", (lm,), {
        "__module__": __name__, "config_class": cfg_cls, "_can_record_outputs": recorders,
        "_zoo_family": family, "_zoo_inner_class": inner_cls,
        "__init__": _init, "forward": _forward, "save_pretrained": _save_pretrained,
        "_init_weights": _init_weights, "_initialize_missing_keys": _initialize_missing_keys,
        **({"_keep_in_fp32_modules_strict": family.keep_in_fp32} if family.keep_in_fp32 is not None else {}),
    })
    for cls in (cfg_cls, inner_cls, lm_cls):
        setattr(module, cls.__name__, cls)
    AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
    AutoModelForCausalLM.register(cfg_cls, lm_cls, exist_ok=True)
    _CLASSES[family.name] = (cfg_cls, inner_cls, lm_cls)
    return _CLASSES[family.name]


def _inner_class(lm):
    return lm.__init__.__globals__[lm.__name__.replace("ForCausalLM", "Model")]


def adopt(model, family) -> None:
    """Turn a native model instance of ``family`` into its zoo class in place (modules untouched)."""
    cfg_cls, inner_cls, lm_cls = zoo_classes(family)
    model.config.__class__ = cfg_cls
    model.config.zoo_recipe = list(model.config.zoo_recipe or [])
    for module, cls in ((model, lm_cls), (model.model, inner_cls)):
        module.__class__ = cls
        _CAN_RECORD_REGISTRY[module] = cls._can_record_outputs
    model.model.config = model.config


def _init(self, config):
    self._zoo_family.model_class.__init__(self, config)
    self.model.__class__ = self._zoo_inner_class
    _CAN_RECORD_REGISTRY[self.model] = self._zoo_inner_class._can_record_outputs
    apply_layout(self, config.zoo_layout)
    apply_attention(self, getattr(config, "zoo_attention", None))  # first: module paths may run through it
    apply_modules(self, getattr(config, "zoo_modules", None))


def _init_weights(self, module):
    """The family's initialisation for its own modules, the zoo modules' ``init_weights`` for theirs."""
    self._zoo_family.model_class._init_weights(self, module)
    init_zoo_module(module, getattr(self.config, "initializer_range", None) or 0.02)


def _initialize_missing_keys(self, is_quantized: bool) -> None:
    initialize_missing_keys(self, self._zoo_family.model_class._initialize_missing_keys, is_quantized)


def _forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
             labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0, **kwargs):
    """The family's causal-LM forward, with a balance loss that accepts a different layout per layer."""
    if cache is None and "past_key_values" in kwargs:
        cache = kwargs.pop("past_key_values")
    if output_router_logits is None:
        output_router_logits = getattr(self.config, "output_router_logits", False)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_router_logits=output_router_logits, **kwargs)
    hidden = outputs.last_hidden_state
    logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
    loss = self.loss_function(logits, labels, self.vocab_size, **kwargs) if labels is not None else None
    aux_loss = None
    router_logits = getattr(outputs, "router_logits", None)
    if output_router_logits and router_logits and self._zoo_family.aux_loss:
        top_ks = [moe.top_k for _, moe in moe_layers(self)]
        aux_loss = model_load_balancing_loss(router_logits, top_ks, attention_mask)
        if loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                     router_logits=router_logits)


def _save_pretrained(self, save_directory, *args, **kwargs):
    """Record the current layout, then save atomically, with the model card as README.md."""
    from zoo.cards import card

    sync_layout(self)
    with atomic_directory(save_directory) as tmp:
        self._zoo_family.model_class.save_pretrained(self, tmp, *args, **kwargs)
        card(self).save(os.path.join(tmp, "README.md"))
