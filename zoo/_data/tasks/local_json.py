"""Loads the moe-zoo tasks' data for lm-evaluation-harness, offline: ``custom_dataset: !function local_json.load``.

The task YAMLs say ``dataset_path: json`` and name their ``data_files`` relative to this folder; lm-eval would
resolve a relative path against the working directory, so this loader resolves it here, checks each file's sha256
against ``MANIFEST.json`` and hands the files to ``datasets``' own ``json`` builder. Plain lm-eval uses it as it is
(``TaskManager(include_path=<this folder>)``): nothing here imports moe-zoo.
"""
import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _checked(name: str) -> str:
    path = HERE / name
    entry = json.loads((HERE / "MANIFEST.json").read_text())["files"].get(name)
    if entry is None:
        raise FileNotFoundError(f"{name} is not listed in {HERE / 'MANIFEST.json'}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        raise ValueError(f"{path}: sha256 {digest}, MANIFEST.json says {entry['sha256']}: the file is corrupt or "
                         "stale; rebuild with `python -m zoo.data.eval_tasks build`")
    return str(path)


def load(data_files, **metadata):
    """The ``DatasetDict`` of ``data_files`` (``{split: file relative to this folder}``); ``metadata`` is the task's
    metadata, which lm-eval passes along and this loader does not need."""
    import datasets

    return datasets.load_dataset("json", data_files={split: _checked(name) for split, name in data_files.items()})
