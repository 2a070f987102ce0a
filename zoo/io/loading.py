"""Loading models and tokenizers by folder, registry name, ``hf-hub:`` id or hub id."""
from __future__ import annotations

import os

from zoo.components.registry import get_model, is_model_name, registry


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
