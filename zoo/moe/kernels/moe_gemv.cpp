// zoo::moe_gemv: the selected experts' matrix-vector products for a few tokens (decode), reading each selected
// expert's weights once, in place, in their stored form (fp32, bf16, int8 per channel, torch's int4 pack, the
// zoo's dense 2/3-bit packs), dequantising in registers, with threads splitting the output rows.
//
// y[t, j] = W[slot_of[indices[t, j]]] @ x_t   for every token t and routing slot j (x_t: the token's hidden state,
// or its own input per slot); empty slots (index >= number of experts) and experts outside this stack give
// zeros. A SwiGLU expert block is two calls (gate_up, then down on the activated product), with the activation
// and the weighted sum in torch around them (zoo/kernels/__init__.py).
//
// The kernels (moe_gemv_body.h) are compiled four times: AVX-512 with bf16 dot products (vdpbf16ps for bf16
// weights times bf16 inputs), AVX-512, AVX2, and a portable build with GCC's generic vectors (SSE2 on x86-64,
// NEON on ARM64, whatever the target has elsewhere). Only the last is compiled for the baseline; the others sit in
// `#pragma GCC target` regions and run only where the processor reports their instructions, so no path can
// raise an illegal instruction. The set is chosen when the library loads (moe_gemv_isa forces one: tests, and
// ZOO_KERNEL_ISA in zoo/moe/kernels/__init__.py).
#include <algorithm>
#include <atomic>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define ZOO_X86 1
#include <immintrin.h>
#endif

// ZOO_KERNELS_STANDALONE: the kernels and moe_gemv_rows without torch, for tests on processors torch is not installed
// for (tests/kernels_standalone.cpp, run under an emulator, gives at::parallel_for and at::get_num_threads); the torch
// ops below are left out
#ifndef ZOO_KERNELS_STANDALONE
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#endif

namespace zoo_kernels {

enum class Kind { f32, bf16, int8, int4, int2, int3 };

static inline float bf16_to_float(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Scales of one stack, fp32 or bf16: int8 one per row [S, N]; 2/3/4 bits (scale, zero) per group [S, K/g, N, 2].
struct Scales {
  const void* ptr = nullptr;
  bool bf16 = false;
  int64_t N = 0, per_slot = 0;
  float get(int64_t i) const {
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(ptr)[i]) : static_cast<const float*>(ptr)[i];
  }
  float at(int64_t r) const { return get(r); }
  float scale(int64_t gi, int64_t n) const { return get((gi * N + n) * 2); }
  float zero(int64_t gi, int64_t n) const { return get((gi * N + n) * 2 + 1); }
#ifndef ZOO_KERNELS_STANDALONE
  // one matrix's scales (checked by the caller: contiguous float32 or bfloat16), N output rows
  static Scales of(const at::Tensor& scale, int64_t N) {
    Scales r;
    r.ptr = scale.data_ptr();
    r.bf16 = scale.scalar_type() == at::kBFloat16;
    r.N = N;
    return r;
  }
#endif
  Scales of_slot(int64_t s) const {
    Scales r = *this;
    if (ptr) r.ptr = static_cast<const char*>(ptr) + s * per_slot * (bf16 ? 2 : 4);
    return r;
  }
};

struct Problem {
  Kind kind;
  const void* w;           // the stack [S, N, ...]
  int64_t expert_bytes;    // bytes of one expert in the stack
  Scales scales;
  int64_t N, K, g;         // output rows, inputs, group size (2/3/4 bits)
  const float* X;          // inputs [rows, K] in fp32 (2/3 bits: permuted per 32-input chunk; on 8 lanes scaled too)
  const float* SX;         // per-group sums of the inputs [rows, K/g] (2/3/4 bits; with XQ: sums of q)
  const uint16_t* XB;      // the inputs in bf16 [rows, K], for bf16 dot products (null: X serves)
  const uint8_t* XQ;       // the inputs rounded to 8 bits q [rows, K], for int8 dot products (or null): stored
                           // q + 128 for int8 weights, q (as int8_t) for 2/3/4-bit codes (the unsigned operand there);
                           // 2/3 bits: permuted as those kernels read them (3 bits on AVX2: XW for fewer inputs)
  const float* XQS;        // their scales [rows]: x ~ q * scale
  const int16_t* XW;       // 3-bit rows on AVX2 for fewer than INT3_BYTES_FROM inputs (rows_int3_dot): q as 16-bit
                           // words q << (7 - 3 k % 8) [rows, K]
  const float* XS;         // 2/3/4-bit codes on AVX2 with exact inputs: X times 2^S per row [rows, K], for the
                           // kernels that read the codes as subnormals (scaled_for_subnormals), or null
  const float* XSU;        // and 2^(149 - S) per row
  float* Y;                // outputs [T * k, N]
  const int64_t* in_rows;  // per (token, slot) pair, grouped by the stack slot it reads: its input row of X
  const int64_t* out_rows; // and its output row of Y
  int int8_tile_from = 0;  // int8 blocks on bf16 inputs take a tile from this many pairs (0: tile_serves' rule)
  bool int3_vbmi = false;  // 3-bit rows read by rows_int3_vbmi (XB in its layout 5, XQ in order)
};

// The largest |x[k]| of a row and whether it holds a NaN or an infinity, four lanes at a time (a running sum of
// x * 0, which turns NaN at either, was one dependent add per input: ~57% of this preparation's time in a profile
// of small calls). The largest magnitude does not depend on the order; the result is the scalar scan's. K: a
// multiple of 4.
struct LargestMagnitude {
  float largest;
  bool nan_or_inf;
};
static LargestMagnitude largest_magnitude(const float* x, int64_t K) {
  typedef float v4f __attribute__((vector_size(16)));
  typedef int32_t v4i __attribute__((vector_size(16)));
  const v4f finite = {FLT_MAX, FLT_MAX, FLT_MAX, FLT_MAX};
  v4f m4 = {};
  v4i bad4 = {};
  for (int64_t k = 0; k < K; k += 4) {
    v4f v;
    std::memcpy(&v, x + k, sizeof v);
    const v4f a = (v4f)((v4i)v & 0x7fffffff);
    m4 = a > m4 ? a : m4;
    bad4 |= !(a <= finite);  // true (-1) for NaN and infinities
  }
  return {std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3])), (bad4[0] | bad4[1] | bad4[2] | bad4[3]) != 0};
}

// Each group's sum of its g inputs (for the zero terms), eight groups side by side: each group still adds its inputs
// in order, a chain of its own, so the sums are the same bits as one group at a time, where each add waited for the
// one before it (the other ~18% of the preparation's time in that profile)
static void group_sums(const float* x, int64_t G, int64_t g, float* out) {
  int64_t gi = 0;
  for (; gi + 8 <= G; gi += 8) {
    float s[8] = {};
    for (int64_t k = 0; k < g; ++k)
      for (int j = 0; j < 8; ++j) s[j] += x[(gi + j) * g + k];
    std::memcpy(out + gi, s, sizeof s);
  }
  for (; gi < G; ++gi) {
    float sum = 0.f;
    for (int64_t k = 0; k < g; ++k) sum += x[gi * g + k];
    out[gi] = sum;
  }
}

// The inputs for the kernels that read codes as subnormals (block_int4, rows_packed): each row times 2^S, S = 126 - e
// for its largest magnitude in [2^e, 2^(e+1)), so that the row stays below 2^127 and a code's subnormal (c 2^-149)
// times an input is a normal float unless the input is below ~2^-100 of the row's largest; and 2^(149 - S) per row,
// which undoes it. False (the kernels convert the codes instead) where a row holds a NaN or an infinity or its
// largest magnitude is outside [2^-100, 2^101): there 2^S or 2^(149 - S) would leave the floats' range.
static bool scaled_for_subnormals(const float* X, int64_t rows, int64_t K, std::vector<float>& xs,
                                  std::vector<float>& unscale) {
  if (K % 4 != 0) return false;  // (largest_magnitude reads four at a time; groups are multiples of 32)
  xs.resize(rows * K);
  unscale.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * K;
    const LargestMagnitude lm = largest_magnitude(x, K);
    const int e = lm.largest > 0.f ? std::ilogb(lm.largest) : 0;
    if (lm.nan_or_inf || e < -100 || e > 100) return false;
    const int S = 126 - e;  // 26..226: two factors of at most 2^113, each product exact
    const float a = std::ldexp(1.f, S / 2), b = std::ldexp(1.f, S - S / 2);
    for (int64_t k = 0; k < K; ++k) xs[r * K + k] = x[k] * a * b;
    unscale[r] = std::ldexp(1.f, 149 - S);
  }
  return true;
}

// Whether 2-bit rows of K inputs in groups of g go 256 codes a step (rows_int2_dot256, rows_int2_bf16: each 16 inputs
// of a step in one group), a row's last step shorter where 256 does not divide K (K - k a multiple of g there, as g
// divides 256). Such rows had run the per-group or the float kernel instead, at about half the speed (AMD Zen 5,
// [128, 1088] experts, g = 64, one thread, in L2: 42 against 21 ns a row, 8-bit inputs 33 against 17).
static inline bool int2_steps_of_256(int64_t g) { return 256 % g == 0 || g % 256 == 0; }

struct Item {  // rows [r0, r1) of one expert for its np (token, slot) pairs, in_rows / out_rows [first, first + np)
  int64_t slot, r0, r1;
  int np;
  int64_t first;
};

// 8 float lanes (the portable and AVX2 builds): the lane count, a float vector and the 8-bit vectors widened to it
#define ZOO_EIGHT_LANE_TYPES                                \
  constexpr int L = 8;                                      \
  typedef int8_t vi8 __attribute__((vector_size(8)));       \
  typedef uint8_t vu8 __attribute__((vector_size(8)));      \
  typedef float vf __attribute__((vector_size(32)));

// the baseline build: 8 float lanes of GCC's generic vectors, which the compiler maps onto the target's own
// registers (two SSE2 or NEON registers a vector)
namespace portable {
#define ZOO_LANES 8
ZOO_EIGHT_LANE_TYPES
static inline vf to_float(vi8 v) { return __builtin_convertvector(v, vf); }
static inline vf to_float(vu8 v) { return __builtin_convertvector(v, vf); }
static inline void nibbles_to_float(const uint8_t* p, vf& lo, vf& hi) {
  vu8 b;
  std::memcpy(&b, p, sizeof b);
  lo = __builtin_convertvector(vu8(b & 15), vf);
  hi = __builtin_convertvector(vu8(b >> 4), vf);
}
#include "moe_gemv_body.h"
#undef ZOO_LANES
}  // namespace portable

#ifdef ZOO_X86
#define ZOO_X86_PACKED 1  // x86 builds read 2/3-bit rows with AVX2 instructions (every AVX-512 processor has them)
#define ZOO_AVX512_TYPES                                                                                          \
  constexpr int L = 16;                                                                                           \
  typedef int8_t vi8 __attribute__((vector_size(16)));                                                            \
  typedef uint8_t vu8 __attribute__((vector_size(16)));                                                           \
  typedef float vf __attribute__((vector_size(64)));                                                              \
  /* 8-bit lanes to float: GCC's generic conversion of 8-bit vectors comes out scalar, so these are intrinsics */ \
  static inline vf to_float(vi8 v) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)v)); }           \
  static inline vf to_float(vu8 v) { return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)v)); }           \
  /* 16 bytes of int4 codes to floats: each byte widened to a 32-bit lane, then a lookup in a table of 0..15,  */ \
  /* which reads only the low 4 bits of each lane (no mask, no integer-to-float conversion) */                    \
  static inline void nibbles_to_float(const uint8_t* p, vf& lo, vf& hi) {                                         \
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);                    \
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));                                         \
    lo = (vf)_mm512_permutexvar_ps(v, table);                                                                     \
    hi = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);                                               \
  }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
#define ZOO_LANES 16
ZOO_AVX512_TYPES
#include "moe_gemv_body.h"
#undef ZOO_LANES
}  // namespace avx512
#pragma GCC pop_options

#include "tiles.h"

// AVX-512 with bf16 dot products: the same kernels, and bf16 weights times bf16 inputs on vdpbf16ps (products
// exact in fp32, as the widening path's, summed in fp32; only the order of the sums differs); with int8 dot products
// (vpdpbusd: every processor with AVX512-BF16 has AVX512-VNNI) for int8 weights and 2/3/4-bit codes when 8-bit inputs
// are asked for
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16,avx512vnni")
namespace avx512bf16 {
#define ZOO_LANES 16
#define ZOO_BF16_DOT 1
#define ZOO_VNNI 1
#define ZOO_DOT8 1
ZOO_AVX512_TYPES
#include "moe_gemv_body.h"
#undef ZOO_DOT8
#undef ZOO_VNNI
#undef ZOO_BF16_DOT
#undef ZOO_LANES
}  // namespace avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define ZOO_LANES 8
ZOO_EIGHT_LANE_TYPES
static inline vf to_float(vi8 v) { return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)&v))); }
static inline vf to_float(vu8 v) { return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)&v))); }
static inline void nibbles_to_float(const uint8_t* p, vf& lo, vf& hi) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
// 8 bytes of int4 codes as floats without a conversion (block_int4's SUB form): the low nibbles' bits are the
// subnormals lo 2^-149, the high nibbles' masked in place 16 hi 2^-149
static inline void nibbles_as_subnormals(const uint8_t* p, vf& lo, vf& high) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = (vf)_mm256_and_si256(v, _mm256_set1_epi32(0x0f));
  high = (vf)_mm256_and_si256(v, _mm256_set1_epi32(0xf0));
}
// 8 bf16 weights as floats: one widening load and a shift. GCC compiles the body's generic conversion for this set
// into two 128-bit widenings, a byte shift and an insert before the shift (five vector instructions where these are
// two): AMD EPYC Zen 3, bf16 rows, interleaved, one thread in L3 1.20-1.33x, from memory on two 1.06-1.07x at one input
static inline vf widen(const uint16_t* p) {
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}
#define ZOO_WIDEN_BF16 1
#define ZOO_SUBNORMAL_CODES 1  // exact inputs: int4 blocks and 2/3-bit rows read the codes as subnormals
#define ZOO_DOT8 1  // 8-bit inputs on vpmaddubsw / vpmaddwd (int8, int4, 2-bit rows in steps of 256)
#define ZOO_PREFETCH 1  // software prefetch of the weights ahead in decode (moe_gemv_body.h: kPrefetch)
#include "moe_gemv_body.h"

// Seconds of 8 x 4096 fused multiply-adds (8 independent chains) of `w` and `y`: with w a subnormal, they show whether
// this processor multiplies subnormal operands at full speed (AMD Zen 3 does; cores that take a microcode assist for
// them run such products many times slower: an assist per instruction)
static double fma_seconds(float w, float y) {
  const __m256 vw = _mm256_set1_ps(w), vy = _mm256_set1_ps(y);
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 4096; ++i)
    for (auto& a : acc) a = _mm256_fmadd_ps(vw, vy, a);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float sink = 0.f;  // the sums are used: the loop stays
  for (auto& a : acc) sink = sink + _mm256_cvtss_f32(a);
  return seconds;
}
static bool subnormal_fma_at_full_speed() {
  float sub;
  const uint32_t bits = 5;  // 5 x 2^-149
  std::memcpy(&sub, &bits, 4);
  double normal = 1e9, subnormal = 1e9;
  for (int round = 0; round < 3; ++round) {  // the best of three each, taking turns (a noisy machine)
    normal = std::min(normal, fma_seconds(5.f, std::ldexp(1.f, -29)));
    subnormal = std::min(subnormal, fma_seconds(sub, std::ldexp(1.f, 120)));
  }
  return subnormal <= 1.5 * normal;
}
#undef ZOO_PREFETCH
#undef ZOO_WIDEN_BF16
#undef ZOO_SUBNORMAL_CODES
#undef ZOO_DOT8
#undef ZOO_LANES
}  // namespace avx2
#pragma GCC pop_options
#undef ZOO_X86_PACKED
#endif  // ZOO_X86

// 3: AVX-512 with bf16 and int8 dot products, 2: AVX-512, 1: AVX2 (with FMA), 0: portable. Each set needs all
// below it.
static int detect_isa() {
#ifdef ZOO_X86
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return 0;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")))
    return 1;
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") ? 3 : 2;
#else
  return 0;
#endif
}
static int g_isa = detect_isa();

#ifndef ZOO_KERNELS_STANDALONE
// -1: the set in use; 0..3: use that one (refused if the processor lacks it); -2: the best the processor has
int64_t moe_gemv_isa(int64_t want) {
  if (want == -2) return detect_isa();
  if (want >= 0) {
    TORCH_CHECK(want <= detect_isa(), "moe_gemv_isa: this processor does not support instruction set ", want);
    g_isa = int(want);
  }
  return g_isa;
}
#endif

// int8 weights and 2/3/4-bit codes times inputs rounded to 8 bits (one absmax scale per input row), on int8 dot
// products: off unless asked for (it changes the results: the inputs lose precision), and only with the sets that
// have them: 3 (vpdpbusd) and 1 (AVX2's vpmaddubsw; the AVX-512 set without VNNI has neither form here)
static bool g_int8_inputs = false;
static inline bool has_8bit_dots(int isa) { return isa == 3 || isa == 1; }
constexpr int64_t VNNI_MAX_K = 65536;  // |sum| <= K * 255 * 128 stays inside int32 (codes: a group's, K * 15 * 127)

// Exact inputs on the avx2 set: int4 blocks and 2/3-bit rows read the codes as subnormal floats (the same outputs, bit
// for bit) where this processor multiplies subnormal operands at full speed, measured once per process on first use
// (-1 until then)
static std::atomic<int> g_subnormal_codes{-1};
static bool subnormal_codes_on() {
#ifdef ZOO_X86
  if (g_subnormal_codes < 0) g_subnormal_codes = detect_isa() >= 1 && avx2::subnormal_fma_at_full_speed();
  return g_subnormal_codes == 1;
#else
  return false;
#endif
}

// int8 blocks on bf16 inputs take a tile (run_on_tile) from this many pairs; 0: tile_serves' rule. Set by the
// Python side for the processors measured otherwise (zoo.moe.kernels.int8_tile_pairs)
static std::atomic<int> g_int8_tile_from{0};

// 3-bit rows (bf16 and 8-bit inputs) through VBMI's byte permutes (rows_int3_vbmi) where the processor has them;
// moe_gemv_vbmi turns it off (tests of the other kernel) and on again
static bool detect_vbmi() {
#ifdef ZOO_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}
static std::atomic<bool> g_vbmi{detect_vbmi()};

// int8 rows of one input (decode) on the avx512 set's 16 lanes rather than the 256-bit code, on AVX-512 processors.
// Set by the Python side where measured faster (zoo.moe.kernels.int8_wide_rows)
static std::atomic<bool> g_int8_wide_rows{false};

#ifndef ZOO_KERNELS_STANDALONE
// -1: whether one-input int8 rows take 16 lanes; 0 / 1: off / on
int64_t moe_gemv_int8_wide_rows(int64_t want) {
  TORCH_CHECK(want >= -1 && want <= 1, "moe_gemv_int8_wide_rows takes -1, 0 or 1, got ", want);
  if (want >= 0) g_int8_wide_rows = want == 1;
  return g_int8_wide_rows;
}

// -1: whether the AVX-512 sets use VBMI where it has a kernel; 0 / 1: off / on (refused where the processor lacks
// it); -2: whether the processor has it
int64_t moe_gemv_vbmi(int64_t want) {
  TORCH_CHECK(want >= -2 && want <= 1, "moe_gemv_vbmi takes -2, -1, 0 or 1, got ", want);
  if (want == -2) return detect_vbmi();
  TORCH_CHECK(want != 1 || detect_vbmi(), "moe_gemv_vbmi: this processor does not support AVX512-VBMI");
  if (want >= 0) g_vbmi = want == 1;
  return g_vbmi;
}

// -1: the pairs from which int8 blocks take a tile (0: tile_serves' rule); 0: that rule; n >= 1: from n pairs
int64_t moe_gemv_int8_tile_pairs(int64_t want) {
  TORCH_CHECK(want >= -1 && want <= 1 << 20, "moe_gemv_int8_tile_pairs takes -1 or a count, got ", want);
  if (want >= 0) g_int8_tile_from = int(want);
  return g_int8_tile_from;
}

// -1: whether the codes are read as subnormals (measured on first use); 0 / 1: turn it off / on; 2: measure again
int64_t moe_gemv_subnormal_codes(int64_t want) {
  TORCH_CHECK(want >= -1 && want <= 2, "moe_gemv_subnormal_codes takes -1, 0, 1 or 2, got ", want);
  if (want == 0 || want == 1) g_subnormal_codes = int(want);
  if (want == 2) g_subnormal_codes = -1;
  return subnormal_codes_on();
}

// -1: whether they are on; 0 / 1: turn them off / on (on: refused unless the set in use has int8 dot products)
int64_t moe_gemv_int8_inputs(int64_t want) {
  if (want >= 0) {
    TORCH_CHECK(want == 0 || has_8bit_dots(g_isa), "moe_gemv_int8_inputs: 8-bit inputs need int8 dot products "
                "(the avx512-bf16 or avx2 set); the set in use is ", g_isa);
    g_int8_inputs = want == 1;
  }
  return g_int8_inputs;
}
#endif

static void run_all(const Problem& pb, const std::vector<Item>& items) {
#ifdef ZOO_X86
  // int8 weights times fp32 inputs (bf16 ones take bf16 dot products): the 256-bit code, on AVX-512 processors
  // too. Widening 16 int8 lanes to a 512-bit float vector costs more than two 8-lane widenings on the processors
  // measured (AMD EPYC, Zen 4: 17.3 against 27.6 GB/s on the 304M model's experts, 1.15x a compiled sum's bandwidth)
  if (pb.kind == Kind::int8 && !pb.XQ && g_isa >= 2) {
    // with bf16 inputs, items of several inputs take bf16 dot products (measured 1.5-1.7x the 256-bit code at 4-8
    // inputs); one input stays on the 256-bit code, which reads at the machine's bandwidth already
    // (or, where int8_wide_rows is on, the avx512 set's 16 lanes: AMD Zen 5, whose 512-bit units are whole)
    std::vector<Item> several, one, rest;
    for (const Item& it : items)
      (pb.XB && it.np > 1 ? several : it.np == 1 && g_int8_wide_rows ? one : rest).push_back(it);
    if (!several.empty()) avx512bf16::run_items(pb, several);
    if (!one.empty()) avx512::run_items(pb, one);
    if (!rest.empty()) avx2::run_items(pb, rest);
    return;
  }
#endif
  switch (g_isa) {
#ifdef ZOO_X86
    case 3: return avx512bf16::run_items(pb, items);
    case 2: return avx512::run_items(pb, items);
    case 1: return avx2::run_items(pb, items);
#endif
    default: return portable::run_items(pb, items);
  }
}

template <class OUT>
static void dequant_int4_any(const uint8_t* w, const Scales& sc, int64_t N, int64_t K, int64_t g, OUT* wt) {
  switch (g_isa) {
#ifdef ZOO_X86
    case 3: return avx512bf16::dequant_int4(w, sc, N, K, g, wt);
    case 2: return avx512::dequant_int4(w, sc, N, K, g, wt);
    case 1: return avx2::dequant_int4(w, sc, N, K, g, wt);
#endif
    default: return portable::dequant_int4(w, sc, N, K, g, wt);
  }
}

// The input order the 2/3-bit kernels read, per group: its 32-input chunks in pairs, and its odd last chunk (g / 32
// odd) alone. layout 0 (rows_packed, 8 float lanes): chunk c, shift s, lane j <- input 32 c + k8(j, s);
// 1 (rows_packed16, 16 lanes): a pair's shift s, lane j <- lane j % 8 of chunk j / 8; an odd chunk as layout 0;
// 2 (rows_packed_dot, bytes for vpdpbusd): the order of codes_as_bytes' bytes (2 bits: an odd chunk as layout 0).
static int packed_source(int bits, int layout, bool pair, int i) {
  auto k8 = [bits](int j, int s) { return bits == 2 ? 4 * j + s : 8 * (j % 4) + 4 * (j / 4) + s; };
  if (layout == 2 && bits == 3) return i / 16 * 16 + i % 2 * 8 + i % 16 / 2;  // byte 16 l + 2 m + h
  if (!pair) return k8(i % 8, i / 8);
  if (layout == 2) return 4 * (i % 16) + i / 16;  // 2 bits: byte 16 s + j
  return i % 16 / 8 * 32 + k8(i % 8, i / 16);
}

template <class T>
static void permute_for_packed(const T* x, T* out, int64_t K, int64_t g, int bits, int layout) {
  int pair_src[64], odd_src[32];
  for (int i = 0; i < 64; ++i) pair_src[i] = packed_source(bits, layout, true, i);
  for (int i = 0; i < 32; ++i) odd_src[i] = packed_source(bits, layout, false, i);
  for (int64_t g0 = 0; g0 < K; g0 += g) {
    int64_t k = g0;
    for (; layout > 0 && k + 64 <= g0 + g; k += 64)
      for (int i = 0; i < 64; ++i) out[k + i] = x[k + pair_src[i]];
    for (; k < g0 + g; k += 32)
      for (int i = 0; i < 32; ++i) out[k + i] = x[k + odd_src[i]];
  }
}

// What moe_gemv computes once its inputs are checked, on raw pointers (no at:: calls: each costs a dispatch and an
// allocation, ~20 us of a small model's decode step; and the kernels build without torch for other processors'
// tests: tests/kernels_standalone.cpp)
struct Call {
  Kind kind;
  int64_t bits, group_size, T, k, K, N;
  bool per_slot;                  // x: an input per (token, slot) pair [T, k, K], else per token [T, K]
  const void* x;                  // contiguous fp32, or bf16 where x_f32 is false
  bool x_f32;
  const int64_t* indices;         // [T, k]
  std::vector<int64_t> slot_map;  // expert -> stack slot (-1: not in this stack)
  const void* w;                  // the stack [S, N, ...], expert_bytes apart
  int64_t expert_bytes;
  Scales sc;
};

// Y [T, k, N] in fp32 (every row written)
static void moe_gemv_rows(const Call& c, float* Yp) {
  const auto& [kind, bits, group_size, T, k, K, N, per_slot, x, f32, idx, slot_map, w, expert_bytes, sc] = c;
  const int64_t rows = per_slot ? T * k : T, E = int64_t(slot_map.size());
  // bf16 weights, int8 weights, int4 / 3-bit codes and 2-bit codes in steps of 256 times bf16 inputs on bf16 dot
  // products: the inputs are read as they are, 2-bit codes' permuted (codes also need them in fp32, for the
  // per-group sums and the tail rows; int8 for one-input items)
  const bool bf16_dot = g_isa == 3 && !f32 && kind != Kind::f32 &&
                        (kind != Kind::int2 || int2_steps_of_256(group_size));
  // 8-bit inputs: q = round(x / s) in [-127, 127] with s = max|x| / 127 per row, for vpdpbusd's signed operand
  // (2/3/4-bit codes are its unsigned one) or stored q + 128 as its unsigned operand (int8 weights are the signed
  // one; AVX2 takes q as it is, rows_int8_dot there). AVX2 has no 8-bit kernel for 2-bit rows outside steps of 256
  // (groups of 96 or 192 inputs): they run the float kernel on the same q as floats (exact integer sums per group,
  // the outputs times the inputs' scales afterwards), so the results do not depend on the set's kernels.
  const bool int8_dot =
      g_int8_inputs && has_8bit_dots(g_isa) && kind != Kind::f32 && kind != Kind::bf16 && K <= VNNI_MAX_K;
  const bool q_as_float = int8_dot && g_isa == 1 && kind == Kind::int2 && !int2_steps_of_256(group_size);
  std::vector<float> xbuf;
  if (!f32 && !(bf16_dot && kind == Kind::bf16)) {
    xbuf.resize(rows * K);
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < rows * K; ++i) xbuf[i] = bf16_to_float(xb[i]);
  }
  std::vector<float> permuted, sums, qf;
  const float* Xp = f32 ? static_cast<const float*>(x) : xbuf.data();
  const int offset = kind == Kind::int8 && g_isa == 3 ? 128 : 0;
  std::vector<uint8_t> xq(int8_dot ? rows * K : 0);
  std::vector<float> xqs(int8_dot ? rows : 0);
#ifdef ZOO_X86
  for (int64_t r = 0; int8_dot && r < rows; ++r)
    xqs[r] = g_isa == 3 ? avx512bf16::round_to_8_bits(Xp + r * K, K, offset, xq.data() + r * K)
                        : avx2::round_to_8_bits(Xp + r * K, K, offset, xq.data() + r * K);
#endif
  if (q_as_float) {
    qf.resize(rows * K);
    for (int64_t i = 0; i < rows * K; ++i) qf[i] = float(int8_t(xq[i]));
    Xp = qf.data();
  }
  std::vector<uint16_t> xb_permuted;
  if (bf16_dot && kind == Kind::int2 && !int8_dot) {
    // layout 4 (rows_int2_bf16): per 256 inputs (n in a shorter last step), pass j's n / 8 words, word w <- input
    // 8 w + j
    xb_permuted.resize(rows * K);
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k0 = 0; k0 < K; k0 += 256)
        for (int64_t j = 0, n = std::min<int64_t>(256, K - k0); j < 8; ++j)
          for (int64_t i = 0; i < n / 8; ++i) xb_permuted[r * K + k0 + n / 8 * j + i] = xb[r * K + k0 + 8 * i + j];
  }
  // 3-bit rows on VBMI (rows_int3_vbmi): bf16 inputs in layout 5, 8-bit ones in their order
  const bool int3_vbmi = g_isa == 3 && kind == Kind::int3 && (bf16_dot || int8_dot) && g_vbmi && group_size % 64 == 0;
  if (int3_vbmi && !int8_dot) {
    // layout 5 (rows_int3_vbmi): per 64 inputs, word 4 m + j <- input 8 m + j, word 32 + 4 m + j <- 8 m + 4 + j
    xb_permuted.resize(rows * K);
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k0 = r * K; k0 < (r + 1) * K; k0 += 64)
        for (int i = 0; i < 64; ++i) xb_permuted[k0 + i] = xb[k0 + 8 * (i % 32 / 4) + 4 * (i / 32) + i % 4];
  }
  std::vector<uint8_t> xq_permuted;
  std::vector<int16_t> xw;
  if (kind == Kind::int3 && int8_dot && g_isa == 1) {  // (and XQ in layout 2 below, for rows_int3_bytes)
    xw.resize(rows * K);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) xw[r * K + k] = int16_t(int8_t(xq[r * K + k]) * (1 << (7 - (3 * k & 7))));
  }
  if ((kind == Kind::int2 || (kind == Kind::int3 && !int3_vbmi)) && int8_dot && !q_as_float) {
    xq_permuted.resize(rows * K);
    if (kind == Kind::int2 && int2_steps_of_256(group_size)) {
      // layout 3 (rows_int2_dot256): per 256 inputs (n in a shorter last step), pass j's n / 4 bytes, byte i <-
      // input 4 i + j
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k0 = 0; k0 < K; k0 += 256)
          for (int64_t j = 0, n = std::min<int64_t>(256, K - k0); j < 4; ++j)
            for (int64_t i = 0; i < n / 4; ++i) xq_permuted[r * K + k0 + n / 4 * j + i] = xq[r * K + k0 + 4 * i + j];
    } else {
      for (int64_t r = 0; r < rows; ++r)
        permute_for_packed(xq.data() + r * K, xq_permuted.data() + r * K, K, group_size, int(bits), 2);
    }
  } else if ((kind == Kind::int2 || kind == Kind::int3) && !bf16_dot && !int3_vbmi) {  // (bf16 dot products read XB)
    permuted.resize(rows * K);
    const int layout = g_isa >= 2 ? 1 : 0;  // the AVX-512 sets read 16 lanes
    for (int64_t r = 0; r < rows; ++r)
      permute_for_packed(Xp + r * K, permuted.data() + r * K, K, group_size, int(bits), layout);
    // layout 0: each 32-input chunk's shift s (inputs 8 s..8 s + 7) times 2^-(bits s), for the codes masked where
    // they lie (rows_packed_step): exact, powers of two (but for inputs below 2^-117, rounded as subnormals)
    const float down[4] = {1.f, std::ldexp(1.f, -int(bits)), std::ldexp(1.f, -2 * int(bits)),
                           std::ldexp(1.f, -3 * int(bits))};
    for (int64_t c = 0; layout == 0 && c < rows * K; c += 32)
      for (int i = 0; i < 32; ++i) permuted[c + i] *= down[i / 8];
  }
  std::vector<float> subnormal_x, unscale;
  // exact inputs on the avx2 set: int4 blocks and 2/3-bit rows read the codes as subnormals (the inputs as those
  // kernels read them, scaled; under 8-bit inputs the 2-bit rows' float kernel takes q as it is)
  const bool subnormals = (kind == Kind::int4 || kind == Kind::int2 || kind == Kind::int3) && g_isa == 1 &&
                          !int8_dot && subnormal_codes_on() &&
                          scaled_for_subnormals(permuted.empty() ? Xp : permuted.data(), rows, K, subnormal_x, unscale);
  if (bits <= 4) {
    const int64_t G = K / group_size;
    sums.assign(rows * G, 0.f);
    for (int64_t r = 0; r < rows; ++r) {
      if (!int8_dot) {
        group_sums(Xp + r * K, G, group_size, &sums[r * G]);
        continue;
      }
      for (int64_t gi = 0; gi < G; ++gi) {  // sums of q: integers, exact in fp32 (below 2^24)
        int32_t q = 0;
        for (int64_t k2 = 0; k2 < group_size; ++k2) q += int8_t(xq[r * K + gi * group_size + k2]);
        sums[r * G + gi] = float(q);
      }
    }
  }

  // group the (token, slot) pairs by the stack slot they read, then cut each slot's rows into blocks: an item is one
  // block of rows for all the pairs that read it (the kernels take them 8 at a time, the block's later reads from
  // the cache, so each selected expert comes from memory once however many pairs chose it)
  std::map<int64_t, std::vector<int64_t>> pairs_of;
  std::vector<int64_t> unread;  // pairs whose outputs are zeros: empty slots, experts stored elsewhere
  for (int64_t p = 0; p < T * k; ++p) {
    int64_t e = idx[p];
    if (e >= 0 && e < E && slot_map[e] >= 0)
      pairs_of[slot_map[e]].push_back(p);
    else
      unread.push_back(p);
  }
  const int64_t block = 64;
  std::vector<Item> items;
  std::vector<int64_t> in_rows, out_rows;
  for (auto& [slot, pairs] : pairs_of) {
    const int64_t first = int64_t(out_rows.size());
    for (int64_t p : pairs) out_rows.push_back(p), in_rows.push_back(per_slot ? p : p / k);
    for (int64_t r0 = 0; r0 < N; r0 += block)
      items.push_back(Item{slot, r0, std::min(N, r0 + block), int(pairs.size()), first});
  }

  // every row of a read pair is written by exactly one item; the others are zeroed here
  for (int64_t p : unread) std::memset(Yp + p * N, 0, N * sizeof(float));
  Problem pb{kind, w, expert_bytes, sc, N, K, group_size,
             permuted.empty() ? Xp : permuted.data(), sums.empty() ? nullptr : sums.data(),
             xb_permuted.empty() ? (bf16_dot && kind != Kind::int2 ? static_cast<const uint16_t*>(x) : nullptr)
                                 : xb_permuted.data(),
             int8_dot && !q_as_float ? (xq_permuted.empty() ? xq.data() : xq_permuted.data()) : nullptr,
             int8_dot && !q_as_float ? xqs.data() : nullptr, xw.empty() ? nullptr : xw.data(),
             subnormals ? subnormal_x.data() : nullptr, subnormals ? unscale.data() : nullptr, Yp, in_rows.data(),
             out_rows.data()};
  pb.int8_tile_from = g_int8_tile_from;
  pb.int3_vbmi = int3_vbmi;
  run_all(pb, items);
  for (size_t i = 0; q_as_float && i < out_rows.size(); ++i)
    for (int64_t n = 0; n < N; ++n) Yp[out_rows[i] * N + n] *= xqs[in_rows[i]];
}

#ifndef ZOO_KERNELS_STANDALONE
at::Tensor moe_gemv(const at::Tensor& x, const at::Tensor& indices, const at::Tensor& weight,
                    const std::optional<at::Tensor>& scale, int64_t bits, int64_t group_size,
                    const std::optional<at::Tensor>& slot_of) {
  TORCH_CHECK(x.device().is_cpu() && indices.device().is_cpu() && weight.device().is_cpu(),
              "zoo::moe_gemv runs on CPU tensors");
  TORCH_CHECK(indices.dim() == 2 && indices.scalar_type() == at::kLong, "indices must be int64 [T, k]");
  const int64_t T = indices.size(0), k = indices.size(1), K = x.size(-1);
  const bool per_slot = x.dim() == 3;
  TORCH_CHECK((x.dim() == 2 && x.size(0) == T) || (per_slot && x.size(0) == T && x.size(1) == k),
              "x must be [T, K] or [T, k, K] for indices [T, k]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous(), "weight must be a contiguous [S, N, ...] stack");
  const int64_t S = weight.size(0), N = weight.size(1);
  Kind kind;
  int64_t packed_k = K;  // the stored row's last dimension
  if (bits == 16) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
                "16-bit weights must be float32 or bfloat16");
    kind = weight.scalar_type() == at::kFloat ? Kind::f32 : Kind::bf16;
  } else if (bits == 8) {
    TORCH_CHECK(weight.scalar_type() == at::kChar, "8-bit weights must be int8");
    kind = Kind::int8;
  } else {
    TORCH_CHECK(bits == 2 || bits == 3 || bits == 4, "bits must be 16, 8, 4, 3 or 2, got ", bits);
    TORCH_CHECK(weight.scalar_type() == at::kByte, "packed weights must be uint8");
    TORCH_CHECK(group_size >= 32 && group_size % 32 == 0 && K % group_size == 0,
                "group_size must be a multiple of 32 dividing K");
    kind = bits == 4 ? Kind::int4 : bits == 3 ? Kind::int3 : Kind::int2;
    packed_k = K * bits / 8;
    if (bits == 4) TORCH_CHECK(N % 16 == 0, "torch's int4 pack needs N divisible by 16");
  }
  TORCH_CHECK(weight.size(2) == packed_k, "weight's last dimension is ", weight.size(2), ", expected ", packed_k);
  Scales sc;
  if (bits <= 8) {
    TORCH_CHECK(scale.has_value() && scale->is_contiguous(), "quantized weights need contiguous scales");
    TORCH_CHECK(scale->scalar_type() == at::kFloat || scale->scalar_type() == at::kBFloat16,
                "scales must be float32 or bfloat16");
    const int64_t per_slot_n = bits == 8 ? N : K / group_size * N * 2;
    TORCH_CHECK(scale->numel() == S * per_slot_n, "scales have ", scale->numel(), " elements, expected ",
                S * per_slot_n);
    sc.ptr = scale->data_ptr();
    sc.bf16 = scale->scalar_type() == at::kBFloat16;
    sc.N = N;
    sc.per_slot = per_slot_n;
  }
  const int64_t E = slot_of.has_value() ? slot_of->numel() : S;
  std::vector<int64_t> slot_map(E);
  if (slot_of.has_value()) {
    TORCH_CHECK(slot_of->scalar_type() == at::kLong && slot_of->is_contiguous(), "slot_of must be int64");
    std::memcpy(slot_map.data(), slot_of->data_ptr<int64_t>(), E * sizeof(int64_t));
    for (int64_t s : slot_map) TORCH_CHECK(s < S, "slot_of names slot ", s, " of a stack of ", S);
  } else {
    for (int64_t e = 0; e < E; ++e) slot_map[e] = e;
  }

  const bool f32 = x.scalar_type() == at::kFloat;
  const at::Tensor xc = x.contiguous(), ic = indices.contiguous();
  at::Tensor Y = at::empty({T, k, N}, x.options());
  std::vector<float> ybuf(f32 ? 0 : T * k * N);
  float* Yp = f32 ? Y.data_ptr<float>() : ybuf.data();
  const Call call{kind, bits, group_size, T, k, K, N, per_slot, xc.data_ptr(), f32, ic.data_ptr<int64_t>(),
                  std::move(slot_map), weight.data_ptr(), weight.stride(0) * weight.element_size(), sc};
  moe_gemv_rows(call, Yp);
  if (!f32) {  // round to nearest even, NaN kept (as .to() does), in a loop the compiler vectorises
    uint16_t* yb = reinterpret_cast<uint16_t*>(Y.data_ptr());
    for (int64_t i = 0; i < T * k * N; ++i) {
      uint32_t u;
      std::memcpy(&u, &ybuf[i], 4);
      const uint16_t rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
      yb[i] = (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : rounded;
    }
  }
  return Y;
}

// One matrix's (scale, zero) pairs [K/g, N, 2], checked: contiguous float32 / bfloat16 of that size
static Scales group_scales(const at::Tensor& scale, int64_t K, int64_t group_size, int64_t N) {
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == K / group_size * N * 2 &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "scales must be contiguous float32/bfloat16 [K/g, N, 2]");
  return Scales::of(scale, N);
}

// The float weight [N, K] of one int4-packed matrix (torch's CPU pack, scale/zero per group), returned as the
// transpose of a contiguous [K, N]: prefill multiplies many rows, where a dense matmul on the dequantised weight
// beats a low-bit kernel, and the transposed view is what the matmul reads best.
at::Tensor dequantize_int4(const at::Tensor& weight, const at::Tensor& scale, int64_t group_size,
                           at::ScalarType dtype) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "weight must be a contiguous uint8 [N, K/2] int4 pack");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1) * 2;
  TORCH_CHECK(N % 16 == 0 && group_size >= 32 && group_size % 32 == 0 && K % group_size == 0,
              "N must be divisible by 16 and group_size a multiple of 32 dividing K");
  const Scales sc = group_scales(scale, K, group_size, N);
  at::Tensor wt = at::empty({K, N}, weight.options().dtype(dtype));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (dtype == at::kFloat)
    dequant_int4_any(w, sc, N, K, group_size, wt.data_ptr<float>());
  else
    dequant_int4_any(w, sc, N, K, group_size, reinterpret_cast<uint16_t*>(wt.data_ptr()));
  return wt.t();
}
#endif  // ZOO_KERNELS_STANDALONE

template <class OUT>
static void dequant_packed_any(const uint8_t* w, const Scales& sc, int64_t N, int64_t K, int64_t g, int bits,
                               OUT* out) {
  switch (g_isa) {
#ifdef ZOO_X86
    case 3: return avx512bf16::dequant_packed(w, sc, N, K, g, bits, out);
    case 2: return avx512::dequant_packed(w, sc, N, K, g, bits, out);
    case 1: return avx2::dequant_packed(w, sc, N, K, g, bits, out);
#endif
    default: return portable::dequant_packed(w, sc, N, K, g, bits, out);
  }
}

#ifndef ZOO_KERNELS_STANDALONE
// The float weight [N, K] (contiguous) of one 2/3-bit matrix in its stored form: a long prompt's prefill on codes that
// keep no int4 working copy (a dense matmul reads it as fast as dequantize_int4's transposed form: [5632, 1024] fp32,
// 64-256 rows, 2 threads, AMD EPYC Zen 3)
at::Tensor dequantize_packed(const at::Tensor& weight, const at::Tensor& scale, int64_t bits, int64_t group_size,
                             at::ScalarType dtype) {
  TORCH_CHECK(bits == 2 || bits == 3, "bits must be 2 or 3 (int4 packs: dequantize_int4)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(1) * 8 % bits == 0,
              "weight must be a contiguous uint8 [N, K * bits / 8] pack");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1) * 8 / bits;
  TORCH_CHECK(group_size >= 8 && group_size % 8 == 0 && K % group_size == 0,
              "group_size must be a multiple of 8 dividing K");
  const Scales sc = group_scales(scale, K, group_size, N);
  at::Tensor out = at::empty({N, K}, weight.options().dtype(dtype));
  const uint8_t* w = weight.data_ptr<uint8_t>();
  if (dtype == at::kFloat)
    dequant_packed_any(w, sc, N, K, group_size, int(bits), out.data_ptr<float>());
  else
    dequant_packed_any(w, sc, N, K, group_size, int(bits), reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

#include "lowbit_gemm.h"
#endif  // ZOO_KERNELS_STANDALONE

}  // namespace zoo_kernels

#ifndef ZOO_KERNELS_STANDALONE
TORCH_LIBRARY_FRAGMENT(zoo, m) {
  m.def("moe_gemv(Tensor x, Tensor indices, Tensor weight, Tensor? scale, int bits, int group_size, "
        "Tensor? slot_of) -> Tensor");
  m.def("moe_gemv_isa(int want) -> int");
  m.def("moe_gemv_int8_inputs(int want) -> int");
  m.def("moe_gemv_vbmi(int want) -> int");
  m.def("moe_gemv_subnormal_codes(int want) -> int");
  m.def("moe_gemv_int8_tile_pairs(int want) -> int");
  m.def("moe_gemv_int8_wide_rows(int want) -> int");
  m.def("dequantize_int4(Tensor weight, Tensor scale, int group_size, ScalarType dtype) -> Tensor");
  m.def("dequantize_packed(Tensor weight, Tensor scale, int bits, int group_size, ScalarType dtype) -> Tensor");
  m.def("lowbit_gemm(Tensor x, Tensor weight, Tensor scale, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(zoo, CPU, m) {
  m.impl("moe_gemv", &zoo_kernels::moe_gemv);
  m.impl("dequantize_int4", &zoo_kernels::dequantize_int4);
  m.impl("dequantize_packed", &zoo_kernels::dequantize_packed);
  m.impl("lowbit_gemm", &zoo_kernels::lowbit_gemm);
}

TORCH_LIBRARY_IMPL(zoo, CompositeExplicitAutograd, m) {
  m.impl("moe_gemv_isa", &zoo_kernels::moe_gemv_isa);
  m.impl("moe_gemv_int8_inputs", &zoo_kernels::moe_gemv_int8_inputs);
  m.impl("moe_gemv_vbmi", &zoo_kernels::moe_gemv_vbmi);
  m.impl("moe_gemv_subnormal_codes", &zoo_kernels::moe_gemv_subnormal_codes);
  m.impl("moe_gemv_int8_tile_pairs", &zoo_kernels::moe_gemv_int8_tile_pairs);
  m.impl("moe_gemv_int8_wide_rows", &zoo_kernels::moe_gemv_int8_wide_rows);
}
#endif
