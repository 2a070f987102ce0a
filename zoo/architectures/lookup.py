"""Which registered family a model belongs to, and the two ways a model can fall outside the families: a native
model the zoo cannot hold (``NotConvertible``) and a layout with no native form (``NotExportable``)."""
from __future__ import annotations


class NotExportable(ValueError):
    """The layout cannot be written in the family's native format."""


class NotConvertible(TypeError):
    """A native model (or block) the zoo cannot hold without changing what it computes; the message says why."""


def family_of(model):
    """The registered Family whose native (or zoo) classes this model uses."""
    from zoo.components.registry import registry

    zoo_family = getattr(type(model), "zoo_family", None)
    if zoo_family is not None:
        return zoo_family
    families = [r.obj for r in registry.all("architecture")]
    matching = [fam for fam in families if fam.matches(model)]
    if matching:  # the most specific: a plugin family built on a subclass of Mixtral's model wins over Mixtral
        mro = type(model).__mro__
        return min(matching, key=lambda fam: mro.index(fam.model_class) if fam.model_class in mro else len(mro))
    from zoo.architectures.families import EXCEPTIONS

    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise TypeError(f"{type(model).__name__} carries a PEFT adapter: fold it in first "
                        "(model = model.merge_and_unload(), or moe-zoo merge ADAPTER OUT)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in EXCEPTIONS:
        raise NotConvertible(f"{type(model).__name__} ({model_type}) is not converted: {EXCEPTIONS[model_type]}")
    known = ", ".join(f.name for f in families)
    raise TypeError(f"{type(model).__name__} is not a supported MoE family (supported: {known})")
