"""Where an output may go: never inside a folder its inputs are read from (an adapter's base included), so a
save cannot change what it reads."""
from __future__ import annotations

import os

from zoo.io.adapter_folder import base_name, is_adapter_folder
from zoo.io.atomic import check_apart
from zoo.io.loading import source_folder


def input_folders(src) -> list[str]:
    """The local folders a model ``src`` (a folder, registry name, cached hub id, or a loaded model) is read from: its
    own and, for a PEFT adapter folder, its base's (a merge or fine-tune that wrote there would change the input)."""
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
    """``zoo.io.atomic.SaveTargetError`` when ``out`` is, or lies inside, a folder any of ``sources`` is read from."""
    for src in sources:
        for folder in input_folders(src):
            check_apart(folder, out, what)
