"""What a load puts in the tensors a checkpoint lacks.

transformers builds a model on the meta device, loads the checkpoint's tensors, gives every other tensor
uninitialised memory and then calls the model's ``_init_weights`` on each module. A zoo module initialises
its tensors there through ``init_weights(std)``, written with ``transformers.initialization`` (which skips
the tensors the checkpoint filled), as native transformers initialises its own modules. A tensor that no
initialisation makes meaningful (packed quantized weights, low-rank factors) is refused with its name.
A module of a plugin that has no ``init_weights`` is refused the same way when one of its tensors is missing.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

_loading: ContextVar[bool] = ContextVar("zoo_loading", default=False)


class MissingWeightsError(ValueError):
    """A checkpoint lacks tensors that cannot be initialised meaningfully."""


@contextmanager
def loading():
    """Marks a ``from_pretrained`` load: only then is a missing tensor an error."""
    token = _loading.set(True)
    try:
        yield
    finally:
        _loading.reset(token)


def missing(module: nn.Module) -> list[str]:
    """The module's own persistent tensors that the load did not fill."""
    skip = module._non_persistent_buffers_set
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [name for name, t in tensors
            if t is not None and name not in skip and not getattr(t, "_is_hf_initialized", False)]


def refuse_missing(module: nn.Module, names=None) -> None:
    """Raise ``MissingWeightsError`` (during a load) if any of ``names`` (default: all) was not loaded."""
    if not _loading.get():
        return
    absent = [n for n in missing(module) if names is None or n in names]
    if absent:
        raise MissingWeightsError(f"the checkpoint lacks {type(module).__name__} tensors {absent}: they cannot be "
                                  "initialised meaningfully (the checkpoint is incomplete or its config changed)")


def initialize_missing_keys(model, native, is_quantized: bool) -> None:
    """A zoo model's ``_initialize_missing_keys``: transformers' own (``native``), with zoo modules free to
    refuse; then every floating-point weight is checked to be finite (``MOE_ZOO_CHECK_FINITE=0`` skips it)."""
    from zoo.io import finite

    with loading():
        native(model, is_quantized)
    if finite.enabled():
        finite.check_finite(model)


def init_zoo_module(module: nn.Module, std: float) -> None:
    """The zoo's part of ``_init_weights``: a module's own ``init_weights``, or a refusal for a plugin module
    that has none and lacks tensors (torch's and transformers' modules are the family's to initialise)."""
    hook = getattr(module, "init_weights", None)
    if callable(hook) and not hasattr(module, "config"):  # a PreTrainedModel's init_weights is transformers'
        with torch.no_grad():
            hook(std)
    elif not type(module).__module__.startswith(("torch.", "transformers.")):
        refuse_missing(module)
