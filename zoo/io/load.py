"""``zoo.load``: a model by folder, registry name, ``hf-hub:`` id or hub id, checked by the one reader, converted
to the zoo block, and an adapter folder as its base with the adapter on it."""
from __future__ import annotations

import os
import warnings

from zoo.io.adapter_folder import ADAPTER_WEIGHTS, base_name, recorded_adapter
from zoo.io.loading import HubUnavailable, resolve_path


def load(name_or_path: str, convert: bool = True, **kwargs):
    """Load a local folder, a registry name, ``hf-hub:org/name`` or a hub id as a causal LM (a vision-language
    model through ``AutoModelForImageTextToText``).

    Native checkpoints of a supported family are converted to the zoo block (losslessly) unless
    ``convert=False``. A PEFT adapter folder (``moe-zoo finetune``'s output) loads as its base model with the
    adapter on it (``zoo.io.adapter_folder``). Offline, a hub id that is not cached fails with an error that says so.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from zoo.io import finite
    from zoo.io.adapter_folder import is_adapter_folder
    from zoo.io.convert import convert as convert_model
    from zoo.publishing.token_masking import masked_errors

    given = os.fspath(name_or_path)
    target = resolve_path(given)
    if os.path.isdir(target) and is_adapter_folder(target):
        return load_adapter_folder(target, **kwargs)  # a PEFT adapter: its base model with the adapter on it
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, kwargs.get("subfolder", ""), "config.json")):
            raise FileNotFoundError(f"no config.json in {target!r}: not a saved model folder")
    else:
        try:
            validate_repo_id(target)
        except HFValidationError:
            raise ValueError(f"{target!r} is not a folder, a registry name or a hub id (org/name)") from None
    if kwargs.get("use_safetensors", True) is False:
        raise ValueError("use_safetensors=False would unpickle the weights: the zoo reads safetensors only")
    kwargs["use_safetensors"] = True  # never unpickle
    wants_info = kwargs.get("output_loading_info", False)
    local = os.path.isdir(target)
    if local:  # the one reader's checks, on the headers alone, before transformers reads a byte of the weights
        from zoo.io.checkpoint import stored_dtypes

        folder = os.path.join(target, kwargs.get("subfolder", ""))
        stored = stored_dtypes(folder)
        pickled = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
        if stored is None and pickled:
            raise FileNotFoundError(f"{target} holds pickled weights ({pickled[0]}) and no safetensors: the zoo never "
                                    "unpickles; save them as safetensors (model.save_pretrained(folder)) in a process "
                                    "you trust")
    try:
        with masked_errors(kwargs.get("token")):
            loaded = auto_class(target, kwargs).from_pretrained(target, **{**kwargs, "output_loading_info": True})
        model, info = loaded
    except OSError as exc:
        if os.path.isdir(target):
            raise
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        why = "the Hub is offline here (HF_HUB_OFFLINE=1)" if offline else "the Hub could not be reached"
        no_folder = "there is no local folder of that name, " if target == given else ""
        raise HubUnavailable(f"cannot load {target!r}: {no_folder}{why} and it is not in the local cache "
                             f"({exc})") from None  # the cause may hold request headers; exc is masked
    if local and stored is not None:
        from zoo.io.checkpoint import check_loading_info, check_stored_dtypes

        check_loading_info(target, info, model)
        if getattr(model.config, "quantization_config", None) is None:  # (a quantizer's own packed formats)
            check_stored_dtypes(target, stored, model)
    if finite.enabled() and getattr(type(model), "zoo_family", None) is None:  # zoo classes check while loading
        finite.check_finite(model)
    if convert:
        from zoo.architectures.lookup import NotConvertible

        try:
            model = convert_model(model)
        except NotConvertible as exc:  # an MoE family the zoo cannot hold: say why, return it as transformers built it
            warnings.warn(f"{exc}; loaded without conversion", stacklevel=2)
        except TypeError:
            pass  # not an MoE family the zoo knows: return it as transformers built it
    return (model, info) if wants_info else model


def auto_class(target: str, kwargs: dict):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model, or AutoModelForSeq2SeqLM
    for an encoder-decoder (Switch Transformers)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    if "config" in kwargs:
        config = kwargs["config"]
    else:
        keys = ("token", "revision", "subfolder", "trust_remote_code", "cache_dir", "local_files_only")
        try:
            config = AutoConfig.from_pretrained(target, **{k: kwargs[k] for k in keys if k in kwargs})
        except (OSError, ValueError):  # unreadable here: the model's own load reports it
            return AutoModelForCausalLM
    causal, vision = AutoModelForCausalLM._model_mapping, AutoModelForImageTextToText._model_mapping
    # a vision-language config whose causal-LM class is its text model's (Llama 4: Llama4ForCausalLM reads the text
    # config): that class would drop the vision tower
    text_part = type(config) in causal and getattr(causal[type(config)], "config_class", None) is not type(config)
    if (type(config) not in causal or text_part) and type(config) in vision:
        return AutoModelForImageTextToText
    if type(config) not in causal and type(config) in AutoModelForSeq2SeqLM._model_mapping:
        return AutoModelForSeq2SeqLM
    return AutoModelForCausalLM


def load_adapter_folder(folder, **kwargs):
    """The base model (``zoo.load``, converted) with the adapter of ``folder`` on it."""
    from zoo.components.registry import registry

    base = base_name(folder)
    try:
        model = load(base, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        why = exc.args[0] if exc.args else exc
        raise (OSError if isinstance(exc, OSError) else ValueError)(
            f"{folder} is an adapter on {base}, which cannot be loaded: {why}") from None
    weights = os.path.join(folder, ADAPTER_WEIGHTS)
    if os.path.isfile(weights):
        from zoo.io.checkpoint import read_checked, shard_header

        for key in shard_header(weights)[1]:  # the one reader's checks: header, byte ranges, dtypes, finite
            if key != "__metadata__":
                read_checked(weights, key)
    name = recorded_adapter(folder)
    adapter = registry.find("adapter", name) if name is not None else None
    try:
        if adapter is not None and getattr(adapter.obj, "load_saved", None) is not None:
            return adapter.obj.load_saved(model, folder)
        from peft import PeftModel

        return PeftModel.from_pretrained(model, folder)
    except RuntimeError as exc:
        if "size mismatch" not in str(exc) and "shape" not in str(exc):
            raise
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise ValueError(f"{folder} does not fit its base {base}: the adapter was trained on a model of other "
                         f"shapes ({detail[:300]})") from None
