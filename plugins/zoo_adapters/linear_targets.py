"""Shared by the adapters that wrap a zoo model's plain linear layers (mixture-of-loras, replora): which layers a
``target`` option names, and swapping them for adapter modules once every one has been built."""
from __future__ import annotations

from torch import nn

ATTENTION = "q_proj,k_proj,v_proj,o_proj"


def parse_target(target) -> tuple[str, ...]:
    """A comma list of linear layer names (e.g. ``q_proj,v_proj``) -> tuple; a ValueError when malformed."""
    names = tuple(t.strip() for t in target.split(",") if t.strip()) if isinstance(target, str) else ()
    if not names or len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
        raise ValueError(f"target must be a comma list of linear layer names such as {ATTENTION!r}, got {target!r}")
    return names


def find_linears(model, names: tuple[str, ...], who: str) -> list[tuple[str, nn.Linear]]:
    """``(path, module)`` of every plain ``nn.Linear`` called one of ``names`` inside the decoder layers.

    Raises (before anything changes) when a name matches nothing, or matches a layer another adapter already wraps.
    """
    from zoo.moe.cpu_precision import is_plain_linear
    from zoo.moe.layout import moe_layers

    if not moe_layers(model):
        raise TypeError(f"{who} needs a zoo model (an MoE model the zoo loads or converts, e.g. zoo-tiny-moe)")
    found = []
    for path, module in model.named_modules():
        if ".layers." not in f".{path}" or path.rpartition(".")[2] not in names:
            continue
        if hasattr(module, "zoo_spec"):
            raise ValueError(f"{path} already carries a {module.zoo_spec()['adapter']} adapter")
        if is_plain_linear(module):
            found.append((path, module))
    missing = [n for n in names if not any(p.rpartition(".")[2] == n for p, _ in found)]
    if missing:
        raise ValueError(f"{who}: no linear layer named {', '.join(missing)} in the decoder layers")
    return found


def swap(model, built: list[tuple[str, nn.Module]]) -> None:
    """Put each built module at its path; the base model is frozen, the new modules' own parameters train."""
    for p in model.parameters():
        p.requires_grad_(False)
    for path, module in built:
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, module)
        module.requires_grad_(True)
        module.weight.requires_grad_(False)
        if module.bias is not None:
            module.bias.requires_grad_(False)
