"""The kernels on a processor this machine's torch is not built for: ARM64 (NEON through GCC's generic vectors, the
portable set). tests/kernels_standalone.cpp builds moe_gemv's kernels without torch (ZOO_KERNELS_STANDALONE) with a
cross compiler, and an emulator runs it: every stored form, fp32 and bf16 inputs, an input per slot, empty slots and
a stack holding some experts, against the same reference as the native tests (kernels.moe_gemv_reference); and
prefill's dequantisers (zoo::dequantize_int4 / dequantize_packed), against the reference dequantisation.
Skipped where the cross compiler or the emulator is missing (the Makefile's system-deps installs both on Debian)."""
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from zoo.moe import kernels

from test_kernels import KINDS, routing, stack

CXX, EMULATOR = "aarch64-linux-gnu-g++", "qemu-aarch64"
pytestmark = pytest.mark.skipif(not (shutil.which(CXX) and shutil.which(EMULATOR)),
                                reason=f"needs {CXX} and {EMULATOR} (Debian: g++-aarch64-linux-gnu, qemu-user)")
SOURCE = Path(__file__).with_name("kernels_standalone.cpp")
KIND_CODES = {(16, torch.float32): 0, (16, torch.bfloat16): 1, 8: 2, 4: 3, 2: 4, 3: 5}  # the kernels' Kind


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The harness built for ARM64 with the optimisations zoo.moe.kernels builds with (static: the emulator needs no
    ARM64 libraries)."""
    out = tmp_path_factory.mktemp("arm64") / "kernels"
    build = subprocess.run([CXX, "-std=c++17", "-O3", "-ffp-contract=fast", "-static", "-pthread", str(SOURCE), "-o",
                            str(out)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    header = out.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and struct.unpack("<H", header[18:20])[0] == 183  # EM_AARCH64
    # the portable set's 8-lane float vectors became NEON's (fused multiply-adds on 4 lanes of a v register)
    code = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(out)], capture_output=True, text=True).stdout
    assert re.search(r"\sfmla\s+v\d+\.4s", code)
    return out


def emulate(program, *parts: bytes, env=None) -> torch.Tensor:
    """The harness's fp32 outputs for one problem (its stdin: the parts)."""
    run = subprocess.run([EMULATOR, str(program)], input=b"".join(parts), capture_output=True, timeout=120,
                         env=None if env is None else {**os.environ, **env})
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    return torch.frombuffer(bytearray(run.stdout), dtype=torch.float32)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def run_arm64(program, x, idx, w, s, bits, group_size, slot_of, env=None):
    kind = KIND_CODES[(bits, w.dtype)] if bits == 16 else KIND_CODES[bits]
    T, k = idx.shape
    S, N = w.shape[:2]
    head = [kind, bits, group_size, T, k, x.shape[-1], N, S, int(x.dim() == 3), int(x.dtype == torch.float32),
            int(s is not None and s.dtype == torch.bfloat16), slot_of.numel()]
    scales = raw(s) if s is not None else b""
    return emulate(program, struct.pack("<13q", 0, *head), raw(x), raw(idx), raw(slot_of), raw(w), scales,
                   env=env).view(T, k, N)


@pytest.mark.parametrize("bits,dtype", KINDS, ids=[f"{b}bit-{str(d)[6:]}" for b, d in KINDS])
def test_arm64_build_matches_reference(program, bits, dtype):
    """N = 160: two full int4 blocks and a 32-row tail; K = 192 in groups of 64; T = 5 tokens, top-2 of 6 experts
    (pairs per expert from 1 up: the kernels' input counts), an empty slot; then per-slot inputs through a stack
    holding 3 of 5 experts (-1: elsewhere, zeros)."""
    S, N, K, k, g = 6, 160, 192, 2, 64
    w, s = stack(bits, S, N, K, group_size=g, dtype=dtype, seed=bits)
    gen = torch.Generator().manual_seed(bits)
    idx = routing(5, k, S, seed=bits, empty=True)
    everyone = torch.arange(S)
    for x in (torch.randn(5, K, generator=gen), torch.randn(5, K, generator=gen).bfloat16()):
        got = run_arm64(program, x, idx, w, s, bits, g, everyone).to(x.dtype)  # (the op's rounding of its outputs)
        want = kernels.moe_gemv_reference(x, idx, w, s, bits, g)
        tol = 1e-4 if x.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        assert got[0, -1].abs().max() == 0  # the empty slot
    slot_of = torch.tensor([0, -1, 2, 1, -1])
    x = torch.randn(5, k, K, generator=gen)
    idx = routing(5, k, 5, seed=bits + 7)
    got = run_arm64(program, x, idx, w[:3], None if s is None else s[:3], bits, g, slot_of)
    want = kernels.moe_gemv_reference(x, idx, w[:3], None if s is None else s[:3], bits, g, slot_of).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,dtype", [(16, torch.bfloat16), (8, torch.bfloat16), (4, torch.bfloat16)])
def test_arm64_items_taken_from_the_back_of_another_threads_run(program, bits, dtype):
    """A thread done with its own run of items takes the others' from their back: with the harness's two threads one
    after the other (ZOO_STANDALONE_IN_ORDER), the first takes all of the second's items that way, one at a time from
    the last (experts read with 1 to 4 pairs, so the runs' work differs), and the outputs are the reference's."""
    S, N, K, k, g = 6, 160, 192, 2, 64
    w, s = stack(bits, S, N, K, group_size=g, dtype=dtype, seed=bits + 1)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(bits + 1))
    idx = routing(5, k, S, seed=bits + 1)
    got = run_arm64(program, x, idx, w, s, bits, g, torch.arange(S), env={"ZOO_STANDALONE_IN_ORDER": "1"})
    want = kernels.moe_gemv_reference(x, idx, w, s, bits, g).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits,g", [(4, 64), (3, 32), (3, 64), (2, 8), (2, 64)])
def test_arm64_dequantisers_match_reference(program, bits, g):
    """One matrix of 160 x 128 (4 bits: two full blocks of 64 rows and the two-rows-a-byte tail) as prefill gets
    it, from fp32 and bf16 scales: the reference's."""
    from zoo.moe.quantized import dequantize

    N, K = 160, 128
    w, s = stack(bits, 1, N, K, group_size=g, seed=bits + g)
    for scale in (s[0], s[0].float()):
        head = struct.pack("<6q", 1, bits, g, N, K, int(scale.dtype == torch.bfloat16))
        got = emulate(program, head, raw(w[0]), raw(scale))
        got = got.view(K, N).t() if bits == 4 else got.view(N, K)
        torch.testing.assert_close(got, dequantize(bits, w[0], scale, (N, K), g), rtol=1e-6, atol=1e-6)
