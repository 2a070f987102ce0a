"""PEFT's MoE names on zoo models: ``LoraConfig(target_modules=["gate"])`` tunes the router of a zoo model as it
tunes a native Mixtral's.

transformers 5 made the router a custom module and fused the experts into stacked parameters; PEFT translates the
names users write (the router's ``gate``, Mixtral's ``w1``/``w3``/``w2``, Qwen's ``gate_proj``/``up_proj``/
``down_proj``) into LoRA on those parameters, for the model types it knows. The zoo adds its own model types to that
translation: the family's router name becomes the zoo router's ``router.weight`` (LoRA on the routing logits'
weight, as on the native model) and the expert names the fused ``gate_up_proj``/``down_proj``. PEFT keeps the
translation in tables of its own; where an installed PEFT lacks them, nothing is added and ``gate`` is refused by
PEFT as before.

PEFT skips a target parameter no module holds when another target matches; on a zoo model whose experts are
quantized (codes, not ``gate_up_proj``) that would tune the router alone without a word, so the translation of a
zoo model's config is followed by a check that every expert parameter it targets exists in every MoE layer.
"""
from __future__ import annotations

import sys

MIXTRAL_EXPERTS = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}
SPLIT_EXPERTS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
FUSED_EXPERTS = {"gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}  # GPT-OSS: fused in its checkpoints too


def router_name(family) -> str:
    """The family's own name for the router module (``gate`` where its weights rename ``gate.`` to ``router.``)."""
    for native, zoo_key in family.renames.items():
        if zoo_key == "router.":
            return native.rstrip(".").rpartition(".")[2]
    return "router"


def target_names(family) -> dict[str, str]:
    """{name a PEFT user writes: the zoo parameter it adapts} for the family's zoo model."""
    experts = (MIXTRAL_EXPERTS if family.name == "mixtral" else
               FUSED_EXPERTS if family.name == "gpt_oss" else SPLIT_EXPERTS)
    return {router_name(family): "router.weight", **experts}


def fused_targets(names: dict[str, str]) -> dict[str, list[str]]:
    """{fused parameter: the names that all have to be targeted together} (PEFT doubles r and alpha for two)."""
    out: dict[str, list[str]] = {}
    for name, param in names.items():
        if param != "router.weight":
            out.setdefault(param, []).append(name)
    return {param: names for param, names in out.items() if param == "gate_up_proj"}


class ExpertTargetMissing(ValueError):
    """A PEFT config targets expert weights that a zoo model's (quantized, factored, ...) experts do not hold."""


def check_expert_targets(peft_config, model) -> None:
    """Every expert parameter the translated config targets is held by every MoE layer's experts."""
    from zoo.moe.layout import moe_layers
    from zoo.moe.block import unwrapped

    wanted = {t for t in (getattr(peft_config, "target_parameters", None) or ())
              if t.rpartition(".")[2] in ("gate_up_proj", "down_proj")}
    for i, moe in moe_layers(model):
        experts = unwrapped(moe.experts)
        held = {name for name, _ in experts.named_parameters()}
        missing = sorted(t for t in wanted if t.rpartition(".")[2] not in held)
        if missing:
            raise ExpertTargetMissing(
                f"layer {i}'s experts are {type(experts).__name__} ({experts.name}), which hold no "
                f"{', '.join(missing)}: LoRA cannot adapt them. Target the router and attention only, or adapt "
                "the float model before quantizing")


def _checked(convert):
    def convert_and_check(peft_config, model, conversions):
        convert(peft_config, model, conversions)
        if str(getattr(getattr(model, "config", None), "model_type", "")).startswith("zoo_"):
            check_expert_targets(peft_config, model)

    convert_and_check.zoo_checked = True
    return convert_and_check


PEFT_MODULE = "peft.utils.transformers_weight_conversion"  # PEFT imports it when it first builds an adapter
_pending: dict[str, object] = {}  # families registered before PEFT's tables were imported


def register(family) -> bool:
    """Add ``zoo_<family>`` to PEFT's name translation, now if PEFT's tables are imported, else when they are
    (``register_pending``, run by the zoo's import hook): a zoo model costs no PEFT import until PEFT is used.
    False where this PEFT or transformers has no such tables, or until they are imported."""
    if PEFT_MODULE not in sys.modules:
        _pending[family.name] = family
        return False
    return _register(family)


def register_pending(_module=None) -> None:
    """Register the families that came before PEFT's tables (the import hook calls this right after they run)."""
    for name in list(_pending):
        _register(_pending.pop(name))


def _register(family) -> bool:
    try:
        from peft.utils import transformers_weight_conversion as peft_conv
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
        tables = (peft_conv._MODEL_TO_CONVERSION_PATTERN, peft_conv._MOE_TARGET_MODULE_MAPPING,
                  peft_conv._MOE_FUSED_TARGETS)
    except (ImportError, AttributeError):
        return False
    if not getattr(peft_conv.convert_peft_config_for_transformers, "zoo_checked", False):
        peft_conv.convert_peft_config_for_transformers = _checked(peft_conv.convert_peft_config_for_transformers)
    model_type = f"zoo_{family.name}"
    names = target_names(family)
    patterns, mapping, fused = tables
    patterns[model_type] = model_type
    mapping[model_type] = names
    fused[model_type] = fused_targets(names)
    if get_checkpoint_conversion_mapping(model_type) is None:
        # PEFT translates only for model types transformers converts; a zoo checkpoint's keys are already its own
        register_checkpoint_conversion_mapping(model_type, [])
    return True
