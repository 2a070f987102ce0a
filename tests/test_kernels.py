"""zoo::moe_gemv (zoo/kernels): the C++ expert kernel against the dequantised naive reference, for every stored
form, 1 to 8 tokens, empty slots, experts of another stack, every instruction set (AVX-512 with bf16 dot
products, AVX-512, AVX2, portable) where this processor has it, and ZOO_KERNEL_ISA forcing one; opcheck; the
expert block it serves in compiled decode."""
import functools
import os
import subprocess
import sys

import pytest
import torch

from zoo.moe import kernels
from zoo.moe.packing import pack
from zoo.moe.quantized import quantize_grouped, quantize_int8

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"kernel unavailable: {kernels.unavailable_reason()}")

@pytest.fixture(params=kernels.ISAS)
def isa(request):
    before = kernels.isa()
    try:
        kernels.isa(request.param)
    except RuntimeError:
        pytest.skip(f"this processor lacks {request.param}")
    yield request.param
    kernels.isa(before)


def stack(bits, S, N, K, group_size=32, dtype=torch.bfloat16, seed=0):
    """A stack of S experts' [N, K] weights in the stored form of ``bits``: (weight, scale)."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(S, N, K, generator=g) * 0.1
    if bits == 16:
        return dense.to(dtype), None
    if bits == 8:
        q, s = zip(*(quantize_int8(w) for w in dense))
        return torch.stack(q), torch.stack(s).to(dtype)
    q, s = zip(*(quantize_grouped(w, group_size, bits)[:2] for w in dense))
    return torch.stack(q), torch.stack(s)


def routing(T, k, E, seed=0, empty=False):
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if empty:
        idx[0, -1] = E  # an empty slot (the marker is the expert count)
    return idx


KINDS = [(16, torch.float32), (16, torch.bfloat16), (8, torch.bfloat16), (8, torch.float32), (4, torch.bfloat16),
         (3, torch.bfloat16), (2, torch.bfloat16)]


@pytest.mark.parametrize("bits,dtype", KINDS, ids=[f"{b}bit-{str(d)[6:]}" for b, d in KINDS])
@pytest.mark.parametrize("T", [1, 2, 3, 8])
def test_matches_reference(isa, bits, dtype, T):
    # N = 160: two full int4 blocks of 64 and a 32-row tail; K = 96: a vector tail for the 16-lane path
    S, N, K, k = 6, 160, 96, 2
    w, s = stack(bits, S, N, K, dtype=dtype)
    x = torch.randn(T, K).to(dtype)
    idx = routing(T, k, S, empty=T > 1)
    got = kernels.moe_gemv(x, idx, w, s, bits, 32)
    want = kernels.moe_gemv_reference(x, idx, w, s, bits, 32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == x.dtype and got.shape == (T, k, N)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    if T > 1:
        assert got[0, -1].abs().max() == 0  # the empty slot


@pytest.mark.parametrize("bits", [16, 8, 4, 3, 2])
def test_per_slot_inputs_and_other_stacks(isa, bits):
    """x [T, k, K] (the down projection's input) and a stack holding only some experts (mixed widths)."""
    S, N, K, T, k, E = 3, 64, 128, 4, 3, 6
    w, s = stack(bits, S, N, K, group_size=64)
    slot_of = torch.tensor([0, -1, 1, -1, 2, -1])
    idx = routing(T, k, E, seed=3, empty=True)
    x = torch.randn(T, k, K)
    got = kernels.moe_gemv(x, idx, w, s, bits, 64, slot_of)
    torch.testing.assert_close(got, kernels.moe_gemv_reference(x, idx, w, s, bits, 64, slot_of), rtol=1e-4, atol=1e-4)
    other = (slot_of[idx.clamp(max=E - 1)] < 0) | (idx >= E)
    assert other.any() and got[other].abs().max() == 0


def test_many_pairs_for_one_expert(isa):
    """More than eight (token, slot) pairs on one expert: the kernel splits them into groups of eight."""
    w, s = stack(4, 2, 64, 64)
    idx = torch.zeros(11, 1, dtype=torch.long)
    x = torch.randn(11, 64)
    torch.testing.assert_close(kernels.moe_gemv(x, idx, w, s, 4, 32), kernels.moe_gemv_reference(x, idx, w, s, 4, 32),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,dtype", [(16, torch.bfloat16), (16, torch.float32), (8, torch.bfloat16)])
@pytest.mark.parametrize("K", [4104, 14336])
def test_long_rows(isa, bits, dtype, K):
    """bf16, fp32 and int8 rows longer than 4 KB (a Mixtral down projection's 14336 inputs; 4104: a vector tail too),
    whose weights the avx2 set asks for a line a step rather than two rows at once: one and two inputs (decode), on
    every set, against the reference; int8 rows on 8-bit inputs too where the set has them."""
    w, s = stack(bits, 3, 40, K, dtype=dtype)
    for int8 in (False, True) if bits == 8 and isa in kernels.INT8_DOT_ISAS else (False,):
        kernels.int8_inputs(int8)
        for T in (1, 2):
            x = torch.randn(T, K).to(dtype)
            idx = routing(T, 2, 3)
            want = kernels.moe_gemv_reference(x.float(), idx, w, s, bits)
            got = kernels.moe_gemv(x, idx, w, s, bits)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    kernels.int8_inputs(False)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("K", [64, 100, 2048])
@pytest.mark.parametrize("N", [160, 152])
def test_many_pairs_through_tiles(isa, bits, K, N):
    """Blocks of rows that many pairs read (on avx512-bf16, bf16 and int8 rows times bf16 inputs go through a tile of
    bf16 pairs from 16 pairs, or from 8 whose inputs pass 32 KB; on avx2, bf16 and int8 rows through fp32 strips of
    16 rows from 8 pairs; widths that are not a multiple of 32 (avx2: 8), the rows past the last full block of 64
    (avx2: a last block of rows that is not a multiple of 16), and the fewer pairs stay on the rows kernels): the
    reference's result, for inputs
    shared by the slots and per slot, bf16 and fp32."""
    S, T, k = 3, 20, 2
    w, s = stack(bits, S, N, K)
    # experts 0 / 1 / 2: 20 / 9 / 11 pairs
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.where(torch.arange(T) < 9, 1, 2)], 1)
    for x in (torch.randn(T, K).bfloat16(), torch.randn(T, k, K).bfloat16(), torch.randn(T, K)):
        got = kernels.moe_gemv(x, idx, w, s, bits)
        torch.testing.assert_close(got.float(), kernels.moe_gemv_reference(x, idx, w, s, bits).float(),
                                   rtol=1e-2, atol=1e-3)


def _zen5() -> bool:
    """An AMD processor of family 0x1A (Zen 5) with the avx512-bf16 set: where int8 tiles serve from 2 pairs."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "AuthenticAMD" in info and "\ncpu family\t: 26\n" in info and kernels.best_isa() == "avx512-bf16"


@pytest.mark.parametrize("K", [64, 1024])
def test_int8_tiles_from_few_pairs(isa, K):
    """int8_tile_pairs: int8 blocks on bf16 inputs through a tile from as few pairs as asked (on avx512-bf16; the
    rows kernels elsewhere): the reference's result whichever path serves, for inputs shared by the slots and per
    slot, and each expert on the path its pairs choose, seen on a sum whose fp32 result depends on the order it is
    added in (2^24, ones, -2^24: the rows kernel's lanes keep some ones, the tile's running sum loses them). The
    default is the processor's (2 on AMD Zen 5, the kernel's rule elsewhere); bad values are refused."""
    assert kernels.int8_tile_pairs() == (2 if _zen5() else 0)
    S, N, T, k = 4, 128, 6, 2
    w, s = stack(8, S, N, K)
    idx = torch.stack([torch.arange(T) % S, (torch.arange(T) + 1) % S], 1)  # experts 0..3: 3 / 4 / 3 / 2 pairs
    pairs_of = torch.bincount(idx.flatten(), minlength=S)[idx]  # [T, k]: the pairs of each pair's expert
    ones = torch.ones(S, N, K, dtype=torch.int8), torch.ones(S, N, dtype=torch.bfloat16)
    order = torch.ones(T, K, dtype=torch.bfloat16)
    order[:, 0], order[:, -1] = 2.0 ** 24, -2.0 ** 24
    try:
        for x in (torch.randn(T, K).bfloat16(), torch.randn(T, k, K).bfloat16()):
            want = kernels.moe_gemv_reference(x, idx, w, s, 8).float()
            for pairs in (0, 2, 3, 4):
                kernels.int8_tile_pairs(pairs)
                torch.testing.assert_close(kernels.moe_gemv(x, idx, w, s, 8).float(), want, rtol=1e-2, atol=1e-3)
        kernels.int8_tile_pairs(0)
        rows = kernels.moe_gemv(order, idx, *ones, 8)[..., 0]
        for pairs in (2, 3, 4):
            kernels.int8_tile_pairs(pairs)
            tiled = kernels.isa() == "avx512-bf16" and K % 32 == 0
            moved = kernels.moe_gemv(order, idx, *ones, 8)[..., 0] != rows
            assert torch.equal(moved, (pairs_of >= pairs) & tiled), (pairs, moved)
    finally:
        kernels.int8_tile_pairs(-2)
    assert kernels.int8_tile_pairs() == (2 if _zen5() else 0)
    for bad in (-3, True, "2", 1.5):
        with pytest.raises(ValueError, match="int8_tile_pairs"):
            kernels.int8_tile_pairs(bad)


@pytest.mark.parametrize("K", [64, 100, 1024])
def test_int8_wide_rows_for_one_input(isa, K):
    """int8_wide_rows: one-input int8 rows (decode) on an AVX-512 set widen 16 codes a step (the avx512 set's rows)
    or two halves of 8 (the 256-bit code): the reference's result either way, bf16 and fp32 inputs, widths that are not
    a multiple of 16; the path seen on a sum whose fp32 result depends on the order (2^24, ones, -2^24: each path's
    lanes lose the ones added beside 2^24, every 64th input on 16 lanes, every 32nd on 8). Several pairs per expert
    stay where they were; sets without AVX-512 ignore it. The default is the processor's (on for AMD Zen 5); bad
    values are refused."""
    default = kernels.int8_wide_rows()
    assert default == (_zen5() or (kernels.zen5() and kernels.best_isa() == "avx512"))
    S, N = 4, 96
    w, s = stack(8, S, N, K)
    one = torch.tensor([[0, 2]])  # one token: each expert one pair
    ones = torch.ones(S, N, K, dtype=torch.int8), torch.ones(S, N, dtype=torch.bfloat16)
    order = torch.ones(1, K)
    order[0, 0], order[0, -1] = 2.0 ** 24, -2.0 ** 24
    try:
        for x in (torch.randn(1, K).bfloat16(), torch.randn(1, K), torch.randn(3, K).bfloat16()):
            idx = one if len(x) == 1 else torch.tensor([[0, 1], [0, 1], [0, 2]])
            want = kernels.moe_gemv_reference(x, idx, w, s, 8).float()
            for on in (False, True):
                assert kernels.int8_wide_rows(on) is on
                torch.testing.assert_close(kernels.moe_gemv(x, idx, w, s, 8).float(), want, rtol=1e-2, atol=1e-3)
        sums = {}
        for on in (False, True):
            kernels.int8_wide_rows(on)
            sums[on] = (kernels.moe_gemv(order, one, *ones, 8).float(),
                        kernels.moe_gemv(order.expand(3, K), torch.tensor([[0, 1]] * 3), *ones, 8).float())
        wide = kernels.isa() in ("avx512", "avx512-bf16") and K >= 64
        assert torch.equal(sums[True][0], sums[False][0]) is not wide, sums
        assert torch.equal(sums[True][1], sums[False][1])  # three pairs an expert: not one input
    finally:
        kernels.int8_wide_rows(default)
    assert kernels.int8_wide_rows() == default
    for bad in (1, "on", 0.5):
        with pytest.raises(ValueError, match="int8_wide_rows"):
            kernels.int8_wide_rows(bad)


@pytest.mark.parametrize("K", [64, 2048])
@pytest.mark.parametrize("N", [128, 160])
def test_many_pairs_on_int4_blocks(isa, K, N):
    """Full 64-row blocks of int4 codes that many pairs read (the block kernel, 4 inputs at a time on avx2) and the
    rows past the last full block: the reference's result, for inputs shared by the slots and per slot, bf16 and
    fp32."""
    S, T, k = 3, 20, 2
    w, s = stack(4, S, N, K)
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.where(torch.arange(T) < 9, 1, 2)], 1)  # 20 / 9 / 11
    for x in (torch.randn(T, K).bfloat16(), torch.randn(T, k, K).bfloat16(), torch.randn(T, K)):
        got = kernels.moe_gemv(x, idx, w, s, 4, 32)
        torch.testing.assert_close(got.float(), kernels.moe_gemv_reference(x, idx, w, s, 4, 32).float(),
                                   rtol=1e-2, atol=1e-3)


@pytest.fixture
def avx2_one_thread():
    """The avx2 set on one thread (the caller's, whose floating-point flags torch.set_flush_denormal sets), with the
    codes read as subnormals whatever this processor's measurement said."""
    before, threads = kernels.isa(), torch.get_num_threads()
    try:
        kernels.isa("avx2")
    except RuntimeError:
        pytest.skip("this processor lacks avx2")
    measured = kernels.subnormal_codes()
    kernels.subnormal_codes(True)
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)
    kernels.subnormal_codes(measured)
    kernels.isa(before)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_codes_on_subnormals_are_the_converted_codes_bit_for_bit(avx2_one_thread, bits, T):
    """On avx2, int4 blocks and 2/3-bit rows times exact inputs read the codes as subnormal floats (the inputs scaled
    by a power of two per row); with subnormal operands read as zeros (set_flush_denormal) the kernels convert the
    codes instead. Both give the same bits, and the reference's result, for rows of small and large magnitude, one to
    five inputs (int4: the 4 + 1 split), fp32 and bf16 inputs, one input per slot too, an odd last row (2/3 bits)."""
    S, N, K, k = 3, 128 if bits == 4 else 67, 256, 2
    w, s = stack(bits, S, N, K, group_size=64)
    idx = routing(T, k, S)
    magnitude = torch.tensor([2.0 ** -90, 1.0, 2.0 ** 90, 3.0, 2.0 ** -20])[:T, None]
    for x in (torch.randn(T, K) * magnitude, (torch.randn(T, K) * magnitude).bfloat16(), torch.randn(T, k, K)):
        subnormals = kernels.moe_gemv(x, idx, w, s, bits, 64)
        torch.set_flush_denormal(True)
        converted = kernels.moe_gemv(x, idx, w, s, bits, 64)
        torch.set_flush_denormal(False)
        assert torch.equal(subnormals, converted)
        want = kernels.moe_gemv_reference(x, idx, w, s, bits, 64).float()
        scale = want.flatten(1).abs().amax(1).clamp(min=1e-30)[:, None, None]  # each row to its own magnitude
        torch.testing.assert_close(subnormals.float() / scale, want / scale, rtol=2e-2, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_codes_beyond_the_subnormal_range_are_converted(avx2_one_thread, bits):
    """Rows whose largest input is past 2^101 (where 2^(149 - S) would overflow) or that hold a NaN or an infinity:
    the call converts the codes, so the other rows' results stand and the large ones are right too."""
    S, N, K = 2, 64, 128
    w, s = stack(bits, S, N, K, group_size=64)
    idx = torch.zeros(4, 1, dtype=torch.long)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(bits))
    x[1] *= 2.0 ** 110
    x[2] *= 2.0 ** 115  # (at 2^120, 5 draws in 300 summed past fp32's largest: a flaky test)
    got = kernels.moe_gemv(x, idx, w, s, bits, 64)
    want = kernels.moe_gemv_reference(x, idx, w, s, bits, 64)
    assert torch.isfinite(got).all()
    for r in range(4):  # to fp32 rounding of 128-term sums, relative to the row's largest output
        torch.testing.assert_close(got[r] / want[r].abs().max(), want[r] / want[r].abs().max(), rtol=1e-5, atol=1e-5)
    x[3, 5] = float("nan")
    x[2, 7] = float("inf")
    again = kernels.moe_gemv(x, idx, w, s, bits, 64)
    assert again[3].isnan().any() and not torch.isfinite(again[2]).all()
    assert torch.equal(again[:2], got[:2])


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_a_rows_largest_input_is_found_at_every_lane(avx2_one_thread, bits):
    """The scan that sets a row's power of two for the subnormal codes (its largest magnitude, four lanes at a time)
    finds the largest input wherever it lies: one input of 2^90 (in range: the codes stay subnormals) or -2^110 (past
    it: the call converts) at each lane position and at the row's last input. A largest input missed would set too
    large a power of two, and that input's products would overflow."""
    S, N, K = 2, 64, 192
    w, s = stack(bits, S, N, K, group_size=64)
    idx = torch.zeros(1, 1, dtype=torch.long)
    base = torch.randn(1, K, generator=torch.Generator().manual_seed(7))
    for big in (2.0 ** 90, -(2.0 ** 110)):
        for pos in (0, 1, 2, 3, 66, K - 1):
            x = base.clone()
            x[0, pos] = big
            got = kernels.moe_gemv(x, idx, w, s, bits, 64)
            want = kernels.moe_gemv_reference(x, idx, w, s, bits, 64)
            assert torch.isfinite(got).all(), (big, pos)
            top = want.abs().max()
            torch.testing.assert_close(got / top, want / top, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_group_sums_of_eight_groups_at_a_time_and_the_rest(avx2_one_thread, bits):
    """Each group's sum of its inputs (the zero terms) is formed eight groups side by side, then the groups past the
    last eight one at a time: 12 groups of 64 (8 + 4), inputs far from zero on average so that a wrong sum shows, the
    reference's result, and the same bits on subnormal codes as converted."""
    S, N, K, T = 3, 64, 768, 3
    w, s = stack(bits, S, N, K, group_size=64)
    idx = routing(T, 2, S)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(11)) + 3.0
    got = kernels.moe_gemv(x, idx, w, s, bits, 64)
    torch.set_flush_denormal(True)
    converted = kernels.moe_gemv(x, idx, w, s, bits, 64)
    torch.set_flush_denormal(False)
    assert torch.equal(got, converted)
    want = kernels.moe_gemv_reference(x, idx, w, s, bits, 64)
    top = want.abs().amax()
    torch.testing.assert_close(got / top, want / top, rtol=1e-5, atol=1e-5)


def test_subnormal_codes_are_measured_and_change_only_the_speed(avx2_one_thread):
    """Whether the codes are read as subnormals is measured per process (fused multiply-adds on subnormal operands
    against normal ones) and can be forced either way; both ways give the same bits. A bad value is refused."""
    assert isinstance(torch.ops.zoo.moe_gemv_subnormal_codes(2), int)  # measured again
    assert kernels.subnormal_codes() in (True, False)
    w, s = stack(4, 2, 64, 128, group_size=64)
    x, idx = torch.randn(3, 128), torch.zeros(3, 1, dtype=torch.long)
    outputs = []
    for on in (False, True):
        assert kernels.subnormal_codes(on) is on
        outputs.append(kernels.moe_gemv(x, idx, w, s, 4, 64))
    assert torch.equal(*outputs)
    with pytest.raises(ValueError, match="takes True, False or None"):
        kernels.subnormal_codes("yes")


@pytest.mark.parametrize("K", [32, 64, 77, 130])
@pytest.mark.parametrize("T", [1, 3])
def test_bf16_inputs_every_width(isa, K, T):
    """bf16 weights times bf16 inputs (vdpbf16ps on avx512-bf16) for widths that fill whole steps and widths that
    end in a masked part-step, per-slot inputs too."""
    S, N, k = 4, 48, 2
    w, _ = stack(16, S, N, K)
    idx = routing(T, k, S)
    for x in (torch.randn(T, K).bfloat16(), torch.randn(T, k, K).bfloat16()):
        got = kernels.moe_gemv(x, idx, w, None, 16)
        torch.testing.assert_close(got.float(), kernels.moe_gemv_reference(x, idx, w, None, 16).float(),
                                   rtol=1e-2, atol=1e-3)


def int8_inputs_reference(x, idx, w, s, slot_of=None):
    """The 8-bit-input path's exact result: each input row rounded to q = round(x * (1 / a)) in [-127, 127] with
    a = max|x| / 127 (times the reciprocal, as the kernel rounds: x / a can land on the other side of a half, in 113
    of 400 draws of bf16 inputs here), the integer dot with the int8 row, times a and the row's scale (in float64)."""
    T, k = idx.shape
    xf = x.float()
    a = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xf * a.reciprocal()).clamp(-127, 127).double()
    y = torch.zeros(T, k, w.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(idx[t, j])
            slot = e if slot_of is None else int(slot_of[e])
            row = (t, j) if x.dim() == 3 else (t,)
            y[t, j] = (w[slot].double() @ q[row]) * a[row].double() * s[slot].double()
    return y


def on_8bit_dot_set(name):
    """8-bit inputs on, on instruction set ``name`` (a test skips where the processor lacks it); off afterwards."""
    if kernels.ISAS.index(kernels.best_isa()) < kernels.ISAS.index(name):
        pytest.skip(f"this processor lacks the {name} set")
    before = kernels.isa()
    kernels.isa(name)
    kernels.int8_inputs(True)
    yield
    kernels.int8_inputs(False)
    kernels.isa(before)


@pytest.fixture(params=kernels.INT8_DOT_ISAS)
def int8_inputs(request):
    """Each set with 8-bit dot products: avx512-bf16 (vpdpbusd) and avx2 (vpmaddubsw, 3-bit rows on vpmaddwd; 2-bit
    rows outside steps of 256 take the float kernel on the rounded inputs there)."""
    yield from on_8bit_dot_set(request.param)


@pytest.mark.parametrize("K", [64, 100, 192])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_int8_inputs_are_exact_integer_dots(int8_inputs, K, T):
    """int8 weights times inputs rounded to 8 bits on vpdpbusd: equal (up to the float products at the end) to the
    integer reference, for whole and part 64-byte steps, fp32 and bf16 inputs, an input per slot, a stack holding
    some experts; and within rounding distance of the float-input path."""
    S, N, k = 3, 48, 2
    w, s = stack(8, S, N, K, dtype=torch.float32)
    slot_of = torch.tensor([0, 2, 1, -1])
    idx = routing(T, k, 3, seed=T)
    for x in (torch.randn(T, K), torch.randn(T, K).bfloat16(), torch.randn(T, k, K)):
        got = kernels.moe_gemv(x, idx, w, s, 8, 64, slot_of)
        want = int8_inputs_reference(x, idx, w, s, slot_of)
        tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bf16 outputs are rounded once more
        torch.testing.assert_close(got.double(), want.to(got.dtype).double(), rtol=tol, atol=tol)
    kernels.int8_inputs(False)
    exact = kernels.moe_gemv(x, idx, w, s, 8, 64, slot_of)
    kernels.int8_inputs(True)
    assert not torch.equal(got, exact) and float((got - exact).norm() / exact.norm()) < 0.02


@pytest.mark.parametrize("bits", [3, 2])
@pytest.mark.parametrize("N", [1, 3, 101])
def test_one_input_packed_rows_two_at_a_time_and_an_odd_last_row(isa, bits, N):
    """One input on 2/3-bit rows goes two rows a step (8-lane sets): an odd row count leaves one row alone, each row's
    result its own (fp32 inputs: the reference within float rounding)."""
    w, s = stack(bits, 3, N, 128, group_size=64, dtype=torch.float32)
    x, idx = torch.randn(1, 128), torch.tensor([[2, 0]])
    got = kernels.moe_gemv(x, idx, w, s, bits, 64)
    torch.testing.assert_close(got, kernels.moe_gemv_reference(x, idx, w, s, bits, 64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [64, 100])
def test_int8_inputs_prefill_rounds_as_the_kernel(int8_inputs, monkeypatch, K):
    """Many rows (prefill) go through torch's int8 matrix product on the kernel's rounding: the integer reference's
    result, and the decode kernel's on the same rows. Only on the avx512-bf16 set (VNNI): on the avx2 one torch's
    int8 product is slow (the 304M model's int8 prefill took 1.6 s against 0.31 s at 64 tokens) and the exact
    product runs."""
    from zoo.moe.in_place import PREFILL_ROWS, kernel_linear

    w, s = stack(8, 1, 48, K, dtype=torch.float32)
    x = torch.randn(PREFILL_ROWS + 3, K)
    one = torch.zeros(x.shape[0], 1, dtype=torch.long)
    real, used = torch._int_mm, []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: used.append(a.shape) or real(a, b))
    got = kernel_linear(x, w[0], s[0], 8, 64)
    if kernels.isa() != "avx512-bf16":
        kernels.int8_inputs(False)
        exact = kernel_linear(x, w[0], s[0], 8, 64)
        kernels.int8_inputs(True)
        assert not used and torch.equal(got, exact)
        return
    assert used == [x.shape]
    torch.testing.assert_close(got.double(), int8_inputs_reference(x, one, w, s)[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, kernels.moe_gemv(x, one, w, s, 8)[:, 0], rtol=1e-5, atol=1e-5)
    kernels.int8_inputs(False)
    exact = kernel_linear(x, w[0], s[0], 8, 64)
    kernels.int8_inputs(True)
    assert not torch.equal(got, exact) and float((got - exact).norm() / exact.norm()) < 0.02


def int4_inputs_reference(x, idx, codes, sz, g, slot_of):
    """The 8-bit-input path's result for int4 (or 2/3-bit) codes from the codes [S, N, K] and (scale, zero) pairs,
    without dequantising: per group the integer dot of the codes with the rounded inputs q and the integer sum of
    q, then a * (s * dot + (z - 8 s) * sum) summed over groups, in float64 (a: the input row's scale)."""
    T, k = idx.shape
    S, N, K = codes.shape
    xf = (x if x.dim() == 3 else x[:, None].expand(T, k, K)).float()
    a = xf.abs().amax(-1, keepdim=True) / 127
    # times the reciprocal, as the kernel rounds (x / a can land on the other side of a half: bf16 inputs often do)
    q = torch.round(xf * a.reciprocal()).clamp(-127, 127).to(torch.int64).view(T, k, 1, K // g, g)
    slot = torch.cat([slot_of, torch.tensor([-1])])[idx.clamp(max=len(slot_of))]  # empty slots: -1
    c = codes[slot.clamp(min=0)].to(torch.int64).view(T, k, N, K // g, g)
    dots, sums = (c * q).sum(-1).double(), q.sum(-1).double()  # exact integers [T, k, N, K/g], [T, k, 1, K/g]
    s, z = sz[slot.clamp(min=0), ..., 0].double(), sz[slot.clamp(min=0), ..., 1].double()  # [T, k, K/g, N]
    y = (s.transpose(-1, -2) * dots + (z - 8 * s).transpose(-1, -2) * sums).sum(-1) * a.double()
    return torch.where(slot[..., None] >= 0, y, 0)


@functools.lru_cache
def int4_stack_with_codes(g, K=256):
    """3 experts [160, K] in torch's int4 pack (two full blocks of 64 rows and a 32-row tail): (weight, bf16
    (scale, zero) pairs, codes)."""
    gen = torch.Generator().manual_seed(g)
    return tuple(map(torch.stack, zip(*(quantize_grouped(torch.randn(160, K, generator=gen) * 0.1, g)
                                        for _ in range(3)))))


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("T", range(1, 9))
def test_int4_8bit_inputs_are_exact_integer_dots(int8_inputs, g, T):
    """int4 codes times inputs rounded to 8 bits on vpdpbusd: the integer reference's result (up to the fp32 scaling
    per group), for full blocks of 64 rows and the 32-row tail, fp32 and bf16 inputs and scales, an input per slot,
    a stack holding some experts, 1..8 inputs on one expert; and within rounding distance of the exact path."""
    assert_8bit_inputs_exact(*int4_stack_with_codes(g), 4, g, T)


@pytest.mark.parametrize("T", [4, 8])
def test_int4_8bit_inputs_in_groups_past_256(int8_inputs, T):
    """Groups of 512 inputs, four inputs and more on one expert (AVX2 unpacks a group's codes once for all its inputs
    up to groups of 256, and per input past them): the integer reference's result."""
    assert_8bit_inputs_exact(*int4_stack_with_codes(512, 1024), 4, 512, T)


def assert_8bit_inputs_exact(w, sz, codes, bits, g, T, k=3):
    """Codes times 8-bit inputs against the integer reference (fp32 / bf16 inputs, an input per slot, both scale
    dtypes; slots on experts 0, 1..3 in turn, and an empty one), and within rounding distance of the exact path."""
    K = codes.shape[-1]
    slot_of = torch.tensor([0, 2, 1, -1])
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(T) % 3 + 1, torch.full((T,), 4)], 1)
    gen = torch.Generator().manual_seed(T)
    for x in (torch.randn(T, K, generator=gen), torch.randn(T, K, generator=gen).bfloat16(),
              torch.randn(T, k, K, generator=gen)):
        want = int4_inputs_reference(x, idx, codes, sz, g, slot_of)
        for scale in (sz, sz.float()):
            got = kernels.moe_gemv(x, idx, w, scale, bits, g, slot_of)
            tol = 1e-5 if x.dtype == torch.float32 else 1e-2  # bf16 outputs are rounded once more
            torch.testing.assert_close(got.double(), want.to(got.dtype).double(), rtol=tol, atol=tol)
    kernels.int8_inputs(False)
    exact = kernels.moe_gemv(x, idx, w, sz, bits, g, slot_of)
    kernels.int8_inputs(True)
    assert not torch.equal(got, exact) and float((got - exact).norm() / exact.norm()) < 0.02



def assert_bf16_inputs_close(w, sz, bits, g, T, seed):
    """2/3-bit codes times bf16 inputs (a token's, and one per slot; slots on experts 0, 1..3 in turn, and an empty
    one) within the outputs' bf16 rounding of the reference on the same inputs in fp32."""
    K = w.shape[-1] * 8 // bits
    slot_of = torch.tensor([0, 2, 1, -1])
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(T) % 3 + 1, torch.full((T,), 4)], 1)
    gen = torch.Generator().manual_seed(seed)
    for x in (torch.randn(T, K, generator=gen), torch.randn(T, 3, K, generator=gen)):
        xb = x.bfloat16()
        want = kernels.moe_gemv_reference(xb.float(), idx, w, sz, bits, g, slot_of)
        got = kernels.moe_gemv(xb, idx, w, sz, bits, g, slot_of)
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-4 * float(want.abs().max()))


@functools.lru_cache
def packed_stack_with_codes(bits, g, N=48, K=192):
    """3 experts [N, K] in the dense 2/3-bit pack: (weight, bf16 (scale, zero) pairs, codes)."""
    gen = torch.Generator().manual_seed(10 * bits + g)
    return tuple(map(torch.stack, zip(*(quantize_grouped(torch.randn(N, K, generator=gen) * 0.1, g, bits)
                                        for _ in range(3)))))


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("g", [32, 64, 96, 192])
@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_packed_rows_every_group_layout(isa, bits, g, T):
    """2/3-bit rows on float inputs, against the dequantised reference within fp32 rounding: groups of whole chunk
    pairs (the 16-lane path's steps), groups ending in an odd chunk (96), single-chunk groups (32); 1..8 inputs on
    one expert (the kernel's accumulator layouts differ by count), an input per slot, fp32 and bf16 scales. bf16
    inputs too (on avx512-bf16 the codes' own kernel on bf16 dot products, whose last step of a row reads only its
    own bytes): within the outputs' bf16 rounding of the reference on the same inputs in fp32."""
    w, sz, _ = packed_stack_with_codes(bits, g)
    slot_of = torch.tensor([0, 2, 1, -1])
    idx = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(T) % 3 + 1, torch.full((T,), 4)], 1)
    gen = torch.Generator().manual_seed(T)
    for x in (torch.randn(T, 192, generator=gen), torch.randn(T, 3, 192, generator=gen)):
        want = kernels.moe_gemv_reference(x, idx, w, sz, bits, g, slot_of)
        for scale in (sz, sz.float()):
            got = kernels.moe_gemv(x, idx, w, scale, bits, g, slot_of)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()
        want = kernels.moe_gemv_reference(xb.float(), idx, w, sz, bits, g, slot_of)
        got = kernels.moe_gemv(xb, idx, w, sz, bits, g, slot_of)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("g,K", [(32, 1024), (64, 1280), (64, 512), (128, 768), (256, 512), (512, 1024),
                                 (64, 1408), (32, 800), (128, 896)])
@pytest.mark.parametrize("N", [64, 80, 70])
@pytest.mark.parametrize("T", [1, 2, 3, 8])
def test_2bit_bf16_inputs_256_a_step(isa, g, K, N, T):
    """2 bits times bf16 inputs, g dividing 256 or a multiple of it: on avx512-bf16 the codes' bf16 dot-product
    kernel, 256 codes a step (rows_int2_bf16: 8, 4, 2, 1 groups a step, groups of several steps; a shorter last step
    where 256 does not divide K: 2, 1 and 1 groups; 16 rows a block: items of 64, 16 and 6 rows, the last a short
    block), 1..8 inputs on one expert and an input per slot: within the outputs' bf16 rounding of the reference on
    the same inputs in fp32. The path seen on a sum whose
    fp32 result depends on the order (2^100 at code 0, -2^100 at code 16, ones, every weight 1): the step's lanes 0
    and 1 (codes 0..15 and 16..31) absorb their 30 ones and cancel when the lanes are first added, the other ones all
    count (K - 32); the float kernel gives another sum."""
    w, sz, _ = packed_stack_with_codes(2, g, N, K)
    assert_bf16_inputs_close(w, sz, 2, g, T, seed=T + N)
    ones = torch.stack([pack(torch.ones(N, K, dtype=torch.int32), 2)] * 3)
    one_eight = torch.zeros_like(sz)
    one_eight[..., 0], one_eight[..., 1] = 1, 8  # w = (code - 8) * 1 + 8 = 1
    order = torch.ones(1, K)
    order[0, 0], order[0, 16] = 2.0 ** 100, -2.0 ** 100
    lost = kernels.moe_gemv(order.bfloat16(), torch.tensor([[0, 2]]), ones, one_eight, 2, g).float()
    kept = kernels.moe_gemv(order, torch.tensor([[0, 2]]), ones, one_eight, 2, g)
    assert bool((kept > 0).all()), kept
    if isa == "avx512-bf16":
        assert bool((lost == K - 32).all()), lost
        assert not torch.equal(lost, kept.bfloat16().float())
    else:  # the float kernel on both
        assert torch.equal(lost, kept.bfloat16().float())


@pytest.mark.parametrize("g,K", [(32, 96), (64, 1408), (128, 640)])
def test_2bit_last_shorter_step_keeps_to_its_own_inputs(isa, g, K):
    """A 2-bit row's shorter last step (256 not dividing K: avx512-bf16's kernels, AVX2's on 8-bit inputs) sums its
    own codes and inputs only (loaded under a mask, its lanes past K left out of the sums): the next token's inputs
    NaN, the first token's outputs are those of a call without it, bitwise, with bf16 inputs and 8-bit ones where
    the set has them."""
    w, sz, _ = packed_stack_with_codes(2, g, N=32, K=K)
    x = torch.randn(2, K).bfloat16()
    x[1] = float("nan")
    idx = torch.tensor([[0, 2], [1, 0]])
    for int8 in (False, True) if isa in kernels.INT8_DOT_ISAS else (False,):
        kernels.int8_inputs(int8)
        got = kernels.moe_gemv(x, idx, w, sz, 2, g)[0].float()
        want = kernels.moe_gemv(x[:1], idx[:1], w, sz, 2, g)[0].float()
        assert bool(got.isfinite().all())
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    kernels.int8_inputs(False)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("g", [32, 64, 96, 192])
@pytest.mark.parametrize("T", [1, 3, 6, 8])
def test_packed_8bit_inputs_are_exact_integer_dots(int8_inputs, bits, g, T):
    """2/3-bit codes times inputs rounded to 8 bits on vpdpbusd: the integer reference's result (up to the fp32
    scaling per group), for groups of chunk pairs and groups ending in an odd chunk, fp32 and bf16 inputs and
    scales, an input per slot, 1..8 inputs on one expert (on AVX2, 3-bit rows for 6 inputs and more take their codes
    as bytes: groups of 1 and 2 chunks unrolled, 3 and 6 in runs); and within rounding distance of the exact path."""
    assert_8bit_inputs_exact(*packed_stack_with_codes(bits, g), bits, g, T)

@pytest.mark.parametrize("bits,g,K", [(2, 64, 576), (3, 64, 1024), (3, 128, 512), (2, 192, 768), (2, 32, 320),
                                      (2, 32, 256), (2, 64, 512), (2, 128, 1024), (2, 256, 768), (2, 512, 1024),
                                      (2, 64, 1408), (2, 128, 896)])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_packed_8bit_inputs_over_many_groups(int8_inputs, bits, g, K, T):
    """Rows of many groups of whole chunk pairs (taken two groups a step, an odd count leaving one), one and three
    pairs per group, and single-chunk groups: the integer reference's result. 2 bits with g dividing 256 or a
    multiple of it go 256 codes a step (rows_int2_dot256: 8, 4, 2, 1 groups a step, and groups of several steps),
    where 256 does not divide K (576, 320, 1408, 896) with a shorter last step; groups of 192 the per-group way (on
    AVX2 the float kernel on the same rounded inputs)."""
    assert_8bit_inputs_exact(*packed_stack_with_codes(bits, g, 64, K), bits, g, T)


@pytest.mark.parametrize("bits,g,K", [(3, 64, 1024), (3, 96, 192), (3, 32, 32), (2, 64, 512)])
@pytest.mark.parametrize("N", [67, 1])
@pytest.mark.parametrize("T", [1, 3, 7])
def test_packed_8bit_inputs_odd_rows_and_one_chunk_rows(int8_inputs, bits, g, K, N, T):
    """Rows that the few-input kernels take two at a time with one left alone (67 rows: items of 64 and 3; one row),
    one and several pairs per expert (7: the many-input 3-bit rows on AVX2); 3-bit rows of a single chunk (K = 32: its
    12 bytes read apart, since a row may end the allocation) and groups of 1 and 3 chunks: the integer reference's
    result."""
    assert_8bit_inputs_exact(*packed_stack_with_codes(bits, g, N, K), bits, g, T)


@pytest.fixture(params=[True, False], ids=["vbmi", "no-vbmi"])
def avx512_bf16_vbmi(request):
    """The avx512-bf16 set with VBMI's 3-bit kernels (rows_int3_vbmi) and without them (the kernels processors
    lacking VBMI run); skipped where the processor lacks either."""
    if kernels.best_isa() != "avx512-bf16":
        pytest.skip("this processor lacks the avx512-bf16 set")
    if request.param and not kernels.vbmi_supported():
        pytest.skip("this processor lacks AVX512-VBMI")
    before = kernels.isa(), kernels.vbmi()
    kernels.isa("avx512-bf16")
    kernels.vbmi(request.param)
    yield request.param
    kernels.int8_inputs(False)
    kernels.isa(before[0])
    kernels.vbmi(before[1])


def test_vbmi_switch_is_checked_and_follows_the_environment():
    """vbmi(): a non-bool refused; True refused in one line where the processor lacks VBMI, else it and False take
    effect (``moe-zoo kernels`` says so on avx512-bf16); ZOO_KERNEL_VBMI=0 starts a process with it off (on by
    default where the processor has it)."""
    from click.testing import CliRunner

    from zoo.cli import cli

    with pytest.raises(ValueError, match="True, False or None"):
        kernels.vbmi(1)
    before = kernels.vbmi()
    try:
        for on in (False, True) if kernels.vbmi_supported() else (False,):
            kernels.vbmi(on)
            said = CliRunner().invoke(cli, ["kernels"]).output.strip()
            assert said.endswith("; 3-bit rows on VBMI") == (on and kernels.isa() == "avx512-bf16"), said
        assert kernels.vbmi(False) is False and kernels.vbmi() is False
        if kernels.vbmi_supported():
            assert kernels.vbmi(True) is True and kernels.vbmi() is True
        else:
            with pytest.raises(ValueError, match="lacks AVX512-VBMI"):
                kernels.vbmi(True)
    finally:
        kernels.vbmi(before)
    code = "from zoo.moe import kernels; print(kernels.load(), kernels.vbmi(), kernels.vbmi_supported())"
    for value in ("0", None):
        env = {k: v for k, v in os.environ.items() if k != "ZOO_KERNEL_VBMI"}
        if value is not None:
            env["ZOO_KERNEL_VBMI"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        loaded, on, supported = out.stdout.split()
        assert loaded == "True", out.stderr
        assert on == ("False" if value == "0" else supported)


@pytest.mark.parametrize("g,K,N", [(64, 1024, 70), (128, 768, 64), (192, 768, 6), (256, 512, 67), (64, 192, 5)])
@pytest.mark.parametrize("T", [1, 2, 5, 8])
def test_3bit_rows_with_and_without_vbmi(avx512_bf16_vbmi, g, K, N, T):
    """3-bit rows on avx512-bf16, groups a multiple of 64 (one step of 64 codes a group, two, three, four; an odd
    count of groups; items of 64 rows and short ones), with VBMI (rows_int3_vbmi) and without: bf16 inputs within
    the outputs' bf16 rounding of the reference, an input per slot too; 8-bit inputs (their order there, layout 2
    without) the integer reference's result."""
    w, sz, codes = packed_stack_with_codes(3, g, N, K)
    assert_bf16_inputs_close(w, sz, 3, g, T, seed=T + g)
    kernels.int8_inputs(True)
    assert_8bit_inputs_exact(w, sz, codes, 3, g, T)


def test_3bit_vbmi_rows_read_codes_as_one_plus_an_eighth():
    """The path seen, and what it costs: with VBMI a bf16 input's group sum is sum(x (1 + q/8)), the sum of the
    inputs taken off afterwards (scale 8 s, zero term z - 16 s), so its fp32 rounding is that of sums of 8 s sum|x|
    where the table's kernel rounds sums of s sum|x q|. One input of 2^24 on code 0 beside 63 ones on code 1 (s = 1,
    z = 8: w = q): the table's kernel sums 63 exactly (code 0 drops the large input); the VBMI kernel's sums reach
    2^27 (an fp32 unit there: 16) and the result is off by their rounding, under 2^-17 of them."""
    if kernels.best_isa() != "avx512-bf16" or not kernels.vbmi_supported():
        pytest.skip("this processor lacks the avx512-bf16 set with AVX512-VBMI")
    codes = torch.ones(1, 1, 64, dtype=torch.int32)
    codes[..., 0] = 0
    w = pack(codes[0], 3)[None]
    sz = torch.tensor([[[[1.0, 8.0]]]])  # [S, K/g, N, (scale, zero)]
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    x[0, 0] = 2.0 ** 24
    idx = torch.zeros(1, 1, dtype=torch.long)
    before = kernels.isa(), kernels.vbmi()
    try:
        kernels.isa("avx512-bf16")
        kernels.vbmi(False)
        table = float(kernels.moe_gemv(x, idx, w, sz, 3, 64).float())
        kernels.vbmi(True)
        ones = float(kernels.moe_gemv(x, idx, w, sz, 3, 64).float())
    finally:
        kernels.isa(before[0])
        kernels.vbmi(before[1])
    assert table == 63
    assert ones != 63 and abs(ones - 63) < 2 ** 10


@pytest.mark.parametrize("g,K", [(32, 1024), (64, 1280), (64, 512), (128, 768)])
@pytest.mark.parametrize("N", [64, 80, 72, 70])
def test_2bit_8bit_inputs_256_a_step_every_block_of_scales(int8_inputs, g, K, N):
    """2 bits, 256 codes a step: each row's group scales put together by 8 x 8 blocks where the item has 8 rows and 8
    groups to spare, one by one for the rest (32, 20, 8 and 6 groups: whole blocks, whole and partial, one, none;
    items of 64, 16, 8 and 6 rows): the integer reference's result."""
    assert_8bit_inputs_exact(*packed_stack_with_codes(2, g, N, K), 2, g, 3)


@torch.no_grad()
@pytest.mark.parametrize("bits", [4, 8])
def test_8bit_inputs_prefill_uses_the_kernel(int8_inputs, monkeypatch, bits):
    """With 8-bit inputs on (each set that has them), a prompt through int4 or int8 experts (more pairs than the
    few-token limit) takes the kernel up to kernels.INT4_DOT_PAIRS / INT8_DOT_PAIRS (avx2: INT8_DOT_PAIRS_AVX2) pairs
    per expert: each token's output is the one it gets alone (a decode step), within rounding distance of the exact
    path; past that limit the sorted path, and with the option off the exact path (on avx2 int8 experts take the
    kernel's strips there)."""
    from zoo.moe import Routing
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    torch.manual_seed(0)
    experts = SwiGLUExperts(4, 64, 96)
    for p in experts.parameters():
        p.normal_(0, 0.1)
    experts = QuantizedExperts.from_dense(experts, bits, group_size=32)
    vnni = kernels.isa() == "avx512-bf16"
    limit = "INT4_DOT_PAIRS" if bits == 4 else "INT8_DOT_PAIRS" if vnni else "INT8_DOT_PAIRS_AVX2"
    assert kernels.int8_dot_limit("experts", bits, torch.float32) == getattr(kernels, limit)
    # pairs per expert on average past the few-token limit (packed: 4; avx2's 64; Zen 5's int4 16) and within the
    # 8-bit-input one
    stored = next(iter(experts.state_dict().values()))  # int8 weights or int4 codes
    few = kernels.PAIRS_PER_EXPERT[kernels.eager_pairs_key(torch.zeros(1, 64), stored, packed=True)]
    T = 2 * few + 4
    assert few < T * 2 // 4 <= getattr(kernels, limit)
    x, r = torch.randn(T, 64), Routing(torch.rand(T, 2), routing(T, 2, 4, seed=5))
    calls = kernel_calls(monkeypatch)
    got = experts(x, r)
    assert calls == [T, T]  # gate_up, then down
    alone = torch.cat([experts(x[t:t + 1], Routing(r.weights[t:t + 1], r.indices[t:t + 1])) for t in range(T)])
    torch.testing.assert_close(got, alone, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(kernels, limit, T // 2 - 1)
    calls.clear()
    past = experts(x, r)
    assert not calls  # past the limit: the sorted path
    kernels.int8_inputs(False)
    exact = experts(x, r)
    kernels.int8_inputs(True)
    strips = kernels.isa() == "avx2" and bits == 8  # int8 on exact inputs there: the kernel's strips, to 128 pairs
    assert bool(calls) == strips
    tol = 1e-5 if strips else 0.0  # the same products summed in another order
    torch.testing.assert_close(past, exact, rtol=tol, atol=tol)
    assert float((got - exact).norm() / exact.norm()) < 0.02


@torch.no_grad()
@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mlp", [False, True])
def test_2_3bit_experts_read_their_stored_codes_where_listed(int8_inputs, monkeypatch, bits, mlp):
    """Where kernels.STORED_CODES lists (bits, 8-bit inputs) for the set in use, 2/3-bit experts (gated and not) give
    the kernel their stored codes: no int4 working copy is built, the kernel is called with their own width, and the
    outputs are the copy's (the same integer dots per group, summed in another order); elsewhere the copy serves. A
    compiled step past kernels.MAX_TOKENS tokens takes the kernel on the stored codes too (torch's int4 path would
    need the copy). The shipped table: 2-bit with 8-bit inputs on avx2 (exact inputs: the copy), 2-bit with either
    inputs on avx512-bf16."""
    from zoo.moe import Routing
    from zoo.moe.experts import MLPExperts, SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts, QuantizedMLPExperts

    assert kernels.reads_stored_codes(bits) == (kernels.isa() in ("avx2", "avx512-bf16") and bits == 2)
    kernels.int8_inputs(False)
    assert kernels.reads_stored_codes(bits) == (kernels.isa() == "avx512-bf16" and bits == 2)
    kernels.int8_inputs(True)
    torch.manual_seed(0)
    dense = (MLPExperts if mlp else SwiGLUExperts)(4, 64, 96)
    for p in dense.parameters():
        p.normal_(0, 0.1)
    experts = (QuantizedMLPExperts if mlp else QuantizedExperts).from_dense(dense, bits, group_size=32)
    x, r = torch.randn(5, 64), Routing(torch.rand(5, 2), routing(5, 2, 4, seed=3))
    widths, real = [], kernels.moe_gemv
    monkeypatch.setattr(kernels, "moe_gemv", lambda *a, **k: widths.append(a[4]) or real(*a, **k))
    outs = {}
    for listed in (True, False):
        monkeypatch.setattr(kernels, "STORED_CODES", {kernels.isa(): {(bits, True)}} if listed else {})
        experts._kernel_cache.clear()
        widths.clear()
        outs[listed] = experts(x, r)
        assert widths == [bits if listed else 4] * 2
        assert bool(experts._kernel_cache) != listed
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernels, "STORED_CODES", {kernels.isa(): {(bits, True)}})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled step's branch, run eagerly
    experts._kernel_cache.clear()
    widths.clear()
    T = kernels.MAX_TOKENS + 1
    x, r = torch.randn(T, 64), Routing(torch.rand(T, 2), routing(T, 2, 4, seed=4))
    got = experts(x, r)
    assert widths == [bits] * 2 and not experts._kernel_cache
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    # against an eager call on the kernel (the AVX-512 sets' eager limit for packed codes, 4 pairs per expert, would
    # send these tokens to the exact dequantised product instead of the 8-bit inputs)
    with pytest.MonkeyPatch.context() as limits:
        limits.setattr(kernels, "PAIRS_PER_EXPERT", dict.fromkeys(kernels.PAIRS_PER_EXPERT, 10**6))
        limits.setattr(kernels, "STORED_PAIRS_AVX2", dict.fromkeys(kernels.STORED_PAIRS_AVX2, 10**6))
        limits.setattr(kernels, "STORED_PAIRS_ZEN5", dict.fromkeys(kernels.STORED_PAIRS_ZEN5, 10**6))
        widths.clear()
        torch.testing.assert_close(got, experts(x, r), rtol=1e-5, atol=1e-5)
        assert widths == [bits] * 2
    # eager prompts to the kernel's limit for stored codes (kernels.stored_pairs: measured on avx2 and Zen 5's
    # avx512-bf16), then dequantised from the codes: no copy at any length, and past the limit the copy's own
    # dequantised product
    table = {"avx2": kernels.STORED_PAIRS_AVX2, "avx512-bf16": kernels.STORED_PAIRS_ZEN5 if kernels.zen5() else {}}
    assert kernels.stored_pairs(bits) == table.get(kernels.isa(), {}).get((bits, True))
    limit = kernels.stored_pairs(bits) or kernels.PAIRS_PER_EXPERT[
        kernels.eager_pairs_key(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.uint8), packed=True)]
    for T in (2 * limit, 2 * limit + 2):  # 2 slots over 4 experts, all chosen: T / 2 pairs per expert on average
        x, r = torch.randn(T, 64), Routing(torch.rand(T, 2), routing(T, 2, 4, seed=T))
        widths.clear()
        got = experts(x, r)
        assert widths == ([bits] * 2 if T == 2 * limit else []) and not experts._kernel_cache
    monkeypatch.setattr(kernels, "STORED_CODES", {})
    with pytest.MonkeyPatch.context() as limits:  # the copy's kernels left out: its dequantised product
        limits.setattr(kernels, "PAIRS_PER_EXPERT", dict.fromkeys(kernels.PAIRS_PER_EXPERT, 0))
        limits.setattr(kernels, "INT4_DOT_PAIRS", 0)
        limits.setattr(kernels, "INT4_DOT_PAIRS_BF16", 0)
        torch.testing.assert_close(got, experts(x, r), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_prefill_on_8bit_inputs_uses_the_kernel(int8_inputs, monkeypatch, bits, dtype):
    """With 8-bit inputs on, an eager QuantizedLinear call on up to kernels.int8_dot_limit rows (a prompt) takes the
    kernel: each row's output is the one it gets alone (the one-row kernel path), within rounding distance of the
    exact path; one row more takes torch's path (lowbit_linear) as before, as does every call with the option off."""
    from zoo.moe.quantized import lowbit_linear
    from zoo.moe.quantized_linear import QuantizedLinear

    torch.manual_seed(0)
    q = QuantizedLinear.from_linear(torch.nn.Linear(128, 160, bias=True), bits, 64).to(dtype)
    limit = kernels.int8_dot_limit("linear", bits, dtype)
    x = torch.randn(limit + 1, 128, dtype=dtype)

    def torch_path(rows):
        return lowbit_linear(x[:rows], *q.packed, bits, 64, (160, 128)) + q.bias.to(dtype)

    calls = kernel_calls(monkeypatch)
    got = q(x[:limit].view(2, limit // 2, 128)).view(limit, 160)  # leading dimensions are rows
    assert calls == [limit]
    assert torch.equal(got, torch.cat([q(x[t:t + 1]) for t in range(limit)]))
    calls.clear()
    assert torch.equal(q(x), torch_path(limit + 1)) and not calls
    kernels.int8_inputs(False)
    exact = q(x[:limit])
    # with the option off: torch's path, but on the avx2 set the kernel's exact rows up to LINEAR_ROWS_AVX2
    avx2 = kernels.LINEAR_ROWS_AVX2[bits] if kernels.isa() == "avx2" else 0
    assert calls == [n for n in (limit,) if n <= avx2]
    torch.testing.assert_close(exact, torch_path(limit), rtol=0 if limit > avx2 else 1e-5, atol=0 if limit > avx2
                               else (1e-5 if dtype == torch.float32 else 2e-2))
    calls.clear()
    few = q(x[:2])
    assert calls == [n for n in (2,) if n <= avx2]
    torch.testing.assert_close(few, torch_path(2), rtol=0 if not avx2 else 1e-5, atol=0 if not avx2
                               else (1e-5 if dtype == torch.float32 else 2e-2))
    calls.clear()
    kernels.int8_inputs(True)
    assert not torch.equal(got, exact) and float((got - exact).norm() / exact.norm()) < 0.02


def test_int4_8bit_inputs_are_off_by_default_and_ignored_without_int8_dot_products():
    """Off unless asked for (every test that turns 8-bit inputs on turns them off again); switched on, then another
    instruction set: int4 (as int8) gives that set's exact-input result, and asking for 8-bit inputs there is
    refused."""
    if os.environ.get("ZOO_KERNEL_INT8_INPUTS", "0") == "0":
        assert kernels.int8_inputs() is False
    w, s = stack(4, 2, 128, 128, group_size=64)
    x, idx = torch.randn(2, 128), routing(2, 2, 2)
    before = kernels.isa()
    best = kernels.ISAS.index(kernels.best_isa())
    if best < kernels.ISAS.index("avx2"):
        pytest.skip("this processor has no int8 dot products (the avx2 or avx512-bf16 set)")
    try:
        for other in [name for name in ("avx512", "portable") if kernels.ISAS.index(name) <= best]:
            kernels.isa("avx2")  # (every processor with avx512 has it)
            kernels.int8_inputs(True)
            kernels.isa(other)
            on = kernels.moe_gemv(x, idx, w, s, 4, 64)
            kernels.int8_inputs(False)
            assert torch.equal(on, kernels.moe_gemv(x, idx, w, s, 4, 64))
            with pytest.raises(ValueError, match="need int8 dot products"):
                kernels.int8_inputs(True)
    finally:
        kernels.int8_inputs(False)
        kernels.isa(before)


def test_int8_inputs_are_refused_without_int8_dot_products(monkeypatch):
    """Asking for 8-bit inputs on a set without 8-bit dot products is one line, in the API and in the environment
    variable; a value other than 0/1 is refused before anything is built."""
    before = kernels.isa()
    kernels.isa("portable")
    try:
        with pytest.raises(ValueError, match="need int8 dot products .* the kernels use portable"):
            kernels.int8_inputs(True)
        assert kernels.int8_inputs() is False and kernels.int8_inputs(False) is False
    finally:
        kernels.isa(before)
    with pytest.raises(ValueError, match="True, False or None"):
        kernels.int8_inputs(1)
    monkeypatch.setenv("ZOO_KERNEL_INT8_INPUTS", "yes")
    with pytest.raises(ValueError, match="use 1 .* or 0"):
        kernels._asked("ZOO_KERNEL_INT8_INPUTS", "8-bit inputs on int8 dot products")
    code = "from zoo.moe import kernels; print(kernels.load(), kernels.int8_inputs())"
    env = dict(os.environ, ZOO_KERNEL_ISA="portable", ZOO_KERNEL_INT8_INPUTS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[0] == "False" and "needs int8 dot products" in out.stderr, out.stderr


def test_environment_forces_an_instruction_set(monkeypatch):
    """ZOO_KERNEL_ISA picks the set a process uses (``moe-zoo kernels`` says which); a misspelt name is one line
    naming the close ones; a set the processor lacks leaves the kernel off with the reason (never an illegal
    instruction)."""
    env = dict(os.environ, ZOO_KERNEL_ISA="portable", ZOO_KERNEL_STORED_CODES="1")  # and a switch turned on
    out = subprocess.run([sys.executable, "-m", "zoo.cli", "kernels"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"zoo's CPU kernels are ready: instruction set portable (the best this processor "
                                  f"has: {kernels.best_isa()}); 8-bit inputs off; 2/3-bit experts on their stored "
                                  f"codes always")
    monkeypatch.setenv("ZOO_KERNEL_ISA", "avx-512")
    with pytest.raises(ValueError, match="did you mean avx512"):
        kernels._forced_isa()
    monkeypatch.setenv("ZOO_KERNEL_ISA", "AVX2 ")
    assert kernels._forced_isa() == "avx2"
    assert kernels._lacking("avx512-bf16", 1) == ("ZOO_KERNEL_ISA=avx512-bf16 asks for instructions this processor "
                                                  "lacks (it has avx2, portable)")
    assert kernels._lacking("avx2", 1) is None


@pytest.mark.parametrize("env, message", [
    ({"ZOO_KERNEL_ISA": "avx-512"}, "ZOO_KERNEL_ISA='avx-512' is not an instruction set of zoo's kernel; did you mean"),
    ({"ZOO_KERNEL_INT8_INPUTS": "yes"}, "ZOO_KERNEL_INT8_INPUTS='yes': use 1"),
    ({"ZOO_KERNEL_STORED_CODES": "on"}, "ZOO_KERNEL_STORED_CODES='on': use 1"),
    ({"ZOO_KERNEL_VBMI": "no"}, "ZOO_KERNEL_VBMI='no': use 1"),
    ({"ZOO_KERNELS": "0"}, "zoo's CPU kernels are not available: turned off by ZOO_KERNELS=0")])
def test_kernels_command_says_why_not_in_one_line(monkeypatch, env, message):
    """``moe-zoo kernels`` where the kernels cannot load (a fresh load: the process's own stays as it was): exit 1
    and one line, no traceback, nothing built."""
    from click.testing import CliRunner
    from torch.utils import cpp_extension

    from zoo.cli import cli

    monkeypatch.setattr(kernels, "_state", {**kernels._state, "tried": False})
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("a build was started"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["kernels"])
    assert result.exit_code == 1 and result.exception.__class__ is SystemExit, result.output
    assert result.output.startswith("Error: " + message) and result.output.count("\n") == 1, result.output


def test_opcheck():
    w, s = stack(8, 4, 64, 64)
    x, idx = torch.randn(2, 64), routing(2, 2, 4)
    torch.library.opcheck(torch.ops.zoo.moe_gemv.default, (x, idx, w, s, 8, 64, None))


def test_refuses_bad_input():
    w, s = stack(4, 2, 64, 64)
    x, idx = torch.randn(1, 64), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="last dimension"):
        kernels.moe_gemv(torch.randn(1, 32), idx, w, s, 4, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        kernels.moe_gemv(x, idx, w, s, 4, 48)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.moe_gemv(x, idx, w, None, 4, 32)
    with pytest.raises(RuntimeError, match="slot"):
        kernels.moe_gemv(x, idx, w, s, 4, 32, torch.tensor([5]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_compiled_dense_experts_use_the_kernel(dtype):
    """Compiled inference on dense experts calls zoo::moe_gemv (no gather of expert weights) and gives the eager
    sorted dispatch's output (biases, an empty slot with a NaN weight); with the kernel off, the gather path."""
    from zoo.moe import Routing
    from zoo.moe.experts import SwiGLUExperts

    torch.manual_seed(0)
    experts = SwiGLUExperts(4, 64, 96, bias=True).to(dtype)
    for p in experts.parameters():
        p.normal_(0, 0.1)
    x = torch.randn(2, 64).to(dtype)
    indices = torch.tensor([[0, 3], [2, 4]])  # T * k <= E: the gather path compiles too, for the kernel-off run
    weights = torch.tensor([[0.7, 0.3], [1.0, float("nan")]]).to(dtype)
    with kernels.turned_off():  # (eager inference on few tokens takes the kernel too, where it is on)
        eager = experts(x, Routing(weights, indices))
    for off in (False, True):
        ops = []

        def backend(gm, inputs):
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm

        torch._dynamo.reset()
        with kernels.turned_off() if off else torch.no_grad():
            out = torch.compile(lambda x, w, i: experts(x, Routing(w, i)), fullgraph=True, backend=backend)(
                x, weights, indices)
        assert ("zoo.moe_gemv.default" in ops) != off, ops
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, eager, rtol=tol, atol=tol)


def kernel_calls(monkeypatch) -> list:
    calls, real = [], kernels.moe_gemv
    monkeypatch.setattr(kernels, "moe_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    return calls


@pytest.mark.parametrize("kind", ["bf16", "fp32", "int8", "int4"])
def test_eager_inference_on_few_tokens_uses_the_kernel(kind, isa, monkeypatch):
    """Eager inference (a short prompt's prefill, an eager decode step) reads the experts with zoo::moe_gemv up to
    kernels.PAIRS_PER_EXPERT pairs per expert on average (8 for dense weights, 4 for packed, 16 on the avx2 set;
    more for bf16 and int8 ones on bf16 dot products, and on the avx2 set's strips), the sorted dispatch
    past it, with gradients, or with the kernel off; the kernel's output is the sorted dispatch's (on each set)."""
    from zoo.moe import Routing
    from zoo.moe.experts import SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts

    torch.manual_seed(0)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    experts = SwiGLUExperts(4, 64, 96).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    if kind.startswith("int"):
        experts = QuantizedExperts.from_dense(experts, int(kind[3:]), group_size=32)
    # bf16 and int8 experts on bf16 dot products take the kernel further (their tiles)
    dots = kernels.bf16_dot_products(torch.zeros(1, dtype=dtype))
    avx2 = isa == "avx2"
    packed = "packed-avx2" if avx2 else "packed"
    key = {"bf16": "bf16" if dots else ("bf16-avx2" if avx2 else 16), "fp32": 16,
           "int8": "int8" if dots else ("int8-avx2" if avx2 else packed),
           "int4": "packed-zen5" if isa == "avx512-bf16" and kernels.zen5() else packed}[kind]
    limit = kernels.PAIRS_PER_EXPERT[key] * 4 // 2  # tokens at k=2, E=4
    calls = kernel_calls(monkeypatch)
    for T, uses in ((1, True), (limit, True), (limit + 1, False)):
        x = torch.randn(T, 64).to(dtype)
        r = Routing(torch.rand(T, 2).to(dtype), routing(T, 2, 4, seed=T))
        calls.clear()
        with torch.no_grad():
            got = experts(x, r)
        assert bool(calls) == uses and all(n == T for n in calls), (T, calls)
        with torch.no_grad(), kernels.turned_off():
            want = experts(x, r)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    calls.clear()
    x = torch.randn(2, 64, dtype=dtype, requires_grad=True)  # training: the sorted dispatch, which has gradients
    experts(x, Routing(torch.rand(2, 2).to(dtype), routing(2, 2, 4))).sum().backward()
    assert not calls and x.grad is not None


@pytest.mark.parametrize("bits,dtype", [(16, torch.bfloat16), (16, torch.float32), (8, torch.bfloat16),
                                        (4, torch.bfloat16)])
@torch.no_grad()
def test_eager_linear_layers_on_few_rows_use_the_kernel(isa, bits, dtype, monkeypatch):
    """A kernel-read plain linear layer takes zoo::moe_gemv eagerly up to PAIRS_PER_EXPERT[16] rows (the LM head on a
    prompt's last position, an eager decode step), bf16 on bf16 dot products up to PAIRS_PER_EXPERT["bf16"] (a short
    prompt's prefill), bf16 on the avx2 set up to PAIRS_PER_EXPERT["bf16-avx2"] (its strips), a quantized one at one
    row (torch's int8/int4 matmuls win from a few rows on), on the avx2 set up to LINEAR_ROWS_AVX2 rows; all give the
    library path's output."""
    from zoo.moe.kernels import linear
    from zoo.moe.quantized_linear import QuantizedLinear

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(linear, "EAGER_MIN_WEIGHTS", 0)
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 96).to(dtype)
    if bits == 16:
        bf16_dots = kernels.bf16_dot_products(torch.zeros(1, dtype=dtype), dense.weight)
        avx2 = kernels.isa() == "avx2" and dtype == torch.bfloat16  # the strips
        layer, limit = dense, kernels.PAIRS_PER_EXPERT["bf16" if bf16_dots else "bf16-avx2" if avx2 else 16]
        linear.read_linears_with_kernel(layer)
        assert isinstance(layer, linear.KernelLinear)
    else:
        avx2 = kernels.isa() == "avx2" and not kernels.int8_inputs_on()  # exact inputs on the avx2 set: further
        layer = QuantizedLinear.from_linear(dense, bits, group_size=32)
        limit = kernels.LINEAR_ROWS_AVX2[bits] if avx2 else 1
    calls = kernel_calls(monkeypatch)
    for rows, uses in ((1, True), (limit, True), (limit + 1, False)):
        x = torch.randn(1, rows, 64).to(dtype)
        calls.clear()
        got = layer(x)
        assert bool(calls) == uses, (rows, calls)
        with kernels.turned_off():
            torch.testing.assert_close(got, layer(x), rtol=3e-2, atol=3e-2)


@torch.no_grad()
def test_eager_linear_layers_below_the_weight_thresholds_keep_the_library_matmul(monkeypatch):
    """Eagerly, bf16 weights of at least EAGER_MIN_WEIGHTS elements take the kernel (a prefill's key/value projections)
    on bf16 dot products or the avx2 set's strips, and smaller ones (routers) the library's matmul; fp32 ones need
    MIN_WEIGHTS, as compiled steps do."""
    from zoo.moe.kernels import linear

    calls = kernel_calls(monkeypatch)
    for dtype, out_features, uses in ((torch.bfloat16, linear.EAGER_MIN_WEIGHTS // 64, True),
                                      (torch.bfloat16, linear.EAGER_MIN_WEIGHTS // 64 - 1, False),
                                      (torch.float32, linear.EAGER_MIN_WEIGHTS // 64, False),
                                      (torch.float32, linear.MIN_WEIGHTS // 64, True)):
        layer = torch.nn.Linear(64, out_features, bias=False).to(dtype)
        linear.read_linears_with_kernel(layer)
        x = torch.randn(1, 4, 64).to(dtype)
        calls.clear()
        got = layer(x)
        bf16_dots = kernels.bf16_dot_products(x, layer.weight)
        strips = kernels.isa() == "avx2" and dtype == torch.bfloat16
        assert bool(calls) == (uses and (bf16_dots or strips or dtype == torch.float32)), (dtype, out_features, calls)
        with kernels.turned_off():
            torch.testing.assert_close(got, layer(x), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("native", [True, False])
def test_kernel_read_linear_on_many_bf16_rows_multiplies_in_fp32_where_bf16_is_not_native(monkeypatch, native):
    """Past the kernel's rows, a bf16 layer takes torch's product: in bf16 where that is native, else on the weight
    widened to fp32 (an AVX2-only CPU's bf16 products are slow), its output rounded back to bf16 either way."""
    from zoo.moe import cpu_precision
    from zoo.moe.kernels import linear

    monkeypatch.setattr(cpu_precision, "bf16_matmul_is_native", lambda: native)
    real, seen = torch.nn.functional.linear, []
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda a, b, *r: seen.append((a.dtype, b.dtype)) or real(a, b, *r))
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 96).to(torch.bfloat16)
    linear.read_linears_with_kernel(layer)
    x = torch.randn(2, kernels.MAX_TOKENS + 40, 64).to(torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
    product = torch.bfloat16 if native else torch.float32
    assert got.dtype == torch.bfloat16 and seen == [(product, product)]
    torch.testing.assert_close(got.float(), x.float() @ layer.weight.float().t() + layer.bias.float(), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_int4_matches_reference(isa, dtype):
    """Prefill's dequantised int4 weight: the reference's, full blocks of 64 rows and the two-rows-a-byte tail."""
    from zoo.moe.quantized import dequantize

    w, s = stack(4, 1, 160, 128, group_size=64)
    got = kernels.dequantize_int4(w[0], s[0].to(dtype), 64, dtype)
    want = dequantize(4, w[0], s[0].to(dtype), (160, 128), 64)
    assert got.shape == (160, 128) and got.dtype == dtype and got.t().is_contiguous()
    torch.testing.assert_close(got.float(), want, rtol=0 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("g", [8, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_packed_matches_reference(isa, bits, g, dtype):
    """A long prompt's dequantised 2/3-bit weight, read from the stored codes: the reference's, on every instruction
    set, every group size a multiple of 8, fp32 and bf16 outputs and scales; bad input is refused."""
    from zoo.moe.quantized import dequantize

    w, s = stack(bits, 1, 70, 128, group_size=g)
    got = kernels.dequantize_packed(w[0], s[0].to(dtype), bits, g, dtype)
    want = dequantize(bits, w[0], s[0].to(dtype), (70, 128), g)
    assert got.shape == (70, 128) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    torch.library.opcheck(torch.ops.zoo.dequantize_packed.default, (w[0], s[0], bits, g, dtype))
    with pytest.raises(RuntimeError, match="bits must be 2 or 3"):
        kernels.dequantize_packed(w[0], s[0], 4, g, dtype)
    with pytest.raises(RuntimeError, match="multiple of 8 dividing K"):
        kernels.dequantize_packed(w[0], s[0], bits, 12, dtype)
    with pytest.raises(RuntimeError, match="scales"):
        kernels.dequantize_packed(w[0], s[0][:, :-1].contiguous(), bits, g, dtype)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("mlp", [False, True])
def test_stored_codes_switch_keeps_no_working_copy(monkeypatch, bits, mlp):
    """kernels.stored_codes(True): 2/3-bit experts (gated and not) never build their int4 working copy, whatever
    their width (exact inputs here; 8-bit ones: the test above): few tokens go to the kernel on the stored codes, a
    long prompt past the kernel's limit is dequantised from them per call (kernels.dequantize_packed), a training
    call too; outputs and input gradients are the copy's. The kernel's limit for stored codes (kernels.stored_pairs on
    the avx2 set) holds to the pair. Off again, the copy serves. Bad values are refused."""
    from zoo.moe import Routing
    from zoo.moe.experts import MLPExperts, SwiGLUExperts
    from zoo.moe.quantized import QuantizedExperts, QuantizedMLPExperts

    assert kernels.stored_codes() is False
    with pytest.raises(ValueError, match="True, False or None"):
        kernels.stored_codes(1)
    monkeypatch.setattr(kernels, "STORED_CODES", {})  # nothing listed: the switch alone decides
    torch.manual_seed(0)
    dense = (MLPExperts if mlp else SwiGLUExperts)(4, 64, 96)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.1)
    experts = (QuantizedMLPExperts if mlp else QuantizedExperts).from_dense(dense, bits, group_size=32)
    widths, real = [], kernels.moe_gemv
    monkeypatch.setattr(kernels, "moe_gemv", lambda *a, **k: widths.append(a[4]) or real(*a, **k))
    dequantised, real_dq = [], kernels.dequantize_packed
    monkeypatch.setattr(kernels, "dequantize_packed", lambda *a, **k: dequantised.append(a[2]) or real_dq(*a, **k))
    kernels.stored_codes(True)
    limit = kernels.stored_pairs(bits) or kernels.PAIRS_PER_EXPERT[
        kernels.eager_pairs_key(torch.zeros(1, 64), torch.zeros(1, 1, dtype=torch.uint8), packed=True)]
    kernels.stored_codes(False)
    calls = {}
    for T in (5, 2 * limit, 2 * limit + 2):  # 2 slots over 4 experts (all chosen): T / 2 pairs per expert on average
        x, r = torch.randn(T, 64), Routing(torch.rand(T, 2), routing(T, 2, 4, seed=T))
        for on in (True, False):
            kernels.stored_codes(on)
            try:
                experts._kernel_cache.clear()
                widths.clear(), dequantised.clear()
                with torch.no_grad():
                    out = experts(x, r)
                xg = x.clone().requires_grad_(True)
                experts(xg, r).square().sum().backward()
            finally:
                kernels.stored_codes(False)
            calls[T, on] = (list(widths), sorted(set(dequantised)), bool(experts._kernel_cache))
            if on:
                stored_out, stored_grad = out, xg.grad
        torch.testing.assert_close(stored_out, out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stored_grad, xg.grad, rtol=1e-5, atol=1e-5)
    for T in (5, 2 * limit):
        assert calls[T, True] == ([bits] * 2, [bits], False)  # the kernel; the training call dequantised
    assert calls[2 * limit + 2, True] == ([], [bits], False)
    assert all(calls[T, False][1:] == ([], True) for T in (5, 2 * limit, 2 * limit + 2))  # the copy, at every length


@torch.no_grad()
def test_compiled_greedy_reads_linear_layers_with_the_kernel(monkeypatch):
    """zoo.runtime.decode.greedy swaps plain nn.Linear layers to KernelLinear (same state dict, same eager forward); the
    compiled step then reads them with zoo::moe_gemv and, in fp32, gives the eager greedy tokens."""
    from transformers import MixtralConfig, MixtralForCausalLM

    import zoo
    from zoo.runtime.decode import greedy
    from zoo.moe.kernels import linear

    monkeypatch.setattr(linear, "MIN_WEIGHTS", 0)  # the tiny model's layers are far below the real threshold
    cfg = MixtralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    model = zoo.convert(MixtralForCausalLM(cfg)).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    eager = greedy(model, ids, 12, compile=False)
    calls = []
    real = kernels.moe_gemv
    monkeypatch.setattr(kernels, "moe_gemv", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    torch._dynamo.reset()
    compiled = greedy(model, ids, 12)
    assert torch.equal(compiled, eager)
    assert isinstance(model.lm_head, linear.KernelLinear) and isinstance(model.lm_head, torch.nn.Linear)
    assert (1, 128, 64) in calls  # the LM head, as a one-expert stack, traced into the compiled step
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("bits,K,g", [(2, 64, 32), (3, 64, 32), (2, 256, 32), (3, 128, 64), (3, 192, 64)])
def test_packed_rows_read_nothing_past_the_stack(isa, at_unreadable_page, bits, K, g):
    """2/3-bit rows whose stack ends where the process's memory does (the next page unreadable, as past the end of a
    mapped checkpoint): the last row's last step reads its own bytes only, on every set and for bf16 and fp32
    inputs, and 8-bit ones where the set has them (a read past them would end the process; 2 bits at K = 256: a
    step of 256 codes; 3 bits in groups of 64: VBMI's steps of 64 codes, where the processor has it), and the
    result is the reference's."""
    w, sz, _ = packed_stack_with_codes(bits, g, N=16, K=K)
    at_the_end = at_unreadable_page(w)
    idx = torch.tensor([[2, 0]])
    for int8 in (False, True) if isa in kernels.INT8_DOT_ISAS else (False,):
        kernels.int8_inputs(int8)
        for x in (torch.randn(1, K).bfloat16(), torch.randn(1, K)):
            got = kernels.moe_gemv(x, idx, at_the_end, sz, bits, g)
            torch.testing.assert_close(got.float(), kernels.moe_gemv(x, idx, w, sz, bits, g).float(), rtol=0, atol=0)
    kernels.int8_inputs(False)
