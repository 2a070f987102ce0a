"""zoo::lowbit_gemm (zoo/moe/kernels/lowbit_gemm.h): prefill on int8 / int4 / 2/3-bit weights through tiles widened
in the cache, against the naive reference (the dequantised weight's fp32 matmul), for every row count around the
kernel's steps, group sizes, scale dtypes; its refusals; and the prefill paths that take it (quantized experts and
linear layers on bf16 inputs) against the path they replace."""
import pytest
import torch

from zoo.moe import kernels
from zoo.moe.packing import dequantize
from zoo.moe.quantized import quantize_grouped, quantize_int8

pytestmark = pytest.mark.skipif(not kernels.load() or kernels.best_isa() != "avx512-bf16",
                                reason="needs the kernels on a processor with AVX512-BF16")


def weight(bits, N, K, g=64, seed=0, scale_dtype=torch.float32):
    """(stored, scale, dequantised fp32 [N, K]) of a random matrix."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.1
    if bits == 8:
        q, s = quantize_int8(w)[:2]
        s = s.to(scale_dtype)
        return q, s, q.float() * s.float()[:, None]
    q, s = quantize_grouped(w, g, bits)[:2]
    s = s.to(scale_dtype)
    return q, s, dequantize(bits, q, s, (N, K), g).float()


def reference(x, dense):
    """What the kernel computes: bf16 inputs times the weight as bf16 pairs multiply (int4: the dequantised weight
    rounded to bf16, as the dense path rounds it, 2/3 bits too; int8: the codes, exact), summed in fp32."""
    return x.float() @ dense.t()


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("M", [1, 5, 6, 7, 13, 64])
@torch.no_grad()
def test_matches_reference(bits, M):
    N, K = 192, 256  # three 64-row blocks
    q, s, dense = weight(bits, N, K)
    x = torch.randn(M, K).bfloat16()
    got = kernels.lowbit_gemm(x, q, s, bits, 64)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    want = reference(x, dense.bfloat16().float() if bits != 8 else q.float()) * (s.float()[:, None].t()
                                                                              if bits == 8 else 1)
    # one rounding of the fp32 sum to bf16 (sums of 256 products differ only in order)
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_int4_groups_and_scale_dtypes_equal_the_dense_path(g, scale_dtype):
    """The same bf16 weight as dequantize_int4 (tile for tile), so the product equals the dense path's up to the
    order of the fp32 sums."""
    q, s, _ = weight(4, 128, 512, g, seed=1, scale_dtype=scale_dtype)
    x = torch.randn(24, 512).bfloat16()
    dense = kernels.dequantize_int4(q, s, g, torch.bfloat16)
    torch.testing.assert_close(kernels.lowbit_gemm(x, q, s, 4, g).float(), reference(x, dense.float()),
                               rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("g", [32, 64, 96, 128])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_packed_codes_groups_and_scale_dtypes_equal_the_dense_path(bits, g, scale_dtype):
    """2/3-bit codes packed along each row (3 bits: 32 codes in 12 bytes), groups of one and several 32-code steps:
    the tile holds the weights dequantize_packed makes in bf16 (each row's table per group), so the product equals
    the dense path's up to the order of the fp32 sums; the rows past the first block too (N = 192)."""
    K = 384 if g == 128 else 576
    q, s, _ = weight(bits, 192, K, g, seed=bits, scale_dtype=scale_dtype)
    x = torch.randn(13, K).bfloat16()
    dense = kernels.dequantize_packed(q, s, bits, g, torch.bfloat16)
    torch.testing.assert_close(kernels.lowbit_gemm(x, q, s, bits, g).float(), reference(x, dense.float()),
                               rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("bits", [2, 3])
@torch.no_grad()
def test_packed_codes_read_nothing_past_the_matrix(at_unreadable_page, bits):
    """Codes whose matrix ends where the process's memory does (the next page unreadable, as past the end of a
    mapped checkpoint): the last row's last 32 codes read their own bytes only (a read past them would end the
    process), and the product is the one in ordinary memory."""
    q, s, _ = weight(bits, 64, 128, 32)
    x = torch.randn(3, 128).bfloat16()
    at_the_end = at_unreadable_page(q)
    assert torch.equal(kernels.lowbit_gemm(x, at_the_end, s, bits, 32), kernels.lowbit_gemm(x, q, s, bits, 32))


@torch.no_grad()
def test_int8_scales_multiply_the_fp32_sums():
    q, s, _ = weight(8, 64, 96, scale_dtype=torch.bfloat16)
    x = torch.randn(3, 96).bfloat16()
    want = (x.float() @ q.float().t()) * s.float()
    assert torch.equal(kernels.lowbit_gemm(x, q, s, 8, 0), want.bfloat16())


def test_refuses_bad_input_and_other_sets():
    q4, s4, _ = weight(4, 64, 128)
    q8, s8, _ = weight(8, 64, 128)
    x = torch.randn(2, 128).bfloat16()
    for args, match in [((x.float(), q8, s8, 8, 0), "bfloat16"), ((x, q8[:48], s8[:48], 8, 0), "divisible by 64"),
                        ((x, q4, s4, 4, 48), "group_size"), ((x, q8, s8[:32], 8, 0), "scales"),
                        ((x, q4, s4, 5, 64), "bits must be"), ((x, q4[:, :63], s4, 3, 64), "packed codes"),
                        ((x[:, :96], q8, s8, 8, 0), "bfloat16 \\[M, K\\]")]:
        with pytest.raises(RuntimeError, match=match):
            kernels.lowbit_gemm(*args)
    before = kernels.isa()
    try:
        kernels.isa("avx512")
        assert not kernels.lowbit_gemm_fits(x, q8, 8, 0)
        with pytest.raises(RuntimeError, match="bf16 dot products"):
            kernels.lowbit_gemm(x, q8, s8, 8, 0)
    finally:
        kernels.isa(before)


def test_fits_only_where_it_serves():
    q, _, _ = weight(8, 64, 128)
    x = torch.randn(16, 128).bfloat16()
    with torch.no_grad():
        assert kernels.lowbit_gemm_fits(x, q, 8, 0) and kernels.lowbit_gemm_fits(x, q, 4, 64)
        assert not kernels.lowbit_gemm_fits(x.float(), q, 8, 0)  # fp32 inputs: the dense path keeps them exact
        assert not kernels.lowbit_gemm_fits(x, q[:32], 8, 0)
        assert kernels.lowbit_gemm_fits(x, q, 3, 64) and kernels.lowbit_gemm_fits(x, q, 2, 32)
        assert not kernels.lowbit_gemm_fits(x, q, 4, 48) and not kernels.lowbit_gemm_fits(x, q, 3, 48)
        assert not kernels.lowbit_gemm_fits(x, q, 5, 64)
        with kernels.turned_off():
            assert not kernels.lowbit_gemm_fits(x, q, 8, 0)
    assert not kernels.lowbit_gemm_fits(x, q, 8, 0)  # autograd on


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@torch.no_grad()
def test_quantized_experts_prefill_takes_it_and_matches_the_dense_path(bits, monkeypatch):
    """A bf16 prompt through quantized experts (past the few-token kernel) goes through lowbit_gemm, and gives the
    dense path's output (the dequantised bf16 weight's matmul) within bf16 rounding; 2/3-bit experts read as stored
    (stored_codes) too, on their own codes."""
    from zoo.moe import Routing
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 128, 192)
    for p in dense.parameters():
        p.normal_(0, 0.1)
    experts = QuantizedExperts.from_dense(dense, bits, group_size=32)
    T = 64
    x = torch.randn(T, 128).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:2] for t in range(T)])
    r = Routing(torch.rand(T, 2), idx)
    calls = []
    real = kernels.lowbit_gemm
    monkeypatch.setattr(kernels, "lowbit_gemm", lambda *a: calls.append((a[0].shape[0], a[3])) or real(*a))
    if bits in (2, 3):
        monkeypatch.setitem(kernels._state, "stored_codes", True)
    got = experts(x, r)
    assert {b for _, b in calls} == {bits}  # 2/3 bits: their own codes, not the int4 copy
    calls = [n for n, _ in calls]
    assert calls and sum(calls) == 2 * T * 2  # every (token, slot) pair through gate_up, then down
    monkeypatch.setattr(kernels, "lowbit_gemm_fits", lambda *a: False)
    before = experts(x, r)
    assert float((got.float() - before.float()).norm() / before.float().norm()) < 1e-2


@torch.no_grad()
def test_8bit_inputs_leave_long_bf16_prompts_to_the_tiles(monkeypatch):
    """With int8_inputs(True), bf16 int4 experts take the kernel's int8 dot products up to INT4_DOT_PAIRS_BF16 pairs
    per expert and the (exact, there faster) tiles past it; fp32 inputs keep the longer INT4_DOT_PAIRS limit."""
    from zoo.moe import Routing
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    assert kernels.int8_dot_limit("experts", 4, torch.bfloat16) == kernels.INT4_DOT_PAIRS_BF16
    assert kernels.int8_dot_limit("experts", 4, torch.float32) == kernels.INT4_DOT_PAIRS
    assert kernels.int8_dot_limit("linear", 4, torch.bfloat16) == kernels.INT4_DOT_ROWS_BF16
    assert kernels.int8_dot_limit("linear", 8, torch.bfloat16) == kernels.INT8_DOT_ROWS[8]
    torch.manual_seed(0)
    dense = SwiGLUExperts(4, 128, 192)
    for p in dense.parameters():
        p.normal_(0, 0.1)
    experts = QuantizedExperts.from_dense(dense, 4, group_size=32)
    gemv, tiles = [], []
    real_gemv, real_tiles = kernels.moe_gemv, kernels.lowbit_gemm
    monkeypatch.setattr(kernels, "moe_gemv", lambda *a, **k: gemv.append(1) or real_gemv(*a, **k))
    monkeypatch.setattr(kernels, "lowbit_gemm", lambda *a: tiles.append(1) or real_tiles(*a))
    kernels.int8_inputs(True)
    try:
        for T, dtype, dots in [(40, torch.bfloat16, True), (64, torch.bfloat16, False), (64, torch.float32, True)]:
            gemv.clear(), tiles.clear()
            x = torch.randn(T, 128).to(dtype)
            idx = torch.stack([torch.arange(2) + t % 2 * 2 for t in range(T)])  # T / 2 pairs for each expert
            experts(x, Routing(torch.rand(T, 2), idx))
            assert (bool(gemv), bool(tiles)) == (dots, not dots), (T, dtype)
    finally:
        kernels.int8_inputs(False)
