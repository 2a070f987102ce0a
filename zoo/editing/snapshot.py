"""Put a model back as it was after a failed step: every module's class and slots (children, tensors, hooks,
attributes) and the config, by reference, so taking a snapshot costs no copy of any weight.

Steps replace modules and change classes (conversion, router swaps, adapters, compressors that swap in new
blocks once every layer is built); none writes into an existing tensor before it succeeds, so references
are enough to make a failure leave the model bit-identical and of the same class."""
from __future__ import annotations

import copy

_SLOTS = ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks",
          "_non_persistent_buffers_set")


class Snapshot:
    def __init__(self, model):
        self.modules = []
        for module in model.modules():
            state = dict(module.__dict__)
            for slot in _SLOTS:
                if slot in state:
                    state[slot] = copy.copy(state[slot])
            self.modules.append((module, module.__class__, state))
        config = model.config
        self.config = (config, config.__class__, copy.deepcopy(config.__dict__))

    def restore(self) -> None:
        for module, cls, state in self.modules:
            module.__class__ = cls
            module.__dict__.clear()
            module.__dict__.update(state)
        config, cls, state = self.config
        config.__class__ = cls
        config.__dict__.clear()
        config.__dict__.update(state)


class Fingerprint:
    """A model's structure and tensors, by reference; ``same_as(model)`` is True when nothing changed (the same
    layout and every tensor the same object at the same version, or equal in value)."""

    def __init__(self, model):
        self.layout = _layout(model)
        self.tensors = {k: (t, t._version) for k, t in model.state_dict(keep_vars=True).items()}

    def same_as(self, model) -> bool:
        import torch

        if _layout(model) != self.layout:
            return False
        now = model.state_dict(keep_vars=True)
        if now.keys() != self.tensors.keys():
            return False
        for key, (old, version) in self.tensors.items():
            new = now[key]
            if new is old and new._version == version:
                continue
            if new is old or new.shape != old.shape or new.dtype != old.dtype or not torch.equal(new, old):
                return False
        return True


def _layout(model) -> str:
    from zoo.moe.layout import read_attention, read_layout, read_modules

    return repr((read_layout(model), read_modules(model), read_attention(model)))
