"""A zoo model folder opens in any transformers process, through Hugging Face's convention for architectures that live
outside transformers: ``config.json`` carries an ``auto_map`` naming classes in a small code file saved beside the
weights, and ``from_pretrained(folder, trust_remote_code=True)`` imports that file. The file holds no model code: it
imports the installed moe-zoo, which registers the ``zoo_<family>`` types, and names its classes. So lm-eval's ``hf``
model, pipelines, accelerate scripts and TGI/vLLM's transformers backends load the folder without ``import zoo``
in their own code; a process without moe-zoo gets an error that says to install it.

A process that imported zoo already knows the model type and ignores the file (transformers prefers registered
classes unless ``trust_remote_code=True``), so nothing changes for the zoo's own loads.
"""
from __future__ import annotations

import os

CODE_FILE = "modeling_moe_zoo.py"
MODULE = CODE_FILE.removesuffix(".py")

TEMPLATE = '''"""Written by moe-zoo: {model_type} is a moe-zoo model type. This file holds no model code; it imports the installed
moe-zoo, which registers the type with transformers, and names its classes for AutoConfig / AutoModel* with
trust_remote_code=True."""
try:  # (inside try: transformers' import check leaves it to this message)
    import zoo  # noqa: F401  (registers the zoo_<family> model types)
    from zoo.architectures.remote_code import classes_of
except ImportError as exc:
    raise ImportError("this model folder was saved by moe-zoo ({model_type}): install it to load the folder "
                      "(pip install moe-zoo), or load the folder's native export instead") from exc

globals().update(classes_of("{model_type}"))
'''


def classes_of(model_type: str) -> dict[str, type]:
    """``{class name: class}`` of the zoo model type: its config class, base model, causal LM (or image-text-to-text
    model) and task heads, as ``auto_map`` names them."""
    from transformers import CONFIG_MAPPING

    from zoo.components.registry import registry

    config_class = CONFIG_MAPPING[model_type]
    family = registry.find("architecture", model_type.removeprefix("zoo_"))
    out = {config_class.__name__: config_class}
    if family is not None and hasattr(family.obj, "classes"):
        family.obj.classes()  # generic families build their classes on first need
    for auto in _auto_classes().values():
        model_class = auto._model_mapping.get(config_class, None)
        if model_class is not None:
            out[model_class.__name__] = model_class
    return out


def _auto_classes() -> dict:
    from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM,
                              AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                              AutoModelForSequenceClassification, AutoModelForTokenClassification)

    return {"AutoModel": AutoModel, "AutoModelForCausalLM": AutoModelForCausalLM,
            "AutoModelForImageTextToText": AutoModelForImageTextToText,
            "AutoModelForMultimodalLM": AutoModelForMultimodalLM,
            "AutoModelForSeq2SeqLM": AutoModelForSeq2SeqLM,
            "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
            "AutoModelForTokenClassification": AutoModelForTokenClassification,
            "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering}


def auto_map(config) -> dict[str, str]:
    """The ``auto_map`` of a zoo config: each Auto class the zoo registered for its type -> ``modeling_moe_zoo.<Class>``."""
    config_class = type(config)
    out = {"AutoConfig": f"{MODULE}.{config_class.__name__}"}
    for name, auto in _auto_classes().items():
        model_class = auto._model_mapping.get(config_class, None)
        if model_class is not None:
            out[name] = f"{MODULE}.{model_class.__name__}"
    return out


def write(config, folder) -> None:
    """Set ``config.auto_map`` and write the code file into ``folder`` (a save's staging folder), before the config
    is saved."""
    config.auto_map = auto_map(config)
    with open(os.path.join(folder, CODE_FILE), "w") as f:
        f.write(TEMPLATE.format(model_type=type(config).model_type))
