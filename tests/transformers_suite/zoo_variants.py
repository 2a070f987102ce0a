"""The two variants each family's tests run in: ``native`` (transformers' classes) and ``zoo`` (moe-zoo's).

The zoo variant subclasses the family's native tester and swaps its classes for the zoo ones from
``zoo.architectures.factory.zoo_classes``: ``Zoo<Family>Config`` / ``Zoo<Family>Model`` /
``Zoo<Family>ForCausalLM``. Its config is a fresh zoo config built from the same kwargs as the native tester's, plus
the ``zoo_layout`` that ``zoo.convert`` records for a native model of that config: the zoo model under test has
moe-zoo's own MoE blocks (``SparseMoE``), as every converted or zoo-loaded model does. ``MOE_ZOO_SUITE_LAYOUT=none``
runs the zoo classes with ``zoo_layout=None`` instead (the family's native MoE blocks inside the zoo classes).

The zoo has no classification / question-answering heads, so the zoo tester has none (tests of those heads are
skipped through ``skips.py``).

transformers' tests find a class's role (base model, causal LM, ...) by looking its *name* up in transformers' static
``MODEL_*_MAPPING_NAMES`` tables (e.g. ``_prepare_for_class`` adds ``labels`` only for names listed as causal LMs).
Classes registered at run time with ``AutoModel*.register`` -- as the zoo's are -- are never in those tables, so
``register_zoo_names`` adds the zoo names to the tables *as seen by the vendored test module only* (copies bound in
its namespace; transformers' own tables are untouched).
"""
from __future__ import annotations

import copy
import functools
import json
import os
from collections import OrderedDict

from .families import FAMILIES, native_tester, make_test_class


def family_object(family: str):
    from zoo.plugins import load_plugins, registry

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


def zoo_tester(family: str) -> type:
    native = native_tester(family)
    cfg_cls, base_cls, lm_cls = zoo_classes_of(family)

    def get_config(self):
        kwargs = self.config_kwargs()
        return cfg_cls(**kwargs, zoo_layout=zoo_layout_for(family, kwargs))

    return type(f"Zoo{native.__name__}", (native,), {
        "config_class": cfg_cls, "base_model_class": base_cls, "causal_lm_class": lm_cls,
        "sequence_classification_class": None, "token_classification_class": None,
        "question_answering_class": None, "get_config": get_config,
    })


_ROLE_TABLES = {"base_model_class": "MODEL_MAPPING_NAMES", "causal_lm_class": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"}


def register_zoo_names(family: str) -> None:
    from .upstream import test_modeling_common as tmc

    cfg_cls, base_cls, lm_cls = zoo_classes_of(family)
    for role, table in _ROLE_TABLES.items():
        names = OrderedDict(getattr(tmc, table))
        names[cfg_cls.model_type] = {"base_model_class": base_cls, "causal_lm_class": lm_cls}[role].__name__
        setattr(tmc, table, names)


def classes_for(family: str, module: str) -> dict:
    """``{name: TestCase}`` for ``family``: ``Test<Family>Native`` and ``Test<Family>Zoo``."""
    assert family in FAMILIES, family
    register_zoo_names(family)
    out = {}
    for variant, tester in (("native", native_tester(family)), ("zoo", zoo_tester(family))):
        cls = make_test_class(family, variant, tester, module)
        out[cls.__name__] = cls
    return out
