"""quantize: packed kernels against their dequantized references, honest bytes, the allocations, apply."""
import itertools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import zoo
from zoo.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.quantized import QuantizedExperts
from zoo_compressors.allocation import alphaq, esd_alpha, pmq
from tiny import tiny_native

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("bits", [[4, 4, 4, 4], [8, 8, 8, 8], [4, 8, 8, 4]])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("clamped-swiglu", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_dequantized_reference(bits, activation, bias, dtype):
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 96, activation=activation, bias=bias)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    q = QuantizedExperts.from_dense(dense, bits, group_size=32).to(dtype)
    x = torch.randn(12, 64, dtype=dtype, requires_grad=True)
    indices = torch.randint(0, 4, (12, 2))
    weights = torch.rand(12, 2, dtype=dtype)
    out = q(x, Routing(weights, indices))
    out.float().pow(2).sum().backward()
    ref_dense = SwiGLUExperts(4, 64, 96, activation=activation, bias=bias)  # holds the dequantized weights
    with torch.no_grad():
        for e in range(4):
            gu, dn = q.dequantized(e)
            ref_dense.gate_up_proj[e] = gu
            ref_dense.down_proj[e] = dn
        if bias:
            ref_dense.gate_up_proj_bias.copy_(q.gate_up_proj_bias.float())
            ref_dense.down_proj_bias.copy_(q.down_proj_bias.float())
    xr = x.detach().float().requires_grad_(True)
    ref = ref_dense(xr, Routing(weights.float(), indices))
    ref.pow(2).sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * ref.abs().max().item())
    torch.testing.assert_close(out.float(), ref.detach(), **tol)
    gtol = tol if dtype == torch.float32 else dict(rtol=5e-2, atol=5e-2 * xr.grad.abs().max().item())
    torch.testing.assert_close(x.grad.float(), xr.grad, **gtol)


def test_bytes_are_real():
    dense = SwiGLUExperts(8, 256, 512)
    fp32 = dense.nbytes()
    b8 = QuantizedExperts.from_dense(dense, 8).nbytes()
    b4 = QuantizedExperts.from_dense(dense, 4, group_size=64).nbytes()
    weights = dense.num_parameters()
    assert b8 == weights + 4 * 8 * (2 * 512 + 256)  # int8 codes plus one fp32 scale per output channel
    assert b4 == weights // 2 + weights // 64 * 4  # 4-bit codes plus a bf16 scale and zero per 64 weights
    assert b4 / fp32 == pytest.approx((4 + 0.5) / 32)
    assert QuantizedExperts.from_dense(dense, 4).num_parameters() == dense.num_parameters()


def test_pmq_is_the_exact_optimum_of_its_program():
    rng = np.random.default_rng(0)
    n = 9
    sig, e4, e8 = rng.random(n), rng.random(n) * 0.1, rng.random(n) * 0.01
    sizes = rng.integers(1, 4, n).astype(float)
    got = pmq(sig, e4, e8, sizes, 6.0)
    best = None
    for choice in itertools.product([4, 8], repeat=n):
        c = np.array(choice)
        if (c * sizes).sum() <= 6.0 * sizes.sum() + 1e-9:
            cost = (sig * np.where(c == 8, e8, e4)).sum()
            best = cost if best is None or cost < best else best
    assert (got * sizes).sum() <= 6.0 * sizes.sum() + 1e-9
    assert (sig * np.where(got == 8, e8, e4)).sum() == pytest.approx(best)


def test_esd_alpha_recovers_a_power_law_and_alphaq_prefers_heavy_tails():
    rng = np.random.default_rng(0)
    def with_spectrum(alpha, n=128):
        ev = (1 - rng.random(n)) ** (-1 / (alpha - 1))  # Pareto eigenvalues with exponent alpha
        u, _ = np.linalg.qr(rng.standard_normal((n, n)))
        v, _ = np.linalg.qr(rng.standard_normal((n, n)))
        return torch.tensor(u @ np.diag(np.sqrt(ev)) @ v.T)
    heavy, light = esd_alpha(with_spectrum(2.0)), esd_alpha(with_spectrum(5.0))
    assert 1.5 < heavy < 2.6 and 3.5 < light < 7 and heavy < light
    bits = alphaq(np.array([light, heavy, light, heavy]), np.ones(4), 6.0)
    assert bits.tolist() == [4, 8, 4, 8]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("bits,allocation", [(8, "uniform"), (4, "uniform"), (6, "pmq"), (6, "alphaq")])
def test_apply_roundtrip_and_budget(family, bits, allocation, tmp_path):
    model = zoo.convert(tiny_native(family))
    zoo.apply(model, "quantize", calibration=CAL, bits=bits, allocation=allocation, group_size=32)
    widths = model.config.zoo_recipe[-1]["results"]["bits"]
    flat = [b for layer in widths.values() for b in layer]
    assert set(flat) <= {4, 8} and np.mean(flat) <= bits + 1e-9
    if allocation != "uniform":
        assert set(flat) == {4, 8}  # a 6-bit average mixes both widths
    assert all(isinstance(m.experts, QuantizedExperts) for _, m in moe_layers(model))
    ids = CAL[0][:2]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "q")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, logits) or (loaded(input_ids=ids).logits - logits).abs().max() < 1e-6
    with pytest.raises(ValueError, match="quantized"):
        zoo.export(model, tmp_path / "native")


def test_prune_then_quantize_compose(tmp_path):
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "prune-reap", calibration=CAL, num_experts=6)
    zoo.apply(model, "quantize", bits=8, group_size=32)
    assert [s["name"] for s in model.config.zoo_recipe] == ["prune-reap", "quantize"]
    model.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert [(m.num_experts, type(m.experts).__name__) for _, m in moe_layers(loaded)] == [(6, "QuantizedExperts")] * 2


@pytest.mark.parametrize("options,message", [
    ({"bits": 3}, r"must be in \[4, 8\]"), ({"bits": 6}, "uniform allocation needs"),
    ({"allocation": "gptq"}, "allocation must be one of"), ({"group_size": 48}, "multiple of 32"),
    ({"group_size": 64}, "does not divide"), ({"bitz": 4}, "did you mean 'bits'"),
])
def test_bad_options_leave_the_model_untouched(options, message):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        zoo.apply(model, "quantize", **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
