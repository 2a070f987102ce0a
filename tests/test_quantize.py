"""quantize: packed kernels against their dequantized references, honest bytes, the allocations, apply."""
import itertools

import numpy as np
import pytest
import torch
from tiny import tiny_native
from transformers import AutoModelForCausalLM
from zoo_compressors.allocation import alphaq, esd_alpha, pmq

import zoo
from zoo.moe.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.packing import pack, unpack
from zoo.moe.quantized import QuantizedExperts

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("bits", [[4, 4, 4, 4], [8, 8, 8, 8], [4, 8, 8, 4], [2, 3, 4, 8], [3, 3, 2, 2]])
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
    weights = dense.num_parameters()
    assert b8 == weights + 4 * 8 * (2 * 512 + 256)  # int8 codes plus one fp32 scale per output channel
    for bits in (2, 3, 4):  # codes plus a bf16 scale and zero per 64 weights
        low = QuantizedExperts.from_dense(dense, bits, group_size=64).nbytes()
        assert low == weights * bits // 8 + weights // 64 * 4
        assert low / fp32 == pytest.approx((bits + 0.5) / 32)
    assert QuantizedExperts.from_dense(dense, 4).num_parameters() == dense.num_parameters()


@pytest.mark.parametrize("widths,avg", [((4, 8), 6.0), ((2, 3, 4), 3.0), ((2, 3, 4, 8), 3.5)])
def test_pmq_is_the_exact_optimum_of_its_program(widths, avg):
    rng = np.random.default_rng(0)
    n = 7
    sig = rng.random(n)
    err = np.sort(rng.random((n, len(widths))), axis=1)[:, ::-1] * 2.0 ** (-2 * np.array(widths))
    sizes = rng.integers(1, 4, n).astype(float)
    got = pmq(sig, err, sizes, widths, avg)
    col = {w: j for j, w in enumerate(widths)}
    cost = lambda c: sum(sig[e] * err[e, col[b]] for e, b in enumerate(c))
    feasible = [c for c in itertools.product(widths, repeat=n) if (np.array(c) * sizes).sum() <= avg * sizes.sum() + 1e-9]
    assert (got * sizes).sum() <= avg * sizes.sum() + 1e-9
    assert cost(got) == pytest.approx(min(cost(c) for c in feasible))


@pytest.mark.parametrize("bits", [2, 3])
def test_dense_packing_roundtrips(bits):
    codes = torch.randint(0, 2 ** bits, (6, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits, 64), codes.int())


@pytest.mark.parametrize("n,k", [(64, 64), (160, 256), (16, 2), (48, 10), (128, 32)])
def test_int4_pack_is_one_layout_on_every_processor(n, k):
    """The stored int4 form is torch's AVX-512 layout whatever processor packs it (torch's own op packs blocks of
    32 rows on AVX2-only ones, which would then misread a model packed elsewhere): blocks of 64 rows, per k byte j
    = row j | row j + 32 << 4; rows past the last block two to a byte (2j | 2j + 1 << 4). int4unpack inverts it;
    torch's op agrees exactly where torch_packs_int4_alike says so, and kernel_linear's torch fallback then reads
    the stored pack right on this processor either way."""
    from zoo.moe import kernels
    from zoo.moe.in_place import kernel_linear
    from zoo.moe.packing import dequantize, int4pack, int4unpack, torch_packs_int4_alike

    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(n + k))
    packed = int4pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert torch.equal(int4unpack(packed, k), codes)
    flat, full = packed.view(-1), n // 64 * 64
    spots = [(0, 0), (31, k - 1), (32, 1), (63, k // 2), (full, 0), (n - 1, k - 1)]
    for r, kk in [(r, kk) for r, kk in spots if r < n]:
        if r < full:  # block r // 64, row r % 64 -> byte (r % 32) of k's 32, nibble r % 64 // 32
            byte = flat[(r // 64 * k + kk) * 32 + r % 32]
            assert int(byte >> 4 * (r % 64 // 32) & 15) == int(codes[r, kk])
        else:
            byte = flat[full * k // 2 + kk * ((n - full) // 2) + (r - full) // 2]
            assert int(byte >> 4 * ((r - full) % 2) & 15) == int(codes[r, kk])
    by_torch = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(by_torch, packed) or not torch_packs_int4_alike()
    if k % 32 == 0:
        g = 32
        scale = torch.stack([torch.rand(k // g, n) * 0.1 + 0.01, torch.randn(k // g, n) * 0.1], -1).to(torch.bfloat16)
        x = torch.randn(3, k)
        want = x @ dequantize(4, packed, scale, (n, k), g).t()
        for ready in (True, False):  # with the zoo's kernel, and with torch's only
            real = kernels.ready
            kernels.ready = lambda: ready  # noqa: E731
            try:
                torch.testing.assert_close(kernel_linear(x, packed, scale, 4, g), want, rtol=1e-4, atol=1e-4)
            finally:
                kernels.ready = real


@pytest.mark.parametrize("bits", [8, 4])
def test_prefill_widens_to_fp32_where_bf16_matmuls_are_not_native(bits, monkeypatch):
    """A bf16 prompt's dense matmul on a widened int8/int4 weight runs in bf16 where torch's bf16 matmuls are native
    and in fp32 where they are not (an AVX2-only processor: a transposed bf16 weight's matmul ran ~40x slower
    there), the output bf16 either way and within bf16 rounding of the fp32 product."""
    from zoo.moe import cpu_precision, in_place
    from zoo.moe.packing import dequantize
    from zoo.moe.quantized import quantize_grouped, quantize_int8

    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(bits)) * 0.1
    q, s = quantize_int8(w) if bits == 8 else quantize_grouped(w, 32, 4)[:2]
    x = torch.randn(in_place.PREFILL_ROWS, 128).bfloat16()
    want = x.float() @ dequantize(bits, q, s, (64, 128), 32).t()
    from zoo.moe import kernels

    monkeypatch.setattr(kernels, "lowbit_gemm_fits", lambda *a: False)  # the bf16-dot tiles would serve instead
    real, seen = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, b, *r: seen.append(b.dtype) or real(a, b, *r))
    for native in (True, False):
        monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
        seen.clear()
        got = in_place.kernel_linear(x, q, s, bits, 32)
        assert got.dtype == torch.bfloat16 and seen == [torch.bfloat16 if native else torch.float32]
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_esd_alpha_recovers_a_power_law_and_alphaq_prefers_heavy_tails():
    rng = np.random.default_rng(0)
    def with_spectrum(alpha, n=128):
        ev = (1 - rng.random(n)) ** (-1 / (alpha - 1))  # Pareto eigenvalues with exponent alpha
        u, _ = np.linalg.qr(rng.standard_normal((n, n)))
        v, _ = np.linalg.qr(rng.standard_normal((n, n)))
        return torch.tensor(u @ np.diag(np.sqrt(ev)) @ v.T)
    heavy, light = esd_alpha(with_spectrum(2.0)), esd_alpha(with_spectrum(5.0))
    assert 1.5 < heavy < 2.6 and 3.5 < light < 7 and heavy < light
    err = np.tile([0.1, 0.01], (4, 1))  # equal errors: only the spectra decide
    bits = alphaq(np.array([light, heavy, light, heavy]), err, np.ones(4), (4, 8), 6.0)
    assert bits.tolist() == [4, 8, 4, 8]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("bits,allocation,widths", [(8, "uniform", None), (4, "uniform", None), (3, "uniform", None),
                                                    (6, "pmq", (4, 8)), (6, "alphaq", (4, 8)), (3, "pmq", (2, 3, 4)),
                                                    (3, "random", (2, 3, 4))])
def test_apply_roundtrip_and_budget(family, bits, allocation, widths, tmp_path):
    model = zoo.convert(tiny_native(family))
    extra = {} if widths is None else {"widths": list(widths)}
    zoo.apply(model, "quantize", calibration=CAL, bits=bits, allocation=allocation, group_size=32, **extra)
    got = model.config.zoo_recipe[-1]["results"]["bits"]
    flat = [b for layer in got.values() for b in layer]
    assert set(flat) <= set(widths or [bits]) and np.mean(flat) <= bits + 1e-9
    if bits == 6:
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
    ({"bits": 1}, r"must be in \[2, 8\]"), ({"bits": 6}, "uniform allocation needs"),
    ({"bits": 3, "allocation": "pmq", "widths": [4, 8]}, r"must be in \[4, 8\]"), ({"widths": [5]}, "widths must be"),
    ({"allocation": "gptq"}, "allocation must be one of"), ({"group_size": 48}, "multiple of 32"),
    ({"bits": 4, "group_size": 64}, "does not divide"), ({"bitz": 4}, "did you mean 'bits'"),
    ({"targets": "attention"}, "targets must be one of"), ({"bits": 3, "targets": "all"}, "at one width"),
    ({"bits": 6, "allocation": "pmq", "widths": [4, 8], "targets": "all"}, "at one width"),
])
def test_bad_options_leave_the_model_untouched(options, message):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        zoo.apply(model, "quantize", **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("bits", [8, 4, 3])
def test_quantizing_changes_bytes_not_parameter_counts(bits):
    """Packed codes and scales are bytes: parameter counts (total and active) stay those of the weights."""
    from zoo.evaluation.eval import sizes

    model = zoo.convert(tiny_native("mixtral"))
    before = sizes(model)
    after = sizes(zoo.apply(model, "quantize", bits=bits, group_size=32))
    assert (after["params"], after["active_params"]) == (before["params"], before["active_params"])
    assert after["bytes"] < before["bytes"]


def hidden96(seed: int = 0):
    """A tiny Mixtral with a hidden size of 96 (64 does not divide it) and an intermediate size of 160."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=128)
    return zoo.convert(MixtralForCausalLM(config).eval())


def test_int8_has_no_groups_so_any_hidden_size_works(tmp_path):
    """int8 is per output channel: a hidden size of 96 used to fail with 'group_size=64 does not divide 96'."""
    model = hidden96()
    ids = CAL[0][:2]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    zoo.apply(model, "quantize", bits=8)
    assert all(isinstance(m.experts, QuantizedExperts) and m.experts.bits == [8] * 4 for _, m in moe_layers(model))
    assert "group_size" not in model.config.zoo_recipe[-1]["results"]  # no groups at 8 bits
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert (logits - ref).abs().max() < 0.05 * ref.abs().max()  # int8 stays close to the float model
    model.save_pretrained(tmp_path / "q")
    with torch.no_grad():
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()(input_ids=ids).logits
    assert torch.equal(again, logits)


@pytest.mark.parametrize("bits,allocation", [(4, "uniform"), (3, "uniform"), (6, "alphaq")])
def test_low_bits_pick_a_group_size_that_divides_and_say_so(bits, allocation):
    model = hidden96()
    extra = {"widths": [4, 8]} if allocation != "uniform" else {}
    zoo.apply(model, "quantize", bits=bits, allocation=allocation, **extra)
    res = model.config.zoo_recipe[-1]["results"]
    low = [i for i, b in res["bits"].items() if min(b) < 8]
    assert low and all(res["group_size"][i] == 32 for i in low)  # 96 = 3 x 32; 64 and 128 do not divide it
    assert all("group size 32" in res["group_size_note"][i] for i in low)
    for _, m in moe_layers(model):
        if min(m.experts.bits) < 8:
            assert m.experts.group_size == 32


def test_the_automatic_group_size_prefers_64_then_128_then_32():
    model = zoo.convert(tiny_native("qwen3_moe"))  # hidden 64, experts of 32: 64 does not divide 32 -> 32
    zoo.apply(model, "quantize", bits=4)
    assert set(model.config.zoo_recipe[-1]["results"]["group_size"].values()) == {32}
    from zoo_compressors.quantize import auto_group_size

    assert auto_group_size((128, 256)) == 64 and auto_group_size((96, 160)) == 32 and auto_group_size((80,)) is None


def test_an_explicit_group_size_that_does_not_divide_is_refused_below_8_bits_only():
    model = hidden96()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="group_size=64 does not divide layer 0's size 96"):
        zoo.apply(model, "quantize", bits=4, group_size=64)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    zoo.apply(model, "quantize", bits=8, group_size=64)  # int8 ignores groups
    assert all(m.experts.bits == [8] * 4 for _, m in moe_layers(model))


def test_int8_experts_on_a_hidden_size_of_96_match_their_reference():
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 96, 160)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    q = QuantizedExperts.from_dense(dense, 8, group_size=64)  # group_size is irrelevant at 8 bits
    x = torch.randn(10, 96, requires_grad=True)
    routing = Routing(torch.rand(10, 2), torch.randint(0, 4, (10, 2)))
    out = q(x, routing)
    ref_dense = SwiGLUExperts(4, 96, 160)
    with torch.no_grad():
        for e in range(4):
            ref_dense.gate_up_proj[e], ref_dense.down_proj[e] = q.dequantized(e)
    xr = x.detach().clone().requires_grad_(True)
    ref = ref_dense(xr, routing)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="dividing hidden_size=96"):
        QuantizedExperts.from_dense(dense, 4, group_size=64)


def test_check_component_quantize_8_bits_end_to_end():
    from zoo.testing import check_component

    report = check_component("quantize", bits=8, families=["mixtral"])
    assert report["families"] == ["mixtral"]
