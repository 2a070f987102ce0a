"""zoo.testing: check a component end to end, the way a user meets it.

``check_component(name, **options)`` runs a registered component (router, compressor, adapter, experts kind or
architecture) on small seeded fp32 models of several families and checks, raising ``AssertionError`` with a
one-paragraph message at the first failure:

1. bad options (a misspelt name; a wrongly typed value where an option is annotated ``int``, ``float``, ``bool`` or
   ``str``) raise, and leave the model bit-identical (every tensor, its class and its config);
2. ``zoo.apply(model, name, **options)`` works and the recipe step records the name and the options as given;
3. ``save_pretrained``, then a load in a fresh Python process (``import zoo`` and the model's Auto class) gives the
   same logits on fixed inputs, and the same output of every module on the way (the first one that differs names
   the culprit), the same layout and the same recipe;
4. ``zoo.card(model)`` (and the saved README.md) holds the section the component's card template renders;
5. every router or experts module the step put in the model that declares a ``reference`` (a plain, obviously
   correct version of ``forward`` with the same signature) matches it, outputs and gradients, on random inputs.

A family that refuses the component (``TypeError`` or ``ValueError`` before anything changed, e.g. a dense-only
adapter on an MoE model) is skipped with its reason; a component that fits none of the families fails.

What each kind means here:
- routers, compressors, adapters: applied by name with ``options``, as above. Compressors that need calibration get
  a small batch of random token ids (``calibration=`` gives other data; ``None`` lets the component draw its own).
  After the step, the tensors it added that hold one constant (a LoRA's zero B, a zero router) get seeded noise,
  as training would, so that a load that drops or re-initialises them shows;
- experts kinds (made by compressors, never applied by name): in every MoE block of each family the experts are
  replaced by the kind, built with ``cls.from_dense(old_experts, **options)`` where the class has that
  classmethod (real compressed weights), else ``cls(**options)`` with the sizes the old experts' ``options()`` give
  filled in and every floating-point tensor drawn at random (seeded); then checks 1 (the constructor must refuse a
  misspelt option; types are ``zoo.apply``'s to check, and experts kinds are not applied), 3 and 5. A card lists
  the recipe's components and the routers, not experts kinds, so 4 only renders the card;
- architectures: a tiny native model of the family (built in for the families in ``TINY``; pass ``model=`` for
  others) is converted losslessly with ``zoo.convert``, then checks 3, 4 and 5.

A name that two kinds use (``channel-topk``: a compressor and the experts it makes) means the applicable kind;
write ``experts:channel-topk`` for the other. ``model=`` checks on that model only (a copy: yours is left as it
is); ``families=`` picks built-in families (``TINY``). ``plugins=`` names modules holding ``@zoo.hookimpl
register_*`` functions that are not installed through an entry point (a plugin under development, components
defined for a test): they are registered for the check, here and in the fresh process, which gets their folder on
its ``PYTHONPATH``. ``check_components`` checks several components with one fresh process (``import zoo`` costs
seconds); an option named ``model``, ``families``, ``plugins`` or ``calibration`` goes through it too.

    from zoo.testing import check_component
    check_component("my-router", plugins=["my_plugin"], temperature=0.5)     # a plugin not installed yet
"""
from zoo.testing.checks import AUTO, FAMILIES, bad_options, build_experts, check_component, check_components
from zoo.testing.fresh_process import reload_job
from zoo.testing.plugins import register_plugin, unregister
from zoo.testing.reference import check_reference
from zoo.testing.tiny import TINY, calibration_for, sample_inputs, tiny_model

__all__ = ["AUTO", "FAMILIES", "TINY", "bad_options", "build_experts", "calibration_for", "check_component",
           "check_components", "check_reference", "register_plugin", "reload_job", "sample_inputs", "tiny_model",
           "unregister"]
