"""quantize's formats: FineQuant's adaptive group sizes and BitMoD's per-group data types, against naive references."""
import pytest
import torch
from tiny import folder_tensors, tiny_native
from transformers import AutoModelForCausalLM
from zoo_compressors.finequant import adaptive_group, candidates, grouped_error

import zoo
from zoo.moe.layout import moe_layers
from zoo.moe import Routing
from zoo.moe.bitmod import (dequantize_bitmod, pack_codes, pack_types, quantize_bitmod, table, unpack_codes,
                            unpack_types)
from zoo.moe.experts import SwiGLUExperts
from zoo.moe.quantized import QuantizedExperts
from zoo.moe.quantized_lookup import LookupQuantizedExperts

CAL = [torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))]
FORMATS = [{"bits": 4, "group_size": "adaptive"},
           {"bits": 6, "allocation": "alphaq", "widths": [4, 8], "group_size": "adaptive", "group_alpha": 0.1},
           {"bits": 4, "dtype": "bitmod", "group_size": 32}, {"bits": 3, "dtype": "bitmod"},
           {"bits": 4, "dtype": "fp", "group_size": 32}]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread (see conftest)."""


def e2m1_magnitudes() -> set[float]:
    """FP4 E2M1 from its definition: exponent bias 1, a subnormal when the exponent field is 0."""
    return {(m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)) for e in range(4) for m in range(2)}


def test_bitmod_tables_are_the_papers_types():
    """BitMoD (arXiv:2411.11745): FP4 (E2M1: 0, 0.5, ..., 6) with the second zero's code given to the extra-resolution
    value +-5 (inside the gap between 4 and 6) or the extra-asymmetry value +-8 (past 6); FP3 likewise with +-3 / +-6.
    The zoo's FP4 table is E2M1 times 2 (integers), so it is compared halved."""
    fp4 = e2m1_magnitudes()
    assert sorted(fp4) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    for row, special in zip(table(4) / 2, (5, -5, 8, -8)):
        assert sorted(set(row.tolist())) == sorted({v for m in fp4 for v in (m, -m)} | {special}) and len(row) == 16
        assert row.tolist().count(0.0) == 1  # -0's code is the special value's
    for row, special in zip(table(3), (3, -3, 6, -6)):
        assert sorted(row.tolist()) == sorted({0, 1, -1, 2, -2, 4, -4, special}) and len(row) == 8


@pytest.mark.parametrize("bits", [3, 4])
def test_bitmod_picks_per_group_the_type_with_least_error(bits):
    torch.manual_seed(0)
    w = torch.randn(16, 128) * torch.rand(16, 128).pow(4).mul(4).add(0.2)  # uneven groups, some skewed
    codes, scale, types = quantize_bitmod(w, 32, bits)
    deq = dequantize_bitmod(codes, scale, types, bits, 32)
    tab = table(bits)
    g = w.view(16, 4, 32)
    errs = []
    for t in range(len(tab)):  # naive: every weight to its nearest value of type t, with the bf16 scale stored
        s = (g.abs().amax(-1) / tab[t].abs().max()).to(torch.bfloat16).float()
        near = tab[t][(g[..., None] / s[..., None, None] - tab[t]).abs().argmin(-1)]
        errs.append((near * s[..., None] - g).pow(2).sum(-1))
    errs = torch.stack(errs, -1)
    assert torch.equal(types.long(), errs.argmin(-1))  # ties go to the first type, as argmin's
    assert len(set(types.flatten().tolist())) > 1  # the mixture is used
    torch.testing.assert_close((deq.view(16, 4, 32) - g).pow(2).sum(-1), errs.min(-1).values, rtol=1e-5, atol=1e-7)
    assert torch.equal(unpack_codes(pack_codes(codes, bits), bits, 128), codes)
    for g in (1, 3, 4, 7):
        ids = torch.randint(0, 4, (5, g), dtype=torch.uint8)
        assert pack_types(ids).shape[-1] == -(-g // 4) and torch.equal(unpack_types(pack_types(ids), g), ids)


@pytest.mark.parametrize("dtype,bits", [("bitmod", 4), ("bitmod", 3), ("fp", 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_lookup_experts_match_their_dequantized_reference(dtype, bits, bias):
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 96, activation="clamped-swiglu" if bias else "silu", bias=bias)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    q = LookupQuantizedExperts.from_dense(dense, bits, 32, dtype)
    ref_dense = SwiGLUExperts(4, 64, 96, activation=dense.activation, bias=bias)
    with torch.no_grad():
        for e in range(4):
            ref_dense.gate_up_proj[e], ref_dense.down_proj[e] = q.dequantized(e)
        if bias:
            ref_dense.gate_up_proj_bias.copy_(q.gate_up_proj_bias)
            ref_dense.down_proj_bias.copy_(q.down_proj_bias)
    x = torch.randn(10, 64, requires_grad=True)
    routing = Routing(weights=torch.rand(10, 2), indices=torch.randint(0, 4, (10, 2)))
    out = q(x, routing)
    out.pow(2).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    ref = ref_dense(xr, routing)
    ref.pow(2).sum().backward()
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q._forward_gather(x.detach(), routing), ref.detach(), rtol=1e-5, atol=1e-6)
    # honest bytes: codes + a bf16 scale per group (+ the mixture's 2-bit type ids, each row's padded to a byte)
    groups = 4 * 3 * 64 * 96 // 32
    ids = 4 * (2 * 96 * -(-64 // 32 // 4) + 64 * -(-96 // 32 // 4)) if dtype == "bitmod" else 0
    assert q.nbytes() == 4 * 3 * 64 * 96 * bits // 8 + groups * 2 + ids + bias * 4 * (2 * 96 + 64) * 4


def naive_error(w, group, bits=4):
    """Relative error of min/max integer codes per group, dequantized from the stored bf16 scale and zero."""
    err = 0.0
    for row in w:
        for part in row.split(group):
            lo, hi = part.min(), part.max()
            scale = (hi - lo) / (2 ** bits - 1)
            q = ((part - lo) / scale).round().clamp(0, 2 ** bits - 1)
            s, z = scale.bfloat16().float(), (lo + 8 * scale).bfloat16().float()
            err += float(((q - 8) * s + z - part).pow(2).sum())
    return err / float(w.pow(2).sum())


def test_adaptive_group_is_the_coarsest_within_the_error_bound():
    torch.manual_seed(0)
    smooth = torch.randn(16, 256)  # N: a multiple of 16, as torch's int4 pack needs
    spiky = torch.randn(16, 256)
    spiky[:, 5] *= 30  # an outlier column: it widens every coarse group that holds it
    for w in (smooth, spiky):
        naive = {c: naive_error(w, c) for c in candidates(256)}
        for alpha in (0.0, 0.5, 1.5, 10.0):
            g, errors = adaptive_group([(w, 4)], 256, alpha)
            for c in errors:
                assert errors[c] == pytest.approx(naive[c], rel=1e-4)
            assert g == next(c for c in (256, 128, 64, 32) if naive[c] <= (1 + alpha) * naive[32])
    assert adaptive_group([(smooth, 4)], 256, 1.5)[0] == 256 and adaptive_group([(spiky, 4)], 256, 1.5)[0] == 64
    assert adaptive_group([(smooth, 4)], 256, 0.0)[0] == 32 and adaptive_group([(spiky, 4)], 256, 10.0)[0] == 256


def test_per_projection_groups_run_on_the_int4_kernels_and_match_the_reference():
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 64, 128)
    q = QuantizedExperts.from_dense(dense, [4, 3, 8, 4], 32, group_sizes={"gate_up": 64, "down": 128})
    assert q.gate_up_int4_scale_zero.shape[1] == 1 and q.down_int4_scale_zero.shape[1] == 1  # K/g
    x = torch.randn(20, 64)
    routing = Routing(weights=torch.rand(20, 2), indices=torch.randint(0, 4, (20, 2)))
    ref = SwiGLUExperts(4, 64, 128)
    with torch.no_grad():
        for e in range(4):
            ref.gate_up_proj[e], ref.down_proj[e] = q.dequantized(e)
        torch.testing.assert_close(q(x, routing), ref(x, routing), rtol=1e-4, atol=1e-5)
        from zoo.moe.in_place import lowbit_experts

        one = Routing(routing.weights[:2], routing.indices[:2])
        torch.testing.assert_close(lowbit_experts(*q.in_place_args(x[:2], one)), ref(x[:2], one), rtol=1e-4, atol=1e-5)
        from zoo.moe import kernels

        if kernels.load():  # zoo::moe_gemv with each projection's own group size
            torch.testing.assert_close(q._forward_in_place(x[:2], one), ref(x[:2], one), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", FORMATS)
def test_apply_forward_and_reload(options, tmp_path):
    model = zoo.convert(tiny_native("qwen3_moe"))
    zoo.apply(model, "quantize", calibration=CAL, **options)
    results = model.config.zoo_recipe[-1]["results"]
    kind = LookupQuantizedExperts if "dtype" in options else QuantizedExperts
    assert all(type(m.experts) is kind for _, m in moe_layers(model))
    if options.get("group_size") == "adaptive":
        for i, m in moe_layers(model):
            assert results["group_size"][str(i)] == m.experts.groups
    if options.get("dtype") == "bitmod":
        assert all(sum(c.values()) > 0 for c in results["types"].values())
    ids = CAL[0][:2]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "q")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=0, atol=1e-6)


def test_adaptive_targets_all_picks_a_group_per_linear():
    """A loose bound keeps every plain linear at its coarsest group, a zero bound takes its finest."""
    for alpha, pick in ((100.0, 0), (0.0, -1)):
        model = zoo.convert(tiny_native("mixtral"))
        zoo.apply(model, "quantize", bits=4, targets="all", group_size="adaptive", group_alpha=alpha)
        groups = model.config.zoo_recipe[-1]["results"]["linears"]["group_size"]
        assert groups
        for name, g in groups.items():
            linear = model.get_submodule(name)
            assert g == linear.group_size == candidates(linear.in_features)[pick]


@pytest.mark.parametrize("options,message", [
    ({"dtype": "bitmd", "bits": 4}, "did you mean 'bitmod'"),
    ({"group_size": "adaptve", "bits": 4}, "did you mean 'adaptive'"), ({"dtype": "bitmod", "bits": 2}, "at one width"),
    ({"dtype": "bitmod", "bits": 3, "allocation": "pmq", "widths": [2, 4]}, "at one width"),
    ({"dtype": "bitmod", "bits": 4, "group_size": "adaptive"}, "fixed group_size"),
    ({"group_alpha": 0.2, "bits": 4}, "group_alpha tunes"),
    ({"group_size": "adaptive", "bits": 4, "group_alpha": -1}, "group_alpha must be"),
])
def test_bad_format_options_leave_the_model_untouched(options, message):
    model = zoo.convert(tiny_native("mixtral"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        zoo.apply(model, "quantize", **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("options", [FORMATS[1], FORMATS[3], {**FORMATS[0], "targets": "all"}])
def test_streamed_layer_at_a_time_gives_identical_tensors(options, tmp_path):
    from zoo.editing import stream

    tiny_native("mixtral").save_pretrained(tmp_path / "native")
    model = zoo.apply(zoo.load(tmp_path / "native"), "quantize", calibration=CAL, **options)
    model.save_pretrained(tmp_path / "memory")
    stream.apply(tmp_path / "native", [("quantize", options)], tmp_path / "stream", calibration=CAL)
    a, b = folder_tensors(tmp_path / "memory"), folder_tensors(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "stream")
    assert loaded.config.zoo_recipe[-1]["results"] == model.config.zoo_recipe[-1]["results"]


@pytest.mark.parametrize("options", [{"bits": 8, "dtype": "bitmod"}, {"bits": 8, "group_size": "adaptive"}])
def test_formats_mean_nothing_to_int8_rows_and_say_so(options):
    model = zoo.apply(zoo.convert(tiny_native("mixtral")), "quantize", **options)
    assert all(type(m.experts) is QuantizedExperts and m.experts.bits[0] == 8 for _, m in moe_layers(model))
    assert "int8 per output channel" in str(model.config.zoo_recipe[-1]["results"])
