"""The zoo's own CPU kernels (C++), for what torch's kernels do slowly: ``zoo::moe_gemv`` reads the selected
experts' stored weights once, in place, for a few tokens (decode), at memory speed.

The library is built from ``moe_gemv.cpp`` with ``torch.utils.cpp_extension`` on first use (about a minute with
two cores; ``moe-zoo kernels`` builds it ahead) and cached in torch's extension folder, rebuilt only when the
source changes. ``load()`` builds or loads it and says whether it is there; ``ready()`` only reads that answer, so
compiled code can branch on it.
The kernels come in four instruction sets (``ISAS``), the best the processor has chosen at load; the environment
variable ``ZOO_KERNEL_ISA`` forces one (``portable`` runs anywhere: SSE2 on x86-64, NEON on ARM64). ``int8_inputs(True)``
(or ``ZOO_KERNEL_INT8_INPUTS=1``) multiplies int8 weights and 2/3/4-bit codes by inputs rounded to 8 bits on int8
dot products (VNNI), an option: faster, and less exact. ``stored_codes(True)`` (or ``ZOO_KERNEL_STORED_CODES=1``)
multiplies 2/3-bit experts in their stored form on every call, where they otherwise keep an int4 working copy
(memory first: the copy takes twice the 2-bit codes' memory). ``ZOO_KERNEL_VBMI=0`` (or ``vbmi(False)``) keeps 3-bit
rows off VBMI's byte permutes, which they take by default where the processor has them.
Where the library cannot be built (no C++ compiler, or ``ZOO_KERNELS=0``), the zoo keeps torch's path and
``unavailable_reason()`` says why.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

SOURCE = Path(__file__).with_name("moe_gemv.cpp")
HEADER = Path(__file__).with_name("moe_gemv_body.h")
TILES_HEADER = Path(__file__).with_name("tiles.h")  # tiles of bf16 pairs (gemm_bf16), included by SOURCE
GEMM_HEADER = Path(__file__).with_name("lowbit_gemm.h")  # zoo::lowbit_gemm (prefill), included by SOURCE
MAX_TOKENS = 8  # a compiled step serves at most this many tokens from the kernel (decode)
# Outside a compiled step the kernel serves a call when its (token, slot) pairs average at most this many per expert:
# each work item is a block of an expert's rows for all the pairs that chose it, so each selected expert is read once
# where a library matmul on a few rows reads at a fraction of the bandwidth. Measured on the 304M benchmark model's
# shapes (2 threads): fp32 experts 3.2x a library matmul at 4 rows, 1.4x at 8, 0.6x at 16 (the widening to fp32 then
# bounds it); packed ones widen their codes per row, so past ~4 rows torch's int8/int4 matmuls win (int8 0.85-1.1x at
# 4 rows, 0.6-0.7x at 8). bf16 experts on bf16 inputs ("bf16": bf16 dot products, and from 8-16 pairs a tile per
# block of rows): the gate_up projections [8 x 5632, 1024] 1.8x torch's matmuls at 4 pairs per expert, 1.3x at 16,
# 1.04-1.13x at 24-48 (one run; the down projections' tiles 1.5-1.9x the rows kernel's from 8 pairs on); the 304M
# model's bf16 prefill at 128 tokens (32 pairs per expert) 0.98x transformers on the kernel, so 24. int8 experts
# on bf16 inputs ("int8", the same tiles): the 304M model's prefill with int8 experts, limit 16 against 4, 1.29 /
# 1.03x transformers bf16 at 32 tokens, 1.12 / 1.05x at 64 (int4 experts: no gain past 4, lowbit_gemm serves them).
# On the avx2 set (no lowbit_gemm tiles, no native bf16 matmul: the alternative is a widened fp32 matmul) packed ones
# go to 16: the 304M model with everything at int4, 16-token prefill 269 -> 77 ms from 4 to 16, 64 tokens 322 -> 253;
# int8 97 -> 85 and 264 -> 267 (AMD EPYC Zen 3, 2 threads, interleaved)
# On the avx2 set bf16 and int8 experts take strips from 8 pairs of a block (16 rows widened to fp32 in the cache,
# 6 inputs at a time: moe_gemv_body.h) and the kernel goes further: the 304M model's prefill against limits 8 / 16
# (the widened fp32 matmul past them), interleaved, 2 threads: bf16 16 tokens 1.19x, 32: 3.28x, 64: 3.14x, 128:
# 2.57-2.66x, 256 (64 pairs per expert): 1.72x; int8 16: 1.22x, 64: 1.73x, 128 (32 pairs): 1.81x.
# Further on the avx2 set (the alternative, each expert dequantised into an fp32 matmul, is slower still): the 304M
# model's prefill, everything quantized, exact inputs, interleaved medians of 5, 2 threads: int4 experts limit 64
# against 16 at 64 / 128 / 256 tokens (16 / 32 / 64 pairs per expert) 1.83 / 2.31 / 1.19x, at 512 tokens the
# kernel 0.94x (so 64); 3-bit experts 1.51 / 1.58 / 1.11x, 2-bit 1.17 / 1.67x at 64 / 128 tokens; int8 experts
# limit 64 against 32 at 128 / 256 tokens 1.21 / 1.74x, 128 against 64 at 512 tokens 1.06x
PAIRS_PER_EXPERT = {16: 8, "bf16": 24, "int8": 16, "packed": 4, "packed-avx2": 64, "bf16-avx2": 64, "int8-avx2": 128,
                    "packed-zen5": 16}
# With 8-bit inputs (int8_inputs(True)) int4 experts take the kernel up to this many pairs per selected expert on
# average, a prompt's prefill too (zoo.moe.quantized): its int8 dot products beat dequantising for a dense matmul
# there (one [5632, 1024] expert, 2 threads: 2.6x at 16 rows, 1.4x at 128 and 256, 0.86x at 512; the 304M model's
# prefill with int4 experts, 8 of them, top-2: 1.7x at 64 tokens, 1.5x at 256, 1.1x at 512, 0.8x at 1024)
INT4_DOT_PAIRS = 128
# With 8-bit inputs, int8 experts' prefill takes the kernel too, up to this many pairs per selected expert on average
# (the 304M model's 8 int8 experts [5632 | 1024], top-2, bf16, 2 threads, against torch's int8 matmuls: 2.2x at 12
# pairs, 1.5x at 16, 1.0x at 20, 0.95x at 24 and 32)
INT8_DOT_PAIRS = 16
# Measured apart on AMD Zen 5 (family 0x1A: 512-bit datapaths) with the avx512-bf16 set, where the rules above were
# measured on another AVX-512 processor. "packed-zen5": exact int4 experts (and 2/3-bit ones on their int4 copies)
# take the kernel up to 16 pairs per expert, not 4: the 304M model's prefill, interleaved, limit 8 / 16 / 32 against
# 4, int4 experts: 16 tokens 1.24 / 1.28 / 1.29x, 32: 1.09 / 1.22 / 1.23x, 64: 1.01 / 1.03 / 1.04x, 128: 1.01 /
# 1.03 / 0.88x (every matrix int4: 1.46 / 1.51 / 1.52x at 16 tokens, the same beyond). ZEN5_INT8_TILE_PAIRS: int8
# blocks on bf16 inputs take the kernel's tiles from 2 pairs (int8_tile_pairs). ZEN5_INT8_WIDE_ROWS: one-input int8
# rows (decode) widen 16 lanes rather than two 8-lane halves (int8_wide_rows): [5632, 1024] experts from memory, 2
# threads, interleaved, at ~57 GB/s of read bandwidth 0.95 of it against 0.78
ZEN5_INT8_TILE_PAIRS = 2
ZEN5_INT8_WIDE_ROWS = True
# On the avx2 set, where torch's int8 product is slow (no VNNI) and the exact alternative is the widened dense
# matmul, int8 experts take the kernel with 8-bit inputs further: the 304M model's prefill (int8 everywhere, 2 threads,
# AMD EPYC Zen 3, interleaved) 2.1x the exact path at 4-8 pairs per expert, 2.3x at 16, 2.0x at 32; against the
# sorted path (each expert dequantised) 1.34x at 32, 1.71x at 64, 1.59x at 128
INT8_DOT_PAIRS_AVX2 = 128
# With 8-bit inputs, an eager ``QuantizedLinear`` call (a prompt's prefill) takes the kernel up to this many rows, per
# width. Measured on the 304M model's [1024 | 256 | 8192, 1024] matrices (bf16, 2 threads), kernel against the eager
# path: int4 (dequantised dense matmul) 3.8-4.8x at 16 rows, 1.2-1.4x at 256, 1.0-1.2x at 512; int8 (torch's int8
# matmuls) 1.3-4.6x at 16 rows, 0.9-2.9x at 32 (the [8192, 1024] LM head about even), 0.8-1.6x at 64
INT8_DOT_ROWS = {4: 256, 8: 32}
# int8 on the avx2 set (torch's int8 product there has no VNNI): [256 | 1024 | 8192, 1024] bf16, 2 threads, AMD EPYC
# Zen 3, interleaved, 8-bit inputs on both paths: 2.8-8.7x at 32 rows, 1.5-3.5x at 128, 1.3-2.5x at 256
INT8_DOT_ROWS_AVX2 = 256
# bf16 inputs: exact int8 / int4 prefill runs on lowbit_gemm's tiles, which beat the int4 dot products from fewer rows
# (304M model's prefill, int4 experts, 8-bit against exact inputs: 1.41 / 1.23x transformers at 16 pairs per expert,
# 1.12 / 1.18 at 32, 0.89 / 1.14 at 64; int4 everywhere at 256 tokens 0.81 / 1.19), so these limits replace
# INT4_DOT_PAIRS and INT8_DOT_ROWS[4] there (int8_dot_limit)
INT4_DOT_PAIRS_BF16 = 24
INT4_DOT_ROWS_BF16 = 32


# On the avx2 set, an eager ``QuantizedLinear`` call on exact inputs (a prompt's prefill) takes the kernel up to this
# many rows, per width: the alternative there dequantises into an fp32 matmul (int4) or runs torch's int8 weight
# product, both slow without AVX-512. The 304M model's [256 | 1024 | 8192, 1024] matrices, 2 threads, AMD EPYC Zen 3,
# interleaved, kernel against that path: int4 bf16 inputs 2.1-9.2x at 16 rows, 1.2-3.6x at 64, 1.1-2.2x at 128,
# 0.88-1.4x at 256 (fp32 inputs: 0.94-2.2x at 128); int8 2.9-8.7x at 16, 1.4-2.8x at 128, 1.1-1.9x at 256
LINEAR_ROWS_AVX2 = {4: 64, 8: 128}


# Where the kernel reads 2/3-bit experts' stored codes, not their int4 working copy: instruction set -> the
# (bits, 8-bit inputs) it does so for. benchmarks/stored_codes.py, the 304M model with 2/3-bit experts (everything else
# bf16), 2 threads, AMD EPYC Zen 3, the two forms taking turns, both decode steps compiled ahead of time, stored
# against copy: 2-bit with 8-bit inputs decode 1.02x, prefill at 16 / 128 tokens 1.06 / 1.20x, the same tokens, and
# no copy (which takes 2x the 2-bit codes' memory); 2-bit exact decode 0.90x (prefill 0.78 / 0.71x), 3-bit with 8-bit
# inputs 0.88x (0.81 / 0.63x), 3-bit exact 0.75x (0.80 / 0.70x). On AMD Zen 5 (avx512-bf16, with stored 3-bit codes on
# bf16 dot products): decode 2-bit exact / 8-bit inputs 0.74 / 0.93x, 3-bit 0.77 / 0.47x; prefill at 16 tokens 0.56 /
# 1.02x and 0.74 / 0.58x, at 128-512 tokens 0.38-0.73x (each expert dequantised per call): the copy serves there.
# With STORED_PAIRS_AVX2 (another run): 2-bit with 8-bit inputs prefill at 256 / 512 tokens 1.21 / 1.52x. 3-bit with
# 8-bit inputs after its rows took 6 inputs and more as bytes (rows_int3_bytes): decode 0.90x, prefill at 16 / 128 /
# 256 / 512 tokens 0.89 / 0.90 / 0.85 / 0.94x (0.75 / 0.67 / 0.80 / 1.04x before, the limit then 64): still the copy.
# Zen 5 again, after 2-bit rows on bf16 dot products (rows_int2_bf16), the VNNI rows' prefetch and the stored codes'
# own lowbit_gemm tiles (past the kernel's limit; each expert had been dequantised per call), three runs: 2-bit with
# 8-bit inputs decode 1.13 / 1.18 / 1.18x, prefill at 16 tokens 1.01 / 0.98 / 1.07x, at 128 / 256 / 512 tokens
# 0.93-0.96 / 0.97 / 0.97-0.99x, the same tokens, and no copy: listed; 2-bit exact decode 0.96 / 1.11 / 1.10x but
# prefill at 16 tokens 0.79-0.92x, 3-bit exact 0.76-0.89x, 3-bit with 8-bit inputs 0.78-0.92x: the copy serves.
# Zen 5, after the AVX-512 2-bit rows went 16 rows at a time (scaled by the stored scales directly, the block ahead
# asked for line by line), three runs: 2-bit exact decode 1.20 / 1.22 / 1.17x, prefill at 16 tokens 0.96 / 1.01 /
# 0.98x, at 128-512 tokens 0.94-1.01x, the same tokens, half the memory: listed too; 2-bit with 8-bit inputs decode
# 1.25 / 1.27 / 1.23x, at 16 tokens 1.10-1.14x; 3-bit exact decode 0.76-0.89x, with 8-bit inputs 0.74-0.90x. After
# the int4 blocks (the copy) loaded 16 rows' scales at once, two runs: exact 2-bit decode 1.04 / 1.23x, prefill
# 0.93-1.01x; 2-bit x int8 decode 1.17 / 1.23x, prefill 0.94-1.02x. After the 3-bit rows took VBMI (rows_int3_vbmi)
# and their 8-bit-input limit went to 16 pairs, two runs: 3-bit with 8-bit inputs decode 1.07 / 1.12x, prefill at 16
# tokens 0.93 / 0.95x, at 128-512 0.89-0.99x; exact 3-bit decode 0.98 / 1.05x, prefill 0.82-0.97x: the copy serves.
STORED_CODES = {"avx2": {(2, True)}, "avx512-bf16": {(2, True), (2, False)}}


# Eager calls on 2/3-bit codes read as stored (reads_stored_codes) on the avx2 set: (bits, 8-bit inputs) -> the most
# (token, slot) pairs per selected expert, on average, the kernel takes (for PAIRS_PER_EXPERT's "packed-avx2"); past
# it each selected expert is dequantised from its codes (dequantize_packed) into a dense matmul. The 304M model with
# 2/3-bit experts, prefill, 2 threads, AMD EPYC Zen 3, the two taking turns, kernel against dequantised: exact 2-bit
# 2.50 / 1.80 / 1.15 / 0.86x at 8 / 16 / 32 / 64 pairs, exact 3-bit 2.13 / 1.76 / 1.08 / 0.87x; 8-bit inputs 2-bit
# 3.86 / 2.84 / 1.91 / 1.54 / 1.40 / 1.23x at 8 / 16 / 32 / 64 / 128 / 256 pairs, 3-bit 2.96 / 2.47 / 1.73 / 1.29 /
# 0.98 / 0.84x; 3-bit since its rows take 6 inputs and more as bytes (two runs) 1.38-1.44 / 1.13-1.21 / 0.94-0.96x
# at 64 / 128 / 256 pairs
STORED_PAIRS_AVX2 = {(2, False): 32, (3, False): 32, (2, True): 256, (3, True): 128}
# The same on AMD Zen 5 (the avx512-bf16 set), where past the limit the codes go through lowbit_gemm's tiles: 8
# experts [5632, 1024], g = 64, 2 threads, the kernel against the tiles (each expert's rows apart), interleaved: exact
# 2-bit 2.07 / 1.28 / 0.96 / 0.68x at 2 / 4 / 8 / 16 pairs, exact 3-bit 1.96 / 1.65 / 1.05 / 0.66x; 8-bit inputs
# 2-bit 2.23 / 1.51 / 1.04 / 0.99 / 0.83x at 4 / 8 / 16 / 32 / 64 pairs, 3-bit 2.07 / 1.06 / 0.63x at 2 / 4 / 8. In
# the 304M model's prefill (the pairs uneven over the experts), against the limit of 16 they had (PAIRS_PER_EXPERT's
# "packed-zen5"), interleaved: exact 2-bit at 8 0.86 / 0.91 / 1.06x at 32 / 48 / 64 tokens (so 16 stays), exact
# 3-bit at 8 0.93 / 1.07 / 1.17x, so 10: 1.01 / 1.06 / 1.06 / 1.17x at 32 / 40 / 48 / 64 tokens; 3-bit x int8 at 4
# 1.17 / 1.35 / 1.36 / 1.44x. After the 2-bit rows went 16 rows at a time: kernel against tiles, exact 2-bit 1.23 /
# 0.87 / 0.64x at 8 / 16 / 32 pairs, 2-bit x int8 1.89 / 1.19 / 0.93 / 0.75x at 8 / 16 / 32 / 64; in the model's
# prefill, 24 against 16: exact 1.00 / 1.00 / 0.84 / 0.79x at 48 / 64 / 80 / 96 tokens (16 stays), x int8 1.01 / 1.00
# / 1.14 / 1.11x, so 24 (32 against 24: 1.00 / 1.05 / 0.98x at 96 / 112 / 128 tokens). After the 3-bit rows took
# VBMI (rows_int3_vbmi): kernel against tiles, 3-bit x int8 3.11 / 2.03 / 1.31 / 0.95 / 0.70x at 2 / 4 / 8 / 16 / 32
# pairs, exact 3-bit 1.83 / 0.96 / 0.75x at 4 / 8 / 16; in the model's prefill, 3-bit x int8 at 12 against 4: 1.85 /
# 1.35 / 1.13 / 1.01x at 16 / 32 / 48 / 64 tokens, 16 against 12: 1.17 / 1.17 / 1.01 / 0.99x at 48 / 64 / 80 / 96, 24
# against 16: 0.98-1.01x at 64-128, so 16; exact 3-bit at 14 against 10: 0.98-1.02x at 16-64 tokens (10 stays)
STORED_PAIRS_ZEN5 = {(2, False): 16, (3, False): 10, (2, True): 24, (3, True): 16}


def stored_pairs(bits: int) -> Optional[int]:
    """An eager call's kernel limit (pairs per selected expert) for ``bits``-wide codes read as stored, where measured
    (``STORED_PAIRS_AVX2``, ``STORED_PAIRS_ZEN5``); None elsewhere (``PAIRS_PER_EXPERT``'s)."""
    if not reads_stored_codes(bits):
        return None
    if _state["isa"] == "avx2":
        return STORED_PAIRS_AVX2.get((bits, _state["int8_inputs"]))
    if _state["isa"] == "avx512-bf16" and zen5():
        return STORED_PAIRS_ZEN5.get((bits, _state["int8_inputs"]))
    return None


def reads_stored_codes(bits: int) -> bool:
    """Whether ``bits``-wide experts are multiplied in their stored form now (``STORED_CODES``, or every 2/3-bit
    width with ``stored_codes(True)``), where 2/3-bit ones otherwise run on an int4 working copy. Reads only the state
    (safe inside compiled code, which guards on it)."""
    return ready() and bits in (2, 3) and (
        _state["stored_codes"] or (bits, _state["int8_inputs"]) in STORED_CODES.get(_state["isa"], ()))


def int8_dot_limit(kind: str, bits: int, dtype: torch.dtype) -> int:
    """How many (token, slot) pairs per expert (kind "experts") or rows (kind "linear") a prefill call on 8-bit inputs
    may have and still take the kernel's int8 dot products, for this width and input dtype."""
    vnni = ready() and isa() == "avx512-bf16"  # also lowbit_gemm's bf16 tiles; else the avx2 set
    if kind == "experts":
        if bits == 8:
            return INT8_DOT_PAIRS if vnni else INT8_DOT_PAIRS_AVX2
        return INT4_DOT_PAIRS_BF16 if vnni and dtype == torch.bfloat16 else INT4_DOT_PAIRS
    if vnni:
        return INT4_DOT_ROWS_BF16 if bits == 4 and dtype == torch.bfloat16 else INT8_DOT_ROWS[bits]
    return INT8_DOT_ROWS_AVX2 if bits == 8 else INT8_DOT_ROWS[bits]


_state: dict = {"tried": False, "reason": "not loaded yet (zoo.moe.kernels.load())", "off": False, "int8_inputs": False,
                "isa": None, "stored_codes": False}


ISAS = ("portable", "avx2", "avx512", "avx512-bf16")  # the kernel's codes 0..3; each needs all before it
INT8_DOT_ISAS = ("avx512-bf16", "avx2")  # the sets with 8-bit dot products (int8_inputs): vpdpbusd, vpmaddubsw


def _forced_isa() -> Optional[str]:
    """The instruction set ZOO_KERNEL_ISA names (None: the best the processor has); a name not in ISAS is an
    error that names the close ones."""
    want = os.environ.get("ZOO_KERNEL_ISA", "").strip().lower()
    if not want:
        return None
    if want not in ISAS:
        import difflib

        close = difflib.get_close_matches(want, ISAS, n=2, cutoff=0.5)
        raise ValueError(f"ZOO_KERNEL_ISA={want!r} is not an instruction set of zoo's kernel"
                         + (f"; did you mean {' or '.join(close)}?" if close else "") + f" (known: {', '.join(ISAS)})")
    return want


def _asked(variable: str, meaning: str, default: str = "0") -> bool:
    """Whether the switch ``variable`` is on ("1") or off ("0"; unset: ``default``); another value is an error."""
    value = os.environ.get(variable, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{variable}={value!r}: use 1 ({meaning}) or 0")
    return value == "1"


def _lacking(forced: str, has: int) -> Optional[str]:
    """Why the forced set cannot run where the processor's best is ISAS[has] (None: it can)."""
    if ISAS.index(forced) <= has:
        return None
    return f"ZOO_KERNEL_ISA={forced} asks for instructions this processor lacks (it has {', '.join(ISAS[:has + 1][::-1])})"


def _build() -> Optional[str]:
    """Build or load the library; None when ``zoo::moe_gemv`` is ready, else why not."""
    if os.environ.get("ZOO_KERNELS", "1") == "0":
        return "turned off by ZOO_KERNELS=0"
    forced = _forced_isa()  # a misspelt name is refused before anything is built
    int8 = _asked("ZOO_KERNEL_INT8_INPUTS", "8-bit inputs on int8 dot products")
    stored = _asked("ZOO_KERNEL_STORED_CODES", "2/3-bit experts multiplied in their stored form, no working copy")
    vbmi_on = _asked("ZOO_KERNEL_VBMI", "3-bit rows on VBMI where the processor has it", default="1")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    # cpp_extension runs ninja from PATH; a venv's ninja (the pip package) sits beside its interpreter
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    try:
        # the name carries a hash of the source and its header: torch's cache rebuilds on a change to the
        # listed source only, and the header holds the kernels
        sources = (SOURCE, HEADER, TILES_HEADER, GEMM_HEADER)
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
        name = f"zoo_moe_gemv_{digest}"
        build = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
        build.mkdir(parents=True, exist_ok=True)
        with _only_builder(build):
            cpp_extension.load(name=name, sources=[str(SOURCE)], is_python_module=False, build_directory=str(build),
                               extra_cflags=["-O3", "-ffp-contract=fast", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as err:  # a compiler error, a missing ninja: the fallback serves
        return f"building {SOURCE.name} failed: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}"
    if forced is not None:
        lacking = _lacking(forced, torch.ops.zoo.moe_gemv_isa(-2))
        if lacking:
            return lacking
        torch.ops.zoo.moe_gemv_isa(ISAS.index(forced))
    _state["isa"] = ISAS[torch.ops.zoo.moe_gemv_isa(-1)]
    if int8:
        if ISAS[torch.ops.zoo.moe_gemv_isa(-1)] not in INT8_DOT_ISAS:
            return (f"ZOO_KERNEL_INT8_INPUTS=1 needs int8 dot products (the {' or '.join(INT8_DOT_ISAS)} set); the set "
                    f"in use is {ISAS[torch.ops.zoo.moe_gemv_isa(-1)]}")
        torch.ops.zoo.moe_gemv_int8_inputs(1)
        _state["int8_inputs"] = True
    _state["stored_codes"] = stored
    if not vbmi_on:
        torch.ops.zoo.moe_gemv_vbmi(0)
    torch.library.register_fake("zoo::moe_gemv")(_fake_moe_gemv)
    torch.library.register_fake("zoo::dequantize_int4")(_fake_dequantize_int4)
    torch.library.register_fake("zoo::dequantize_packed")(_fake_dequantize_packed)
    torch.library.register_fake("zoo::lowbit_gemm")(_fake_lowbit_gemm)
    return None


@contextlib.contextmanager
def _only_builder(build: Path):
    """One zoo process builds at a time, under an OS lock the kernel drops when its holder dies. torch's own build
    lock is a plain file that a build killed half-way (Ctrl-C, a killed test run) leaves behind, and every later
    process would wait on it for ever; under our lock no other builder is alive, so such a file is stale."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    with open(build / ".zoo-builder.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _fake_moe_gemv(x, indices, weight, scale, bits, group_size, slot_of):
    return x.new_empty(indices.shape[0], indices.shape[1], weight.shape[1])


def _fake_dequantize_int4(weight, scale, group_size, dtype):
    return weight.new_empty(weight.shape[1] * 2, weight.shape[0], dtype=dtype).t()


def _fake_lowbit_gemm(x, weight, scale, bits, group_size):
    return x.new_empty(x.shape[0], weight.shape[0])


def lowbit_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int = 64
                ) -> torch.Tensor:
    """``x @ W.T`` for bf16 inputs ``x [M, K]`` (many rows: prefill) and ``W [N, K]`` stored as int8 rows with
    scales ``[N]`` (``bits=8``), or in torch's CPU int4 pack (4) or as 2/3-bit codes packed along each row (2, 3)
    with ``(scale, zero)`` pairs ``[K/g, N, 2]``: each
    64-row block turned into bf16 in a tile that stays in the cache and multiplied there on bf16 dot products. The
    sums a bf16 matmul on the dequantised weight makes, without that weight's bf16 copy in memory (int8's scales
    multiply the fp32 sums: rounded once). Needs the ``avx512-bf16`` set and N divisible by 64
    (``lowbit_gemm_fits``)."""
    return torch.ops.zoo.lowbit_gemm.default(x, weight, scale, bits, group_size)


def lowbit_gemm_fits(x: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether ``lowbit_gemm`` serves this call: the kernels loaded on the set with bf16 dot products, bf16 inputs on
    the CPU, no autograd, whole 64-row blocks, inputs a multiple of 32 (int4, 3, 2 bits: groups of a multiple of
    32)."""
    K = x.shape[-1]
    return (bits in (8, 4, 3, 2) and ready() and not torch.compiler.is_compiling() and x.dtype == torch.bfloat16
            and x.device.type == "cpu" and not torch.is_grad_enabled() and weight.shape[0] % 64 == 0 and K % 32 == 0
            and (bits == 8 or (group_size % 32 == 0 and K % group_size == 0)) and isa() == "avx512-bf16")


def _fake_dequantize_packed(weight, scale, bits, group_size, dtype):
    return weight.new_empty(weight.shape[0], weight.shape[1] * 8 // bits, dtype=dtype)


def dequantize_packed(weight: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``[N, K]`` (contiguous) of one 2/3-bit matrix in its stored form (``zoo.moe.packing.pack``)
    with ``(scale, zero)`` pairs ``[K/g, N, 2]``: a long prompt's prefill on 2/3-bit codes that keep no int4 working
    copy."""
    return torch.ops.zoo.dequantize_packed.default(weight, scale, bits, group_size, dtype)


def dequantize_int4(weight: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The float weight ``[N, K]`` (a transposed view of a contiguous ``[K, N]``) of one matrix in torch's CPU int4
    pack with ``(scale, zero)`` pairs ``[K/g, N, 2]``: for prefill, where a dense matmul on it is faster."""
    return torch.ops.zoo.dequantize_int4.default(weight, scale, group_size, dtype)


def load() -> bool:
    """Build (first time) or load the kernels; whether ``zoo::moe_gemv`` can be used. Warns once if not."""
    if not _state["tried"]:
        _state["tried"] = True
        _state["reason"] = _build()
        if _state["reason"] is not None and os.environ.get("ZOO_KERNELS", "1") != "0":
            warnings.warn(f"zoo's CPU expert kernel is not available ({_state['reason']}); decode uses torch's "
                          "kernels", stacklevel=2)
        if _state["reason"] is None:
            torch.ops.zoo.moe_gemv_int8_tile_pairs(_default_int8_tile_pairs())
            torch.ops.zoo.moe_gemv_int8_wide_rows(int(_default_int8_wide_rows()))
    return _state["reason"] is None


@functools.lru_cache(maxsize=None)
def zen5() -> bool:
    """Whether this is an AMD processor of family 0x1A (Zen 5), whose limits were measured apart (``ZEN5_*``,
    ``PAIRS_PER_EXPERT["packed-zen5"]``)."""
    try:
        with open("/proc/cpuinfo") as f:
            head = f.read(4096)
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in head.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "26"


def _default_int8_tile_pairs() -> int:
    return ZEN5_INT8_TILE_PAIRS if zen5() and best_isa() == "avx512-bf16" else 0


def _default_int8_wide_rows() -> bool:
    return ZEN5_INT8_WIDE_ROWS and zen5() and best_isa() in ("avx512", "avx512-bf16")


def bf16_dot_products(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernel multiplies these bf16 inputs and weights on bf16 dot products (the avx512-bf16 set)."""
    return (ready() and x.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in weights)
            and isa() == "avx512-bf16")


def eager_pairs_key(x: torch.Tensor, *weights: torch.Tensor, packed: bool = False):
    """The key of ``PAIRS_PER_EXPERT`` that bounds an eager call on these inputs and stored weights (experts' and
    ``KernelLinear``'s): bf16 weights, or int8 ones (every width), on bf16 inputs with bf16 dot products go further
    (the tiles); on the avx2 set bf16 weights and int8 ones on exact inputs (the strips), and packed codes."""
    avx2 = ready() and isa() == "avx2"
    if not packed:
        if bf16_dot_products(x, *weights):
            return "bf16"
        return "bf16-avx2" if avx2 and all(w.dtype == torch.bfloat16 for w in weights) else 16
    int8 = any(w.dtype == torch.int8 for w in weights) and not any(w.dtype == torch.uint8 for w in weights)
    if int8 and bf16_dot_products(x):
        return "int8"
    if int8 and avx2 and not int8_inputs_on():
        return "int8-avx2"
    if avx2:
        return "packed-avx2"
    return "packed-zen5" if not int8 and isa() == "avx512-bf16" and zen5() else "packed"


def ready() -> bool:
    """Whether ``load()`` succeeded and the kernels are on (never builds: safe to call inside a compiled step)."""
    return _state["reason"] is None and not _state["off"]


@contextlib.contextmanager
def turned_off():
    """The kernels off for a while: torch's path runs instead (its tests, and the benchmarks' before/after rows).
    Code compiled inside sees it (the compiler guards on it and recompiles)."""
    before = _state["off"]
    _state["off"] = True
    try:
        yield
    finally:
        _state["off"] = before


def unavailable_reason() -> Optional[str]:
    return _state["reason"]


def isa(want: Optional[str] = None) -> str:
    """The instruction set the kernels use (one of ``ISAS``); ``isa("avx2")`` switches to that one (tests;
    RuntimeError where the processor lacks it)."""
    code = torch.ops.zoo.moe_gemv_isa(-1 if want is None else ISAS.index(want))
    _state["isa"] = ISAS[code]
    return ISAS[code]


def int8_inputs(on: Optional[bool] = None) -> bool:
    """Whether int8 weights and 2/3/4-bit codes are multiplied by inputs rounded to 8 bits (one absmax scale per
    input row) on int8 dot products: the kernel's (decode, vpdpbusd; codes per group: exact integer dots scaled in
    fp32; 2/3-bit experts wherever the kernel serves them: few tokens, not a long prompt's prefill) and, for many
    rows of int8 (prefill), torch's int8 matrix product (``torch._int_mm``) on the same rounding. int4 experts'
    prefill takes the kernel itself up to ``INT4_DOT_PAIRS`` pairs per expert (``_int_mm`` has no
    per-group scales: one product per group measured 3-24x slower than the dequantised dense matmul), int8 experts'
    up to ``INT8_DOT_PAIRS``, and quantized linear layers' up to ``INT8_DOT_ROWS`` rows.
    ``int8_inputs(True)`` / ``(False)`` turns that on / off (on: ValueError unless the kernels run a set in
    ``INT8_DOT_ISAS``: ``avx512-bf16`` with vpdpbusd, or ``avx2`` with its 8-bit and 16-bit multiply-adds, where
    2-bit rows in groups of 96 or 192 (outside steps of 256) run the float kernel on the same rounded inputs, the
    same result; another set switched to afterwards ignores it). Off by default: it changes the results
    (``benchmarks/int8_inputs.py`` measures by how much)."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"int8_inputs takes True, False or None, got {on!r}")
    if not load():
        if on:
            raise ValueError(f"zoo's CPU kernel is not available ({unavailable_reason()})")
        return False
    if on and isa() not in INT8_DOT_ISAS:
        raise ValueError(f"8-bit inputs need int8 dot products (the {' or '.join(INT8_DOT_ISAS)} set); the kernels "
                         f"use {isa()} here")
    _state["int8_inputs"] = bool(torch.ops.zoo.moe_gemv_int8_inputs(-1 if on is None else int(on)))
    return _state["int8_inputs"]


def stored_codes(on: Optional[bool] = None) -> bool:
    """Whether 2/3-bit experts are multiplied in their stored form on every call: by the kernel (decode, short
    prompts), dequantised per call past it (long prompts), never through the int4 working copy they otherwise keep.
    Memory first: the copy takes twice the 2-bit codes' memory and 4/3 of the 3-bit ones'; the speeds are
    ``benchmarks/stored_codes.py``'s (at or above the copy where ``STORED_CODES`` lists them, which read so anyway:
    2-bit on the avx512-bf16 set, 2-bit with 8-bit inputs on avx2; elsewhere 0.6-1.1x the copy, prefill the slower).
    ``stored_codes(True)`` / ``(False)`` turns it on / off (on: ValueError where the kernels are unavailable: torch's
    int4 kernels need the copy); off by default. It applies to copies not yet built: set it before the model runs."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"stored_codes takes True, False or None, got {on!r}")
    if on and not load():
        raise ValueError(f"zoo's CPU kernel is not available ({unavailable_reason()}): 2/3-bit experts need their "
                         f"int4 working copy for torch's kernels")
    if on is not None:
        _state["stored_codes"] = on
    return _state["stored_codes"] and ready()


def subnormal_codes(on: Optional[bool] = None) -> bool:
    """Whether the avx2 set's kernels read 2/3/4-bit codes as subnormal floats on exact inputs (no int-to-float
    conversion; the inputs scaled by a power of two per row, so the outputs are the converted codes' bit for bit).
    On where this processor multiplies subnormal operands at full speed, measured once per process on first use
    (cores that take a microcode assist for them would run many times slower); a thread that reads subnormals as zeros
    (``torch.set_flush_denormal(True)``) converts anyway. ``subnormal_codes(True)`` / ``(False)`` forces it (tests,
    measurements); it changes the speed only, not the results (but where an input is below ~2^-100 of its row's
    largest: that product rounds as a subnormal)."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"subnormal_codes takes True, False or None, got {on!r}")
    if not load():
        return False
    return bool(torch.ops.zoo.moe_gemv_subnormal_codes(-1 if on is None else int(on)))


def int8_tile_pairs(pairs: Optional[int] = None) -> int:
    """From how many (token, input) pairs a block of int8 rows on bf16 inputs is multiplied through a tile of bf16
    pairs (several inputs per weight load) rather than row by row; 0: the kernel's rule for bf16 and int8 rows (from
    16 pairs, from 8 where they pass L1). The default is the processor's: from 2 pairs on AMD Zen 5
    (``ZEN5_INT8_TILE_PAIRS``), where tiles beat the rows from there (the 304M model with every matrix int8, prefill
    interleaved, 1.48x at 16 tokens, 1.42x at 32, 1.13x at 64), the rule elsewhere. ``int8_tile_pairs(n)`` sets it
    (tests, measurements); ``-2`` restores the default. The two paths sum the same products in another order."""
    if pairs is not None and (isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < -2):
        raise ValueError(f"int8_tile_pairs takes a count of pairs, 0 (the rule) or -2 (the default), got {pairs!r}")
    if not load():
        return 0
    want = -1 if pairs is None else _default_int8_tile_pairs() if pairs == -2 else pairs
    return int(torch.ops.zoo.moe_gemv_int8_tile_pairs(want))


def int8_wide_rows(on: Optional[bool] = None) -> bool:
    """Whether int8 rows of one input (decode, exact inputs) on an AVX-512 set widen 16 codes a step (the avx512
    set's rows, asking for the weights ~8 KB ahead) rather than two halves of 8 on the 256-bit code. The default is
    the processor's: on for AMD Zen 5 (``ZEN5_INT8_WIDE_ROWS``), whose 512-bit units are whole, off elsewhere (on
    AMD Zen 4 the 256-bit code read 1.6x faster). ``int8_wide_rows(True)`` / ``(False)`` forces it (tests,
    measurements); ``None`` asks. The two sum the same exact products in another order."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"int8_wide_rows takes True, False or None, got {on!r}")
    if not load():
        return False
    return bool(torch.ops.zoo.moe_gemv_int8_wide_rows(-1 if on is None else int(on)))


def vbmi(on: Optional[bool] = None) -> bool:
    """Whether 3-bit rows on the avx512-bf16 set (groups a multiple of 64) take VBMI's byte permutes where the
    processor has them (Ice Lake, AMD Zen 4 and later): ``rows_int3_vbmi``, 64 codes a step placed by ``vpermb`` and
    ``vpmultishiftqb`` (then ``vpternlogd`` for bf16 inputs, a mask for 8-bit ones), where the others look each 32
    codes up in a table. On by default there. ``vbmi(False)`` takes the kernels processors without VBMI
    run (tests, measurements; ``ZOO_KERNEL_VBMI=0`` for a process); ``vbmi(True)`` is refused where the processor
    lacks it; ``None`` asks. With bf16
    inputs each code is read as 1 + q/8, so a group's sum carries the sum of its inputs, taken off afterwards: the
    same result up to fp32 rounding of that larger sum."""
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"vbmi takes True, False or None, got {on!r}")
    if not load():
        return False
    if on and not vbmi_supported():
        raise ValueError("vbmi(True): this processor lacks AVX512-VBMI")
    return bool(torch.ops.zoo.moe_gemv_vbmi(-1 if on is None else int(on)))


def vbmi_supported() -> bool:
    """Whether this processor has AVX512-VBMI (False where the kernel is unavailable)."""
    return load() and bool(torch.ops.zoo.moe_gemv_vbmi(-2))


def int8_inputs_on() -> bool:
    """``int8_inputs()`` without calling into the library (safe inside compiled code, which guards on it)."""
    return _state["int8_inputs"] and ready()


def int8_input_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, K], scale fp32 [n, 1]) with x ~ q * scale: the kernel's rounding of its inputs (absmax / 127 per
    row, x times the scale's reciprocal rounded half to even, clamped to [-127, 127]), for the prefill product."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (xf * scale.reciprocal()).clamp_(-127, 127).round_().to(torch.int8), scale


def best_isa() -> str:
    """The best instruction set this processor has for the kernels."""
    return ISAS[torch.ops.zoo.moe_gemv_isa(-2)]


def moe_gemv(x: torch.Tensor, indices: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor], bits: int,
             group_size: int = 64, slot_of: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y[t, j] = W[slot_of[indices[t, j]]] @ x_t`` -> ``[T, k, N]`` (x: ``[T, K]``, or ``[T, k, K]`` for an input
    per slot). ``weight`` is a stack ``[S, N, ...]`` in a stored form: ``bits=16`` fp32/bf16 ``[S, N, K]``; 8: int8
    ``[S, N, K]`` with scales ``[S, N]``; 4: torch's CPU int4 pack ``[S, N, K/2]``; 3/2: the zoo's dense packs
    ``[S, N, K*bits/8]``; below 8 bits with ``(scale, zero)`` pairs ``[S, K/g, N, 2]`` (w = (q - 8) s + z).
    ``slot_of[e]`` is expert e's slot in the stack, -1 for experts stored elsewhere (their outputs are zeros, as
    are empty slots, index >= number of experts). No autograd: inference only."""
    return torch.ops.zoo.moe_gemv.default(x, indices, weight, scale, bits, group_size, slot_of)


def moe_gemv_reference(x, indices, weight, scale, bits, group_size=64, slot_of=None):
    """The same result from the dequantised weights, one (token, slot) pair at a time: what the kernel is
    tested against."""
    from zoo.moe.packing import dequantize

    T, k = indices.shape
    S, N = weight.shape[:2]
    K = x.shape[-1]
    E = S if slot_of is None else slot_of.numel()
    y = torch.zeros(T, k, N, dtype=torch.float32)
    for t in range(T):
        for j in range(k):
            e = int(indices[t, j])
            s = -1 if not 0 <= e < E else (e if slot_of is None else int(slot_of[e]))
            if s < 0:
                continue
            w = weight[s].float() if bits == 16 else dequantize(bits, weight[s], scale[s], (N, K), group_size)
            xi = x[t, j] if x.dim() == 3 else x[t]
            y[t, j] = w @ xi.float()
    return y.to(x.dtype)


def expert_block(hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, stacks, num_experts: int, glu,
                 gate_up_bias=None, down_bias=None) -> torch.Tensor:
    """A gated expert block for a few tokens on ``zoo::moe_gemv``: ``sum_j w[t, j] down_e(glu(gate_up_e x_t))``.
    ``stacks``: per stored width, ``(gate_up, gate_up_scale, down, down_scale, bits, group_size, slot_of)`` (group_size
    an int, or a pair: gate_up's, down's); with
    several widths each call fills only its own experts' outputs (the others are zeros), so the sums are exact."""
    # g: one group size, or (gate_up's, down's) where the two projections differ (FineQuant's adaptive groups)
    pair = [(g, g) if isinstance(g, int) else tuple(g) for *_, g, _ in stacks]
    # reduce, not sum(): sum() starts from 0, an extra eager pass over the first output (~0.1 ms a call on a 16-token
    # prompt's [16, 2, 5632] gate_up outputs)
    h = functools.reduce(operator.add, (moe_gemv(hidden, indices, gq, gs, bits, g[0], slot)
                                        for (gq, gs, _, _, bits, _, slot), g in zip(stacks, pair)))
    safe = indices.clamp(max=num_experts - 1)
    if gate_up_bias is not None:
        h = h + gate_up_bias[safe].to(h.dtype)
    a = glu(h).contiguous()
    y = functools.reduce(operator.add, (moe_gemv(a, indices, dq, ds, bits, g[1], slot)
                                        for (_, _, dq, ds, bits, _, slot), g in zip(stacks, pair)))
    if down_bias is not None:
        y = y + down_bias[safe].to(y.dtype)
    w = torch.where(indices < num_experts, weights, 0).to(y.dtype)  # empty slots: ignored, even if NaN
    return (y * w[..., None]).sum(1).to(hidden.dtype)
