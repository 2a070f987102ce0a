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


# What travels beside the weights: tokenizer files, generation config, chat template, processor configs.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json",
              "merges.txt", "vocab.txt", "spiece.model", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json")
SIDE_FOLDERS = ("additional_chat_templates",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
ZOO_VOCAB = 8192  # the zoo's own tokenizer (zoo/_data/tokenizer)


class TokenizerMismatch(ValueError):
    """A tokenizer whose vocabulary does not fit the model, or none where the zoo's own cannot stand in."""


def source_folder(src) -> str | None:
    """The local folder holding ``src``'s files: the folder itself, a registry name's shipped folder, or a hub
    id's snapshot in the local cache (never downloaded here); None when there is none."""
    if not src:
        return None
    try:
        target = resolve_path(os.fspath(src))
    except (OSError, ValueError, KeyError):
        return None
    if os.path.isdir(target):
        return target
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError

    try:
        return snapshot_download(target, local_files_only=True)
    except (OSError, ValueError, HFValidationError):  # not cached, or not a hub id
        return None


def input_folders(src) -> list[str]:
    """The local folders a model ``src`` (a folder, registry name, cached hub id, or a loaded model) is read from: its
    own and, for a PEFT adapter folder, its base's (a merge or fine-tune that wrote there would change the input)."""
    from zoo.adapter_folder import base_name, is_adapter_folder

    if src is not None and not isinstance(src, (str, os.PathLike)):
        inner = src.get_base_model() if hasattr(src, "get_base_model") else src
        src = getattr(getattr(inner, "config", None), "name_or_path", None)
    folder = source_folder(src) if src else None
    if folder is None:
        return []
    folders = [folder]
    if is_adapter_folder(folder):
        try:
            folders += input_folders(base_name(folder))
        except ValueError:
            pass
    return folders


def check_output_apart(out, *sources, what: str = "the output") -> None:
    """``zoo.atomic.SaveTargetError`` when ``out`` is, or lies inside, a folder any of ``sources`` is read from."""
    from zoo.atomic import check_apart

    for src in sources:
        for folder in input_folders(src):
            check_apart(folder, out, what)


def copy_side_files(src, dest, keep=None) -> list[str]:
    """Copy ``src``'s tokenizer files, generation config, chat template and processor configs into ``dest`` (a
    save's staging folder); returns the names copied. ``src``: a folder, registry name or cached hub id. ``keep``:
    the save's target folder, whose own files of these names are left as they are (not replaced by the source's)."""
    import shutil

    folder = source_folder(src)
    if folder is None or os.path.realpath(folder) in {os.path.realpath(d) for d in (dest, keep) if d}:
        return []
    copied = []
    for name in SIDE_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not (keep and os.path.lexists(os.path.join(keep, name))):
            shutil.copyfile(path, os.path.join(dest, name))  # a cached hub file is a link: its content
            copied.append(name)
    for name in SIDE_FOLDERS:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not any(os.path.exists(os.path.join(d, name)) for d in (dest, keep) if d):
            shutil.copytree(path, os.path.join(dest, name))
            copied.append(name)
    return copied


def model_vocab(model) -> int | None:
    """The number of token ids the model's input embeddings take."""
    config = getattr(model, "config", None)
    vocab = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
    return vocab if isinstance(vocab, int) else None


def tokenizer_size(tokenizer) -> int:
    """One more than the largest id the tokenizer can give (its added tokens included)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def check_tokenizer(tokenizer, model, where: str = "the tokenizer") -> None:
    """``TokenizerMismatch`` naming both sizes unless the tokenizer fits the model: no id past the model's
    vocabulary, and at least half of the vocabulary in use (models pad their vocabulary a little, not 4x)."""
    vocab = model_vocab(model)
    size = tokenizer_size(tokenizer)
    if vocab is not None and (size > vocab or 2 * size < vocab):
        raise TokenizerMismatch(f"{where} has {size} tokens but the model's vocabulary has {vocab}: it is not "
                                "this model's tokenizer; save the model's own tokenizer beside it "
                                "(tokenizer.save_pretrained(folder))")


def tokenizer_for(model, required: bool = False):
    """The tokenizer saved with ``model`` (its folder, registry name or hub id: ``config.name_or_path``), checked
    to fit the model's vocabulary (``TokenizerMismatch`` naming both sizes); where there is none, the zoo's own if
    the model's vocabulary is the zoo's 8192 tokens, else a ``MissingTokenizer`` that raises, saying what to do,
    when it is used (``required=True``: raises it now). The one tokenizer lookup every component that tokenizes
    text for a model uses."""
    from zoo.data.tokenizer import load_tokenizer as zoo_tokenizer

    name = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    folder = source_folder(name)
    tokenizer = None
    if folder is not None and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        try:
            tokenizer = load_tokenizer(folder)
        except (OSError, ValueError, KeyError) as exc:
            raise TokenizerMismatch(f"the tokenizer saved with {name} cannot be loaded: {exc}") from None
    elif folder is None and name and not os.path.isdir(name) and not looks_like_path(name):
        try:
            tokenizer = load_tokenizer(name)  # a hub id: its tokenizer from the Hub (or the cache)
        except (OSError, ValueError, KeyError):
            tokenizer = None
    if tokenizer is not None:
        check_tokenizer(tokenizer, model, f"the tokenizer saved with {name}")
        return tokenizer
    vocab = model_vocab(model)
    if vocab is not None and vocab != ZOO_VOCAB:
        missing = MissingTokenizer(f"no tokenizer found for {name or 'this model'} (vocabulary {vocab}; the zoo's "
                                   f"own tokenizer has {ZOO_VOCAB}): save the model's tokenizer beside it "
                                   "(tokenizer.save_pretrained(folder))")
        if required:
            raise TokenizerMismatch(missing.message)
        return missing
    return zoo_tokenizer()


class MissingTokenizer:
    """What ``tokenizer_for`` returns for a model that has no tokenizer and whose vocabulary is not the zoo's: any
    use raises ``TokenizerMismatch`` with the reason, so code that only tokenizes text when it has text (token-id
    calibration batches need no tokenizer) runs, and code that tokenizes gets the one-line error."""

    def __init__(self, message: str):
        self.message = message

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TokenizerMismatch(self.message)

    def __call__(self, *args, **kwargs):
        raise TokenizerMismatch(self.message)

    def __len__(self):
        raise TokenizerMismatch(self.message)

    def __bool__(self):
        return True  # ``tokenizer or default`` keeps it: using it raises

    def __repr__(self):
        return f"MissingTokenizer({self.message!r})"


def load(name_or_path: str, convert: bool = True, **kwargs):
    """Load a local folder, a registry name, ``hf-hub:org/name`` or a hub id as a causal LM (a vision-language
    model through ``AutoModelForImageTextToText``).

    Native checkpoints of a supported family are converted to the zoo block (losslessly) unless
    ``convert=False``. A PEFT adapter folder (``moe-zoo finetune``'s output) loads as its base model with the
    adapter on it (``zoo.adapter_folder``). Offline, a hub id that is not cached fails with an error that says so.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from zoo import finite
    from zoo.adapter_folder import is_adapter_folder, load as load_adapter_folder
    from zoo.convert import convert as convert_model
    from zoo.token_masking import masked_errors

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
        from zoo.checkpoint import stored_dtypes

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
        from zoo.checkpoint import check_loading_info, check_stored_dtypes

        check_loading_info(target, info, model)
        if getattr(model.config, "quantization_config", None) is None:  # (a quantizer's own packed formats)
            check_stored_dtypes(target, stored, model)
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
    return (model, info) if wants_info else model


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
