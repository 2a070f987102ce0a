"""The two variants each family's tests run in: ``native`` (transformers' classes) and ``zoo`` (moe-zoo's).

The zoo variant subclasses the family's native tester and swaps its classes for the zoo ones from
``zoo.architectures.factory.zoo_classes``: ``Zoo<Family>Config`` / ``Zoo<Family>Model`` /
``Zoo<Family>ForCausalLM``. Its config is a fresh zoo config built from the same kwargs as the native tester's, plus
the ``zoo_layout`` that ``zoo.convert`` records for a native model of that config: the zoo model under test has
moe-zoo's own MoE blocks (``SparseMoE``), as every converted or zoo-loaded model does. ``MOE_ZOO_SUITE_LAYOUT=none``
builds the zoo config with ``zoo_layout=None`` instead (a fresh zoo config, as a user would write one).

Task heads (sequence / token classification, question answering): where the family has one, the zoo tester uses
the zoo's twin (``zoo.architectures.factory.Zoo<NativeHead>``) when the factory makes one, and has none otherwise.

transformers' tests find a class's role (base model, causal LM, ...) by looking its *name* up in transformers' static
``MODEL_*_MAPPING_NAMES`` tables (e.g. ``_prepare_for_class`` adds ``labels`` only for names listed as causal LMs).
Classes registered at run time with ``AutoModel*.register`` -- as the zoo's are -- are never in those tables, so
``register_zoo_names`` adds the zoo names to the tables *as seen by the vendored test module only* (copies bound in
its namespace; transformers' own tables are untouched).

Two tests decide whether they apply by reading the *source file* of the classes under test, which for the zoo is
``zoo/architectures/factory.py``, not the family's modeling file; ``ZooAdaptations`` points them at the family's:
``test_can_init_all_missing_weights`` (runs only if the config class's file has a copyright year of 2023 or later)
and ``test_moe_models_record_router_logits`` (runs only if the modeling source uses ``@use_experts_implementation``).
The test bodies are upstream's, unchanged; only ``inspect.getfile`` / ``inspect.getsource`` answer, for the zoo
classes, what they answer for the family's native ones while the test runs.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import os
from collections import OrderedDict
from unittest import mock

from .families import FAMILIES, make_test_class, native_classes, native_tester


def family_object(family: str):
    from zoo.components.registry import registry
    from zoo.components.plugins import load_plugins

    load_plugins()
    return registry.get("architecture", family).obj


def zoo_classes_of(family: str):
    from zoo.architectures.factory import zoo_classes

    return zoo_classes(family_object(family))


@functools.lru_cache(maxsize=None)
def _layout(family: str, kwargs_json: str):
    import torch
    import zoo

    fam = family_object(family)
    with torch.random.fork_rng():
        model = fam.model_class(fam.config_class(**json.loads(kwargs_json)))
        zoo.convert(model)
    return model.config.zoo_layout


def zoo_layout_for(family: str, kwargs: dict):
    """The layout ``zoo.convert`` gives a native model of ``kwargs`` (cached; a deep copy each call)."""
    if os.environ.get("MOE_ZOO_SUITE_LAYOUT", "converted") == "none":
        return None
    return copy.deepcopy(_layout(family, json.dumps(kwargs, sort_keys=True)))


_HEADS = ("sequence_classification_class", "token_classification_class", "question_answering_class")


def zoo_heads_of(family: str) -> dict:
    """{role: zoo head class or None} for the family's native heads (None where the zoo makes no twin)."""
    import zoo.architectures.factory as factory

    zoo_classes_of(family)  # makes (and registers) the heads too
    natives = native_classes(family)
    return {role: natives[role] and getattr(factory, "Zoo" + natives[role].__name__, None) for role in _HEADS}


def zoo_tester(family: str) -> type:
    native = native_tester(family)
    cfg_cls, base_cls, lm_cls = zoo_classes_of(family)

    def get_config(self):
        kwargs = self.config_kwargs()
        return cfg_cls(**kwargs, zoo_layout=zoo_layout_for(family, kwargs))

    return type(f"Zoo{native.__name__}", (native,), {
        "config_class": cfg_cls, "base_model_class": base_cls, "causal_lm_class": lm_cls,
        **zoo_heads_of(family), "get_config": get_config,
    })


class ZooAdaptations:
    """Mixed into the zoo test classes only (see the module docstring)."""

    def _as_native(self, function_name):
        """Patch ``inspect.<function_name>`` so the zoo classes and their module read as the native ones."""
        native = {self.model_tester.config_class: self.native_classes["config_class"],
                  inspect.getmodule(self.model_tester.causal_lm_class):
                      inspect.getmodule(self.native_classes["causal_lm_class"])}
        real = getattr(inspect, function_name)
        return mock.patch.object(inspect, function_name, lambda obj, *a, **k: real(native.get(obj, obj), *a, **k))

    def test_can_init_all_missing_weights(self):
        with self._as_native("getfile"):
            super().test_can_init_all_missing_weights()

    def test_moe_models_record_router_logits(self):
        with self._as_native("getsource"):
            super().test_moe_models_record_router_logits()


_ROLE_TABLES = {"base_model_class": "MODEL_MAPPING_NAMES", "causal_lm_class": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
                "sequence_classification_class": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                "token_classification_class": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                "question_answering_class": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"}


def register_zoo_names(family: str) -> None:
    from .upstream import test_modeling_common as tmc

    cfg_cls, base_cls, lm_cls = zoo_classes_of(family)
    classes = {"base_model_class": base_cls, "causal_lm_class": lm_cls, **zoo_heads_of(family)}
    for role, table in _ROLE_TABLES.items():
        if classes[role] is not None:
            names = OrderedDict(getattr(tmc, table))
            names[cfg_cls.model_type] = classes[role].__name__
            setattr(tmc, table, names)


def classes_for(family: str, module: str) -> dict:
    """``{name: TestCase}`` for ``family``: ``Test<Family>Native`` and ``Test<Family>Zoo``."""
    assert family in FAMILIES, family
    register_zoo_names(family)
    out = {}
    for variant, tester, mixins in (("native", native_tester(family), ()),
                                    ("zoo", zoo_tester(family), (ZooAdaptations,))):
        cls = make_test_class(family, variant, tester, module, mixins)
        cls.native_classes = native_classes(family)
        out[cls.__name__] = cls
    return out
