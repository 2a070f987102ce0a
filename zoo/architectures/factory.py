"""One factory makes the zoo config/model classes of every family from the family's own classes."""
import contextlib
import os
import re
import sys
from types import SimpleNamespace

from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForMultimodalLM, AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                          AutoModelForSequenceClassification, AutoModelForTokenClassification)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

from zoo.architectures import parallel
from zoo.io.atomic import atomic_directory
from zoo.io.config_keys import CLASS_KEYS
from zoo.moe.layout import (
    apply_attention,
    apply_layout,
    apply_modules,
    block_attr,
    decoder_layers,
    sync_layout,
)
from zoo.moe import Router, SparseMoE
from zoo.moe import context as routing_context
from zoo.moe.losses import family_aux_loss
from zoo.moe.router_capture import recorded_router_logits
from zoo.moe.init import init_zoo_module, initialize_missing_keys

_CLASSES: dict[str, tuple] = {}


_CONFIGS: dict[str, type] = {}


@contextlib.contextmanager
def restored_classes():
    """The zoo classes made inside are forgotten on exit (tests that define families of their own)."""
    saved = dict(_CLASSES), dict(_CONFIGS)
    try:
        yield
    finally:
        for cache, before in zip((_CLASSES, _CONFIGS), saved):
            cache.clear()
            cache.update(before)


def zoo_config_class(family):
    """The ``zoo_<family>`` config class, registered with ``AutoConfig``. Cheap: families converted by the generic
    adapter build their model classes when a config of theirs is first made (``__post_init__``), so importing
    the zoo does not import every family's modeling code."""
    if family.name in _CONFIGS:
        return _CONFIGS[family.name]
    base_cfg = family.config_class
    attrs = {
        "__module__": __name__,
        "__annotations__": {key: list | dict | None for key in CLASS_KEYS},
        **dict.fromkeys(CLASS_KEYS),
        "model_type": f"zoo_{family.name}",
        **parallel.parallel_attributes(family),  # transformers' TP/EP plans, in the zoo block's module paths
    }
    if getattr(family, "generic", False):
        def __post_init__(self, **kwargs):
            base_cfg.__post_init__(self, **kwargs)
            zoo_classes(family)

        attrs["__post_init__"] = __post_init__
    cfg_cls = type(f"Zoo{base_cfg.__name__}", (base_cfg,), attrs)
    setattr(sys.modules[__name__], cfg_cls.__name__, cfg_cls)
    AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
    _CONFIGS[family.name] = cfg_cls
    return cfg_cls


# int8 row scales (quantized linears', int8 experts') are made in fp32 and stay fp32 when a bf16/fp16 checkpoint loads:
# in the model's dtype a reloaded model would compute other logits than the one saved. Regexes searched in each tensor
# name (the int4 pack's ``weight_scale_zero`` is bf16 by torch's kernel's contract and not matched), added to a model
# that holds such tensors (transformers checks that every name kept in fp32 exists in the model)
FP32_SCALES = [r"\.weight_scale$", r"_int8_scale$"]


AUTO_CLASSES = {"causal-lm": AutoModelForCausalLM, "image-text-to-text": AutoModelForImageTextToText,
                "seq2seq-lm": AutoModelForSeq2SeqLM, "multimodal-lm": AutoModelForMultimodalLM}


def zoo_classes(family):
    """(config class, base-model class, top model class) of ``zoo_<family>``; registered with the Auto classes."""
    if family.name in _CLASSES:
        return _CLASSES[family.name]
    module = sys.modules[__name__]
    cfg_cls, lm = zoo_config_class(family), family.model_class
    inner_native = _inner_class(lm) if family.has_base_model_class else None
    recorders = {**((inner_native or lm)._can_record_outputs or {}), "router_logits": OutputRecorder(Router, index=2)}
    common = {
        "__module__": __name__, "config_class": cfg_cls, "_can_record_outputs": recorders, "zoo_family": family,
        "_init_weights": _init_weights, "_initialize_missing_keys": _initialize_missing_keys,
        "_check_and_adjust_experts_implementation": _experts_implementation,
        **({"_keep_in_fp32_modules_strict": family.keep_in_fp32} if family.keep_in_fp32 is not None else {}),
    }
    inner_cls = None if inner_native is None else type(f"Zoo{inner_native.__name__}", (inner_native,), {
        **common, "__init__": _init_base, "_zoo_native_init": inner_native.__init__,
    })
    lm_cls = type(f"Zoo{lm.__name__}", (lm,), {
        **common, "_zoo_inner_class": inner_cls, "__init__": _init, "save_pretrained": _save_pretrained,
        **({"forward": _forward} if family.zoo_forward else _balance_forward(family)), **family.model_attributes(),
    })
    heads = [type(f"Zoo{native.__name__}", (native,),
                  {**common, "__init__": _init_head, "_zoo_native_init": native.__init__})
             for native in _native_heads(lm)]
    for cls in (inner_cls, lm_cls, *heads):
        if cls is not None:
            setattr(module, cls.__name__, cls)
    if inner_cls is not None:
        AutoModel.register(cfg_cls, inner_cls, exist_ok=True)
    AUTO_CLASSES[family.auto].register(cfg_cls, lm_cls, exist_ok=True)
    for head in heads:
        HEAD_AUTO_CLASSES[head.__name__.rsplit("For", 1)[1]].register(cfg_cls, head, exist_ok=True)
    _CLASSES[family.name] = (cfg_cls, inner_cls, lm_cls)
    return _CLASSES[family.name]


def _inner_class(lm):
    """The family's base-model class (``XModel`` beside ``XForCausalLM`` / ``XForConditionalGeneration``)."""
    import inspect
    import re

    names = lm.__init__.__globals__
    built = re.search(r"self\.model\s*=\s*(\w+)\(", inspect.getsource(lm.__init__))  # what the family builds
    stem = lm.__name__.replace("ForCausalLM", "").replace("ForConditionalGeneration", "")
    for name in ([built[1]] if built else []) + [f"{stem}Model", f"{stem}TextModel"]:
        if isinstance(names.get(name), type):
            return names[name]
    raise TypeError(f"no base-model class beside {lm.__name__}")


HEAD_AUTO_CLASSES = {"SequenceClassification": AutoModelForSequenceClassification,
                     "TokenClassification": AutoModelForTokenClassification,
                     "QuestionAnswering": AutoModelForQuestionAnswering}


def _native_heads(lm) -> list[type]:
    """The task heads the family's modeling module defines (each gets a zoo twin on the zoo backbone)."""
    if not lm.__name__.endswith("ForCausalLM"):
        return []
    names = [lm.__name__.replace("ForCausalLM", f"For{task}") for task in HEAD_AUTO_CLASSES]
    return [lm.__init__.__globals__[n] for n in names if n in lm.__init__.__globals__]


def _init_head(self, config):
    """A task head on the zoo backbone: transformers' generic heads build it with ``AutoModel``, which is the
    zoo base-model class for a zoo config."""
    self._zoo_native_init(config)
    base = getattr(self, self.base_model_prefix)
    if getattr(type(base), "zoo_family", None) is None:
        raise TypeError(f"{type(self).__name__}: the family's head built a native backbone")


def adopt(model, family) -> None:
    """Turn a native model instance of ``family`` into its zoo class in place (modules untouched)."""
    cfg_cls, inner_cls, lm_cls = zoo_classes(family)
    model.config.__class__ = cfg_cls
    # the native type copied onto the instance would hide the zoo's: tools that read ``config.model_type`` (PEFT's
    # MoE target names, transformers' conversion tables) would take the zoo model for the native one
    model.config.__dict__.pop("model_type", None)
    model.config.zoo_recipe = list(model.config.zoo_recipe or [])
    base = getattr(model, family.base_attr)
    own = ((model, lm_cls),) if base is model else ((model, lm_cls), (base, inner_cls))  # encoder-decoder: no base
    for module, cls in own:
        module.__class__ = cls
        _CAN_RECORD_REGISTRY[module] = cls._can_record_outputs
    base.config = model.config
    _gather_class_properties(base, model)
    # the native model's experts implementation (transformers picks grouped_mm by default) named its own experts:
    # a converted model starts on the zoo's dispatch, as a loaded one does (set_experts_implementation changes it)
    model.config._experts_implementation_internal = "eager"
    base.init_parallel_plans()  # post_init copied the native plans onto the instances: the zoo's now
    model.init_parallel_plans()
    parallel.install_language_model_plans(model, base, family)
    family.prepare(base)
    _retie(model)


def _init(self, config):
    self.zoo_family.model_class.__init__(self, config)  # builds the family's own base model: made zoo below
    base = getattr(self, self.zoo_family.base_attr)
    if base is not self:  # an encoder-decoder holds its stacks itself: no base model to make zoo
        base.__class__ = self._zoo_inner_class
        _CAN_RECORD_REGISTRY[base] = self._zoo_inner_class._can_record_outputs
    _build_zoo_blocks(base, config)
    set_blocks_experts_implementation(self, getattr(config, "_experts_implementation", None) or "eager")
    parallel.install_language_model_plans(self, base, self.zoo_family)
    apply_attention(self, getattr(config, "zoo_attention", None))  # first: module paths may run through it
    apply_modules(self, getattr(config, "zoo_modules", None))
    _gather_class_properties(base, self)
    _retie(self)
    self.init_weights()  # the new modules through _init_weights, as post_init did for the family's own
    routing_context.attach(self)


def _init_base(self, config):
    """``Zoo<Family>Model`` on its own (``AutoModel``): the same blocks as the causal LM's backbone."""
    self._zoo_native_init(config)
    _build_zoo_blocks(self, config)
    apply_attention(SimpleNamespace(model=self, config=config), getattr(config, "zoo_attention", None))
    modules = getattr(config, "zoo_modules", None) or {}  # recorded from the causal LM: paths under "model."
    prefix = f"{self.zoo_family.base_attr}."
    apply_modules(self, {k[len(prefix):]: v for k, v in modules.items() if k.startswith(prefix)})
    _gather_class_properties(self)
    _retie(self)
    self.init_weights()
    routing_context.attach(self)


def _retie(model) -> None:
    """The tie map expanded again over the zoo's modules, where the family's is patterns over layer tensors that
    post_init expanded over its native modules (``Family.retie``)."""
    if getattr(model.zoo_family, "retie", False):
        for module in model.modules():
            if hasattr(module, "get_expanded_tied_weights_keys"):
                module.all_tied_weights_keys = module.get_expanded_tied_weights_keys(all_submodels=True)


def _gather_class_properties(*models) -> None:
    """``post_init`` copies class properties (fp32 module names) onto instances, and the outer model gathers
    its children's; it ran while the modules were the family's own, so read them again off the zoo classes."""
    gathered: set[str] = set()
    for model in models:  # innermost first
        names = [n for n, _ in model.named_buffers()] + [n for n, _ in model.named_parameters()]
        scales = {p for p in FP32_SCALES if any(re.search(p, n) for n in names)}
        model._keep_in_fp32_modules_strict = set(type(model)._keep_in_fp32_modules_strict or []) | gathered | scales
        gathered = model._keep_in_fp32_modules_strict


def _build_zoo_blocks(base, config) -> None:
    """The MoE blocks of ``config.zoo_layout``; a config without one (a fresh config) gets the family's
    native blocks converted, so every zoo model holds ``SparseMoE`` blocks."""
    family = type(base).zoo_family
    family.discover(base)
    if config.zoo_layout is None:
        attr = block_attr(base)
        for layer in decoder_layers(base):
            native = getattr(layer, attr, None)
            if isinstance(native, family.block_class):
                initialised = getattr(native, "_is_hf_initialized", False)
                block = family.from_native(native, config)
                for module in block.modules():  # the family's initialisation already ran on these tensors
                    module._is_hf_initialized = initialised
                setattr(layer, attr, block)
    else:
        family.hold_blocks(base)
        apply_layout(base, config.zoo_layout)
    family.prepare(base)


def _experts_implementation(self, requested):
    """``experts_implementation`` of a zoo model: None or "eager" runs the zoo's own dispatch; transformers'
    ``grouped_mm`` and ``batched_mm`` run the blocks whose experts are plain fused SwiGLU experts (other kinds,
    quantized or factored, have no form those functions read: they keep the zoo's). Others are refused."""
    from zoo.moe.experts import SwiGLUExperts

    choices = ("eager", *SwiGLUExperts.TRANSFORMERS_IMPLEMENTATIONS)
    chosen = "eager" if requested is None else requested
    if chosen not in choices:
        raise ValueError(f"experts_implementation={requested!r} cannot be honoured by {type(self).__name__}: zoo "
                         f"experts run {', '.join(repr(c) for c in choices)}")
    if chosen == "grouped_mm":
        self._grouped_mm_can_dispatch()  # transformers' own check of this torch and device
    set_blocks_experts_implementation(self, chosen)
    return chosen


def set_blocks_experts_implementation(model, implementation: str) -> None:
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.experts_implementation = implementation


def _init_weights(self, module):
    """The family's initialisation for its own modules, the zoo modules' ``init_weights`` for theirs."""
    self.zoo_family.model_class._init_weights(self, module)
    text = self.config.get_text_config()
    std = getattr(self.config, "initializer_range", None) or getattr(text, "initializer_range", None)
    init_zoo_module(module, std or 0.02)


def _initialize_missing_keys(self, is_quantized: bool) -> None:
    initialize_missing_keys(self, self.zoo_family.model_class._initialize_missing_keys, is_quantized)


@can_return_tuple
@deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
def _forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
             labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0,
             **kwargs: Unpack[TransformersKwargs]) -> MoeCausalLMOutputWithPast:
    """The family's causal-LM forward; its balance loss is the family's own when every MoE layer has the same
    expert count and k, and the mean of per-layer losses (same convention) where layers differ."""
    if output_router_logits is None:
        output_router_logits = getattr(self.config, "output_router_logits", False)
    # the logits come off the routers held now (transformers' recorders miss blocks swapped in after its first call)
    with recorded_router_logits(self) if output_router_logits else contextlib.nullcontext([]) as recorded:
        outputs = getattr(self, self.zoo_family.base_attr)(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_router_logits=False, return_dict=True, **kwargs)
    hidden = outputs.last_hidden_state
    logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
    loss = self.loss_function(logits, labels, self.vocab_size, **kwargs) if labels is not None else None
    aux_loss = None
    router_logits = tuple(lg for _, lg in recorded) if output_router_logits else None
    if router_logits and self.zoo_family.aux_loss:
        aux_loss = family_aux_loss(self.zoo_family.balance_loss(), router_logits,
                                   [router.top_k for router, _ in recorded], attention_mask)
        if loss is not None:
            loss = loss + self.zoo_family.aux_loss_coef(self.config) * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, cache=outputs.cache,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                     router_logits=router_logits)


def _balance_forward(family) -> dict:
    """A family that keeps its own forward and computes a balance loss in it: that forward with the zoo's balance
    loss in place of the family's (defined where layers differ in expert count, the family's own where not)."""
    from zoo.architectures.own_forward import forward_with_zoo_balance_loss

    loss = family.balance_loss() if getattr(family, "generic", False) else None
    if loss is None:
        return {}
    return {"forward": forward_with_zoo_balance_loss(family.model_class, loss)}


def _save_pretrained(self, save_directory, *args, model_card=None, **kwargs):
    """Record the current layout, then save atomically, with the model card as README.md (``model_card``: a
    card already rendered, e.g. with evaluation results; else the default one) and the tokenizer files and
    generation config of the folder the model was loaded from (those the target folder does not hold already)."""
    from zoo.publishing.cards import card
    from zoo.io.loading import copy_side_files

    from zoo.architectures import remote_code

    sync_layout(self)
    with atomic_directory(save_directory) as tmp:
        copy_side_files(getattr(self.config, "name_or_path", ""), tmp, keep=save_directory)  # the model's own win
        remote_code.write(self.config, tmp)  # auto_map: any transformers process opens the folder
        self.zoo_family.model_class.save_pretrained(self, tmp, *args, **kwargs)
        (model_card or card(self, path=save_directory)).save(os.path.join(tmp, "README.md"))
