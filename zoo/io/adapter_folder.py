"""PEFT adapter folders (what ``moe-zoo finetune`` saves unless ``--merge``): ``zoo.load`` loads the base model
the adapter names and puts the adapter on it, so eval, generate, the Spaces and export take the folder as a model.

The folder holds PEFT's ``adapter_config.json`` (its ``base_model_name_or_path`` is the base: a registry name, a
hub id or a folder) and the adapter weights; ``finetune.json``, when the zoo wrote it, names the zoo adapter, whose
``load_saved(model, folder)`` (an optional ``Adapter`` capability) reloads it its own way (lora-experts: the
grouped forward); any other adapter folder loads through ``peft.PeftModel.from_pretrained``.
"""
from __future__ import annotations

import json
import os

ADAPTER_CONFIG = "adapter_config.json"
RECORD = "finetune.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(path) -> bool:
    """A folder with a PEFT adapter and no model config of its own."""
    path = os.fspath(path)
    return (os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
            and not os.path.isfile(os.path.join(path, "config.json")))


def _read(path) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def recorded_adapter(folder) -> str | None:
    """The zoo adapter ``finetune.json`` names (the one whose ``load_saved`` reloads the folder), else None."""
    name = _read(os.path.join(folder, RECORD)).get("adapter")
    return name if isinstance(name, str) else None


def base_name(folder) -> str:
    """The base model an adapter folder was trained on, as its ``adapter_config.json`` names it."""
    base = _read(os.path.join(folder, ADAPTER_CONFIG)).get("base_model_name_or_path")
    if not isinstance(base, str) or not base.strip():
        raise ValueError(f"{folder}: {ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
                         "load the base yourself and use peft.PeftModel.from_pretrained(base, folder)")
    relative = os.path.join(folder, base)
    return relative if not os.path.isabs(base) and os.path.isdir(relative) else base


def portable_base(source) -> str | None:
    """What an adapter should name as its base, so that plain PEFT (``AutoPeftModelForCausalLM``) resolves it offline
    as well as the zoo: a registry model as its hub id when it is on the Hub, else as its shipped folder's absolute
    path; a hub id as itself; a folder as its absolute path (it loads from any working directory); None for a model
    loaded in memory."""
    from zoo.io.loading import looks_like_path
    from zoo.components.registry import get_model, is_model_name

    if source is None:
        return None
    source = os.fspath(source)
    if os.path.isdir(source) or looks_like_path(source):
        return os.path.abspath(os.path.expanduser(source))
    if is_model_name(source):
        entry = get_model(source)
        if entry.hub_id is not None:
            return entry.hub_id
        return os.path.abspath(entry.local_path) if entry.local_path else entry.name
    return source.removeprefix("hf-hub:")


def hub_id_of(base: str | None) -> str | None:
    """The Hub id behind a base reference (a hub id, or a registry model published on the Hub), else None: what
    a card may name as ``base_model``."""
    from zoo.io.loading import looks_like_path
    from zoo.components.registry import get_model, is_model_name

    if not base or os.path.isabs(base) or os.path.isdir(base) or looks_like_path(base):
        return None
    if is_model_name(base):
        return get_model(base).hub_id
    return base if base.count("/") == 1 else None
