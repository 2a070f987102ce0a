"""Publish a zoo model on the Hugging Face Hub: weights, model card and tokenizer in a model repo, and the
Gradio Space that demonstrates its components in a Space repo that points back at it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from zoo.publishing.token_masking import masked_errors

DEFAULT_SPACE = "router-explorer"
# What a saved model folder's push takes besides its weights (the index's shards) and the tokenizer, generation
# config, chat templates and processor files (zoo.io.loading.SIDE_FILES): the config, and the records the zoo writes
# beside a model (its evaluation, training history, fine-tune record, usage plots). Nothing else goes up unless
# named in ``extra_files``: not a dotfile, not a user's notes, not a training state.
MODEL_RECORDS = ("config.json", "eval.json", "training.json", "finetune.json", "expert_usage.png", "group_usage.png")


def model_files(folder) -> list[str]:
    """The files of the saved model ``folder`` that belong to the model (relative paths, sorted): config, weights
    (a single file, or the index and every shard it names), side files and the zoo's records, and the code files an
    ``auto_map`` names. README.md is left out: the push renders the card anew."""
    import json

    from zoo.io.checkpoint import INDEX, SINGLE, weight_map
    from zoo.io.loading import SIDE_FILES, SIDE_FOLDERS

    folder = Path(folder)
    names = set(MODEL_RECORDS) | set(SIDE_FILES)
    if (folder / SINGLE).is_file():  # what transformers reads first; a stale index beside it stays home
        names.add(SINGLE)
    elif (folder / INDEX).is_file():
        names |= {INDEX} | {os.path.basename(f) for f in weight_map(folder).values()}
    try:
        auto_map = json.loads((folder / "config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        auto_map = {}
    for ref in auto_map.values() if isinstance(auto_map, dict) else ():
        for item in ref if isinstance(ref, list) else [ref]:
            if isinstance(item, str) and "--" not in item and "." in item:
                names.add(item.rsplit(".", 1)[0] + ".py")
    found = [n for n in names if (folder / n).is_file()]
    for sub in SIDE_FOLDERS:
        found += [p.relative_to(folder).as_posix() for p in sorted((folder / sub).rglob("*")) if p.is_file()]
    return sorted(found)


def _extra(folder: Path | None, extra_files) -> list[str]:
    """``extra_files`` as paths relative to ``folder``, each an existing file inside it, checked before any upload."""
    if not extra_files:
        return []
    if isinstance(extra_files, (str, os.PathLike)):
        extra_files = [extra_files]
    if folder is None:
        raise ValueError("extra_files names files of a saved folder: push the folder (its path), not a model in memory")
    root, out = folder.resolve(), []
    for name in extra_files:
        path = (folder / os.fspath(name)).resolve()
        if root not in path.parents or not path.is_file():
            raise FileNotFoundError(f"extra file {os.fspath(name)!r} is not a file inside {os.fspath(folder)}")
        out.append(path.relative_to(root).as_posix())
    return out


def space_for(model) -> tuple[str, type | None]:
    """(Space name, component class that names it): the first step of the recipe whose component has a
    ``space``; ``router-explorer`` when none has."""
    from zoo.components.registry import registry

    for step in model.config.zoo_recipe or []:
        reg = registry.by_kind.get(step.get("kind"), {}).get(step.get("name"))
        if reg is not None and getattr(reg.obj, "space", ""):
            return reg.obj.space, reg.obj
    return DEFAULT_SPACE, None


def push_to_hub(model, repo_id: str, space: bool = True, tokenizer=None, token: str | None = None,
                private: bool = False, commit_message: str = "Upload model with moe-zoo",
                space_dir: str | os.PathLike | None = None, endpoint: str | None = None,
                extra_files=()) -> dict:
    """Upload ``model`` (a zoo model, or the folder of a saved one: its shards are uploaded from disk, never
    loaded) to the model repo ``repo_id`` and, with ``space=True``, its demo Space to ``<repo_id>-<space>``.

    The model repo gets ``model.save_pretrained`` (weights, config, the model card as README.md) and the
    tokenizer: ``tokenizer`` when given, else the tokenizer files beside ``config._name_or_path`` when that
    is a folder. The Space is the folder ``spaces/<space>/`` (or ``space_dir``) of the first recipe component
    that names one; its README front matter lists ``repo_id`` under ``models``, and its ``MOE_ZOO_MODEL``
    variable is set to ``hf-hub:<repo_id>`` when the Space is created. A saved folder uploads only what belongs to the
    model (``model_files``: config, weights, tokenizer and side files, the zoo's records); other files of the folder
    (dotfiles, notes) stay home unless named in ``extra_files`` (paths inside the folder). The result lists the
    uploaded files (``files``) and the folder's files left out (``left_out``). ``endpoint`` defaults to
    ``HF_ENDPOINT``. The token is sent only as the Authorization header: it is not in the result, and an
    error that would show it (or any token of this process, see ``masked_errors``) is raised masked.
    """
    from huggingface_hub import HfApi

    from zoo.publishing.cards import card
    from zoo.demos.spaces import space_dir as shipped_space

    saved, extra = None, []
    if isinstance(model, (str, os.PathLike)):  # a saved folder: its weights go up as they are, never loaded
        from zoo.editing.stream import open_checkpoint, resolve

        saved = Path(resolve(model))
        extra = _extra(saved, extra_files)
        checkpoint = open_checkpoint(saved)
        checkpoint.release_outer()
        model = checkpoint.model  # the structure on the meta device: enough for the card and the Space
    elif extra_files:
        _extra(None, extra_files)
    if getattr(type(model), "zoo_family", None) is None:
        raise TypeError(f"push_to_hub takes a zoo model, not {type(model).__name__}: zoo.convert(model) first")
    api = HfApi(endpoint=endpoint, token=token)
    result = {"repo_id": repo_id, "url": None, "commit_oid": None, "commit_url": None, "files": [], "left_out": [],
              "space_id": None, "space_url": None, "space_commit_oid": None}
    # a saved folder is staged beside itself (hard links on the same file system: no copy of the weights)
    with masked_errors(token), tempfile.TemporaryDirectory(prefix=".moe-zoo-push-", dir=saved and saved.parent) as tmp:
        folder = Path(tmp) / "model"
        rendered = card(model, repo_id=repo_id)  # "how to load" names the repo, not PATH
        if saved is not None:
            chosen = sorted(set(model_files(saved)) | set(extra))
            _link_files(saved, folder, chosen)
            rendered.save(folder / "README.md")
            result["left_out"] = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*")
                                        if p.is_file() and p.name != "README.md"
                                        and p.relative_to(saved).as_posix() not in chosen)
        else:
            model.save_pretrained(folder, model_card=rendered)
        if tokenizer is not None:  # else the tokenizer files travel with the save (or the saved folder's links)
            tokenizer.save_pretrained(folder)
        result["files"] = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
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


def _link_files(source: Path, dest: Path, names) -> None:
    """The files ``names`` (relative paths) of ``source`` in ``dest``, hard-linked where the file system allows,
    else copied."""
    dest.mkdir(parents=True)
    for name in names:
        path, target = source / name, dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


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
