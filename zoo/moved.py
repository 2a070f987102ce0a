"""Module paths from before ``zoo/`` was grouped in rooms, kept importing for one release: ``import zoo.loading``
gives ``zoo.io.loading`` itself (the same module object, so a patch through either name is seen by both) and a
DeprecationWarning naming the new path. This table is the one place that lists them."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "zoo.kernels": "zoo.moe.kernels",
    "zoo.kernels.linear": "zoo.moe.kernels.linear",
    "zoo.layout": "zoo.moe.layout",
    "zoo.moe.offloaded": "zoo.runtime.offloaded",
    "zoo.demo_controls": "zoo.components.controls",
    "zoo.options": "zoo.components.options",
    "zoo.registry": "zoo.components.registry",
    "zoo.plugins": "zoo.components.plugins",
    "zoo.install": "zoo.components.install",
    "zoo.scaffold": "zoo.components.scaffold",
    "zoo.resources": "zoo.components.resources",
    "zoo.model_entries": "zoo.components.model_entries",
    "zoo.remote_code": "zoo.architectures.remote_code",
    "zoo.atomic": "zoo.io.atomic",
    "zoo.shards": "zoo.io.shards",
    "zoo.finite": "zoo.io.finite",
    "zoo.checkpoint": "zoo.io.checkpoint",
    "zoo.loading": "zoo.io.loading",
    "zoo.convert": "zoo.io.convert",
    "zoo.gguf_export": "zoo.io.gguf_export",
    "zoo.compressed_tensors_export": "zoo.io.compressed_tensors_export",
    "zoo.adapter_folder": "zoo.io.adapter_folder",
    "zoo.config_keys": "zoo.io.config_keys",
    "zoo.apply": "zoo.editing.apply",
    "zoo.layerwise": "zoo.editing.layerwise",
    "zoo.stream": "zoo.editing.stream",
    "zoo.calibration": "zoo.editing.calibration",
    "zoo.stats": "zoo.editing.stats",
    "zoo.snapshot": "zoo.editing.snapshot",
    "zoo.consolidation": "zoo.editing.consolidation",
    "zoo.decode_aot": "zoo.runtime.decode_aot",
    "zoo.decode": "zoo.runtime.decode",
    "zoo.offloading": "zoo.runtime.offloading",
    "zoo.eval": "zoo.evaluation.eval",
    "zoo.harness": "zoo.evaluation.harness",
    "zoo.claims": "zoo.evaluation.claims",
    "zoo.train_cli": "zoo.cli.train",
    "zoo.train": "zoo.training.train",
    "zoo.finetune": "zoo.training.finetune",
    "zoo.cards": "zoo.publishing.cards",
    "zoo.hub": "zoo.publishing.hub",
    "zoo.ship": "zoo.publishing.ship",
    "zoo.token_masking": "zoo.publishing.token_masking",
    "zoo.cli_helpers": "zoo.cli.helpers",
    "zoo.demo_cli": "zoo.cli.demo",
    "zoo.generate_cli": "zoo.cli.generate",
    "zoo.plugin_cli": "zoo.cli.plugin",
    "zoo.tour": "zoo.cli.tour",
    "zoo.spaces": "zoo.demos.spaces",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path stops working in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module at its new path has run already


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before path finders: an old file left in a checkout is not read
