"""bf16 products on a CPU without native ones (AVX2-only): a zoo model's LM head widens to fp32 when it is a plain
linear layer nothing wraps, and is called as it is otherwise (zoo.moe.cpu_precision)."""
import pytest
import torch

import zoo
from zoo.moe import cpu_precision
from zoo.testing import tiny_model


@pytest.fixture
def products(monkeypatch):
    """The dtypes of every F.linear's operands, in call order."""
    real, seen = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda a, b, *r: seen.append((a.dtype, b.dtype)) or real(a, b, *r))
    return seen


@pytest.mark.parametrize("native", [True, False])
def test_the_lm_head_multiplies_in_fp32_where_bf16_is_not_native(monkeypatch, products, native):
    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
    model = zoo.convert(tiny_model("mixtral")).to(torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    head = torch.bfloat16 if native else torch.float32
    assert logits.dtype == torch.bfloat16 and products[-1] == (head, head)
    hidden = {}
    model.model.norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    with torch.no_grad():
        again = model(input_ids=ids).logits
    want = (hidden["h"].float() @ model.lm_head.weight.float().t()).to(torch.bfloat16)
    assert torch.equal(again, logits) and torch.allclose(again.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("wrap", ["hook", "own forward"])
def test_a_wrapped_lm_head_is_called_as_it_is(monkeypatch, products, wrap):
    """Hooks and a forward set on the instance (accelerate's offloading, tensor parallelism) still run."""
    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: False)
    model = zoo.convert(tiny_model("mixtral")).to(torch.bfloat16).eval()
    head, calls = model.lm_head, []
    if wrap == "hook":
        head.register_forward_hook(lambda m, i, o: calls.append(o.dtype))
    else:
        plain = head.forward
        head.forward = lambda x: calls.append(x.dtype) or plain(x)
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, model.config.vocab_size, (1, 5))).logits
    assert calls == [torch.bfloat16] and logits.dtype == torch.bfloat16
    assert products[-1] == (torch.bfloat16, torch.bfloat16)
