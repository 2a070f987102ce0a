"""The device the layer-at-a-time engine computes on (``--device``): each decoder layer is moved there when it is
read, calibrated and compressed there with the hidden states carried there, and moved back to the CPU before it
is written or kept, so host memory still holds one layer and the accelerator one layer plus the hidden states
(the way REAP's harness and llm-compressor's sequential onloading work).

``None`` (the default) is today's CPU path, untouched. ``resolve`` checks a device name before anything is read.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_CURRENT: ContextVar[torch.device | None] = ContextVar("zoo_device", default=None)


def available() -> list[str]:
    """The device types this process can compute on (``cpu`` first)."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda (cuda:0..cuda:{torch.cuda.device_count() - 1})"]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        out.append("xpu")
    return out


def _count(kind: str) -> int:
    """How many devices of ``kind`` this process sees (0: its backend is not available)."""
    if kind == "cpu":
        return 1
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return 1 if mps is not None and mps.is_available() else 0
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return xpu.device_count() if xpu is not None and xpu.is_available() else 0
    return 0  # meta holds no numbers; other backends are not known to the zoo


def resolve(device) -> torch.device | None:
    """``device`` (a name such as ``cuda``, ``cuda:1``, ``cpu``, or a ``torch.device``) checked, or None for None.
    A name torch cannot parse, or a device this process has not got, is a one-line ``ValueError`` naming those it
    has (raised before any file is read or written)."""
    if device is None:
        return None
    try:
        dev = device if isinstance(device, torch.device) else torch.device(str(device))
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{device!r} is not a device name (use e.g. cpu, cuda, cuda:1, mps); available here: "
                         f"{', '.join(available())}") from None
    count = _count(dev.type)
    if count == 0:
        raise ValueError(f"device {str(device)!r} is not available in this process (its backend is not built or "
                         f"has no device); available here: {', '.join(available())}")
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {str(device)!r} does not exist: this process sees {count} {dev.type} device"
                         f"{'s' * (count > 1)}")
    return dev


def current() -> torch.device | None:
    """The device ``using`` set (None: the CPU path as it always was)."""
    return _CURRENT.get()


@contextmanager
def using(device):
    """``with using("cuda"): zoo.apply(...)``: in-memory layer-wise compressors run each layer on ``device``
    (the model itself stays where it is). ``device`` is checked first."""
    token = _CURRENT.set(resolve(device))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def moves(device) -> bool:
    """Whether the engine moves layers at all (a device was named: the CPU too, which is then a no-op copy)."""
    return device is not None


def to(obj, device):
    """``obj`` with every tensor in it (nested in tuples, lists, dicts) on ``device``; other values as they are."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(to(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # a RoutingContext
        return dataclasses.replace(obj, **{f.name: to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)
                                           if f.init and isinstance(getattr(obj, f.name), torch.Tensor)})
    return obj
