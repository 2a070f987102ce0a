"""What a check compares: a model's logits and every module's output on the way, and their largest difference."""
from __future__ import annotations


import torch


def unwrapped(model):
    """The zoo model inside a PEFT model (or the model itself)."""
    return model.get_base_model() if is_peft(model) else model


def logits_of(model, inputs) -> torch.Tensor:
    return module_outputs(model, inputs)["logits"]


def module_outputs(model, inputs) -> dict[str, torch.Tensor]:
    """The logits and every module's output (``name#call``, in the order they finish; the first tensor of a tuple
    such as a Routing) on ``inputs``, in eval mode."""
    outputs, calls = {}, {}

    def record(name, out):
        if isinstance(out, (tuple, list)):
            out = next((o for o in out if torch.is_tensor(o)), None)
        if torch.is_tensor(out) and out.is_floating_point():
            calls[name] = calls.get(name, -1) + 1
            outputs[f"{name}#{calls[name]}"] = out.detach().float().clone()

    hooks = [m.register_forward_hook(lambda _, __, out, name=name: record(name, out))
             for name, m in model.named_modules() if name]
    model.eval()
    try:
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits.float()
    finally:
        for h in hooks:
            h.remove()
    return {**outputs, "logits": logits}


def max_diff(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).detach().abs().nan_to_num(float("inf")).max()) if a.numel() else 0.0


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")
