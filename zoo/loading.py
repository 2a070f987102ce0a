"""Loading models and tokenizers by folder, registry name, ``hf-hub:`` id or hub id."""
from __future__ import annotations

import os
import warnings

from zoo.registry import get_model, is_model_name, registry


class HubUnavailable(OSError):
    pass


def looks_like_path(target: str) -> bool:
    """Written as a path: ``./x``, ``../x``, ``/x``, ``~/x``, a Windows separator, or more than one ``/`` (a hub
    id has exactly one)."""
    return (target.split("/", 1)[0] in ("", ".", "..") or target.startswith("~") or target.count("/") > 1
            or (os.sep != "/" and os.sep in target))


def resolve_path(target: str) -> str:
    """A folder stays a folder; ``hf-hub:org/name`` becomes ``org/name``; a registry name becomes its
    shipped folder or hub id; anything else without a slash must be a registry name (close matches).
    A target written as a path must be an existing folder (``FileNotFoundError`` / ``NotADirectoryError``)."""
    if not target.strip():
        raise ValueError("no model given: name a folder, a registry name or a hub id")
    if os.path.isdir(target):
        return target
    if target.startswith("hf-hub:"):
        return target[len("hf-hub:"):]
    if looks_like_path(target):
        path = os.path.expanduser(target)
        if os.path.isdir(path):
            return path
        if os.path.exists(path):
            raise NotADirectoryError(f"{target!r} is a file, not a model folder")
        raise FileNotFoundError(f"no such folder: {target!r}")
    if is_model_name(target):
        entry = get_model(target)
        if entry.local_path and os.path.isdir(entry.local_path):
            return entry.local_path
        if entry.hub_id is None:
            dist = registry.get("model", entry.name).distribution
            raise FileNotFoundError(f"{entry.name} ships with {dist} but its checkpoint is missing at "
                                    f"{entry.local_path}; reinstall {dist}")
        return entry.hub_id
    if os.path.exists(target):
        raise NotADirectoryError(f"{target!r} is a file, not a model folder")
    if "/" not in target:
        get_model(target)  # raises with close matches
    return target


def load_tokenizer(name_or_path: str, **kwargs):
    """The tokenizer stored with a model (folder, registry name, ``hf-hub:`` id or hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_path(os.fspath(name_or_path)), **kwargs)


def tokenizer_for(model):
    """The tokenizer saved with ``model`` (its folder or hub id, ``config.name_or_path``), else the zoo's own:
    the one tokenizer lookup every component that tokenizes text for a model uses."""
    from zoo.data.tokenizer import load_tokenizer as zoo_tokenizer

    try:
        return load_tokenizer(model.config.name_or_path)
    except (OSError, ValueError, KeyError):  # no folder, no tokenizer in it, not a name the zoo knows
        return zoo_tokenizer()


def load(name_or_path: str, convert: bool = True, **kwargs):
    """Load a local folder, a registry name, ``hf-hub:org/name`` or a hub id as a causal LM (a vision-language
    model through ``AutoModelForImageTextToText``).

    Native checkpoints of a supported family are converted to the zoo block (losslessly) unless
    ``convert=False``. Offline, a hub id that is not cached fails with an error that says so.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from zoo import finite
    from zoo.convert import convert as convert_model
    from zoo.token_masking import masked_errors

    given = os.fspath(name_or_path)
    target = resolve_path(given)
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, kwargs.get("subfolder", ""), "config.json")):
            raise FileNotFoundError(f"no config.json in {target!r}: not a saved model folder")
    else:
        try:
            validate_repo_id(target)
        except HFValidationError:
            raise ValueError(f"{target!r} is not a folder, a registry name or a hub id (org/name)") from None
    try:
        with masked_errors(kwargs.get("token")):
            model = auto_class(target, kwargs).from_pretrained(target, **kwargs)
    except OSError as exc:
        if os.path.isdir(target):
            raise
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        why = "the Hub is offline here (HF_HUB_OFFLINE=1)" if offline else "the Hub could not be reached"
        no_folder = "there is no local folder of that name, " if target == given else ""
        raise HubUnavailable(f"cannot load {target!r}: {no_folder}{why} and it is not in the local cache "
                             f"({exc})") from None  # the cause may hold request headers; exc is masked
    if finite.enabled() and getattr(type(model), "zoo_family", None) is None:  # zoo classes check while loading
        finite.check_finite(model)
    if convert:
        from zoo.architectures.family import NotConvertible

        try:
            model = convert_model(model)
        except NotConvertible as exc:  # an MoE family the zoo cannot hold: say why, return it as transformers built it
            warnings.warn(f"{exc}; loaded without conversion", stacklevel=2)
        except TypeError:
            pass  # not an MoE family the zoo knows: return it as transformers built it
    return model


def auto_class(target: str, kwargs: dict):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if "config" in kwargs:
        config = kwargs["config"]
    else:
        keys = ("token", "revision", "subfolder", "trust_remote_code", "cache_dir", "local_files_only")
        try:
            config = AutoConfig.from_pretrained(target, **{k: kwargs[k] for k in keys if k in kwargs})
        except (OSError, ValueError):  # unreadable here: the model's own load reports it
            return AutoModelForCausalLM
    causal, vision = AutoModelForCausalLM._model_mapping, AutoModelForImageTextToText._model_mapping
    if type(config) not in causal and type(config) in vision:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
