"""Publish a zoo model on the Hugging Face Hub: weights, model card and tokenizer in a model repo, and the
Gradio Space that demonstrates its components in a Space repo that points back at it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from zoo.token_masking import masked_errors

DEFAULT_SPACE = "router-explorer"


def space_for(model) -> tuple[str, type | None]:
    """(Space name, component class that names it): the first step of the recipe whose component has a
    ``space``; ``router-explorer`` when none has."""
    from zoo.registry import registry

    for step in model.config.zoo_recipe or []:
        reg = registry.by_kind.get(step.get("kind"), {}).get(step.get("name"))
        if reg is not None and getattr(reg.obj, "space", ""):
            return reg.obj.space, reg.obj
    return DEFAULT_SPACE, None


def push_to_hub(model, repo_id: str, space: bool = True, tokenizer=None, token: str | None = None,
                private: bool = False, commit_message: str = "Upload model with moe-zoo",
                space_dir: str | os.PathLike | None = None, endpoint: str | None = None) -> dict:
    """Upload ``model`` (a zoo model, or the folder of a saved one: its shards are uploaded from disk, never
    loaded) to the model repo ``repo_id`` and, with ``space=True``, its demo Space to ``<repo_id>-<space>``.

    The model repo gets ``model.save_pretrained`` (weights, config, the model card as README.md) and the
    tokenizer: ``tokenizer`` when given, else the tokenizer files beside ``config._name_or_path`` when that
    is a folder. The Space is the folder ``spaces/<space>/`` (or ``space_dir``) of the first recipe component
    that names one; its README front matter lists ``repo_id`` under ``models``, and its ``MOE_ZOO_MODEL``
    variable is set to ``hf-hub:<repo_id>`` when the Space is created. ``endpoint`` defaults to
    ``HF_ENDPOINT``. The token is sent only as the Authorization header: it is not in the result, and an
    error that would show it (or any token of this process, see ``masked_errors``) is raised masked.
    """
    from huggingface_hub import HfApi

    from zoo.cards import card
    from zoo.spaces import space_dir as shipped_space

    saved = None
    if isinstance(model, (str, os.PathLike)):  # a saved folder: its weights go up as they are, never loaded
        from zoo.stream import open_checkpoint, resolve

        saved = Path(resolve(model))
        checkpoint = open_checkpoint(saved)
        checkpoint.release_outer()
        model = checkpoint.model  # the structure on the meta device: enough for the card and the Space
    if getattr(type(model), "zoo_family", None) is None:
        raise TypeError(f"push_to_hub takes a zoo model, not {type(model).__name__}: zoo.convert(model) first")
    api = HfApi(endpoint=endpoint, token=token)
    result = {"repo_id": repo_id, "url": None, "commit_oid": None, "commit_url": None,
              "space_id": None, "space_url": None, "space_commit_oid": None}
    # a saved folder is staged beside itself (hard links on the same file system: no copy of the weights)
    with masked_errors(token), tempfile.TemporaryDirectory(prefix=".moe-zoo-push-", dir=saved and saved.parent) as tmp:
        folder = Path(tmp) / "model"
        rendered = card(model, repo_id=repo_id)  # "how to load" names the repo, not PATH
        if saved is not None:
            _link_files(saved, folder)
            rendered.save(folder / "README.md")
        else:
            model.save_pretrained(folder, model_card=rendered)
        if tokenizer is not None:  # else the tokenizer files travel with the save (or the saved folder's links)
            tokenizer.save_pretrained(folder)
        result["url"] = str(api.create_repo(repo_id, private=private, exist_ok=True))
        info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
        result.update(commit_oid=info.oid, commit_url=info.commit_url)
        if not space:
            return result

        name, owner = space_for(model)
        source = Path(space_dir) if space_dir is not None else shipped_space(name, owner)
        space_id = f"{repo_id}-{name}"
        staged = Path(tmp) / "space"
        _stage_space(source, staged, repo_id, name)
        result["space_url"] = str(api.create_repo(
            space_id, repo_type="space", space_sdk="gradio", private=private, exist_ok=True,
            space_variables=[{"key": "MOE_ZOO_MODEL", "value": f"hf-hub:{repo_id}"}]))
        info = api.upload_folder(repo_id=space_id, repo_type="space", folder_path=staged,
                                 commit_message=f"{commit_message} ({name} Space)")
        result.update(space_id=space_id, space_commit_oid=info.oid)
    return result


def _link_files(source: Path, dest: Path) -> None:
    """The files of ``source`` (README.md aside: the card is rendered anew) in ``dest``, hard-linked where the
    file system allows, else copied."""
    dest.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != "README.md":
            try:
                os.link(path, dest / path.name)
            except OSError:
                shutil.copy2(path, dest / path.name)


def _stage_space(source: Path, dest: Path, repo_id: str, name: str) -> None:
    """Copy the Space folder, with ``models: [repo_id]`` in its README front matter."""
    from huggingface_hub import SpaceCard

    if not (source / "app.py").is_file():
        raise FileNotFoundError(f"the Space folder {source} has no app.py")
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    readme = dest / "README.md"
    space_card = (SpaceCard.load(readme) if readme.is_file()
                  else SpaceCard(f"---\nsdk: gradio\napp_file: app.py\n---\n\n# {name}\n"))
    space_card.data.models = [repo_id]
    space_card.save(readme)
