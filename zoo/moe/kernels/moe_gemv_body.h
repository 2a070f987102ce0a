// The kernels of moe_gemv.cpp, written once with GCC vector types and compiled once per instruction set:
// moe_gemv.cpp includes this file inside a namespace and a `#pragma GCC target` region, with L (the lanes of a
// float vector there: 16 for AVX-512, 8 for AVX2) defined. Each kernel computes output rows [r0, r1) of one
// expert's weight for NP inputs at once, so every weight byte is read once per call however many tokens chose it.

// (vf, vi8, vu8 and to_float, the L-lane float vector and the 8-bit conversions, come from moe_gemv.cpp, as does the
// bf16 widen where a set defines ZOO_WIDEN_BF16)
typedef uint16_t vu16 __attribute__((vector_size(2 * L)));
typedef uint32_t vu32 __attribute__((vector_size(4 * L)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t vw8 __attribute__((vector_size(32)));
typedef int32_t vi32_8 __attribute__((vector_size(32)));
typedef uint8_t vb8 __attribute__((vector_size(8)));

template <class V> static inline V load(const void* p) { V v; std::memcpy(&v, p, sizeof v); return v; }

// horizontal sums as trees of half-vector adds (a scalar chain of L dependent adds costs as much as a row)
static inline float hsum(vf8 v) {
  v4f a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  a += __builtin_shufflevector(a, a, 2, 3, 0, 1);
  return a[0] + a[1];
}
#if ZOO_LANES == 16
static inline float hsum(vf v) {
  return hsum(vf8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}
#endif

// L consecutive weights as floats, dequantised in registers
static inline vf widen(const float* p) { return load<vf>(p); }
#ifndef ZOO_WIDEN_BF16
static inline vf widen(const uint16_t* p) { return (vf)(__builtin_convertvector(load<vu16>(p), vu32) << 16); }
#endif
static inline vf widen(const int8_t* p) { return to_float(load<vi8>(p)); }
static inline float one(float v) { return v; }
static inline float one(uint16_t v) { return bf16_to_float(v); }
static inline float one(int8_t v) { return float(v); }

// Software prefetch of the weights ahead in decode (ZOO_PREFETCH: the avx2 set, where it was measured; on AVX-512
// processors the bf16 rows kernel measured 0.87-0.92x with it at 2-4 pairs per expert)
#ifdef ZOO_PREFETCH
static constexpr bool kPrefetch = true;
#else
static constexpr bool kPrefetch = false;
#endif
// a run of n bytes from p asked for, a cache line at a time (a prefetch never faults, past an allocation too)
static inline void prefetch_bytes(const void* p, int64_t n) {
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}
// How far ahead the weights of one or two inputs are asked for on the AVX-512 sets (AMD Zen 5, measured per kernel
// below: 4 KB and 16 KB within a few percent of it), and that distance in rows of row_bytes
constexpr int64_t kAheadBytes = 8192;
static inline int64_t rows_ahead(int64_t row_bytes) { return (kAheadBytes + row_bytes - 1) / row_bytes; }

// Row-major [N, K] weights (fp32, bf16 or int8 with a per-row scale): a dot product per row and input.
template <int NP, class W>
static void rows_dense(const W* w, const Scales& sc, int64_t K, int64_t r0, int64_t r1, const float* const* xs,
                       float* const* ys) {
  // U independent accumulator chains per input, U * L weights a step: 64 bytes of bf16, 32 of int8 with U = 2;
  // int8 takes U = 4, so that a step reads a cache line too. On 8 lanes (AVX2: 16 registers) int8 rows with several
  // inputs take the largest U whose U NP sums and U widened weights fit in 14: with U = 4 their 4 NP sums spilled
  // from 3 inputs on (AMD EPYC Zen 3, [5632, 1024] experts, interleaved, in L3 on one thread / from memory on two:
  // 4 inputs 1.49 / 1.34x, 5: 1.57 / 1.28x, 6: 1.78 / 1.68x, 7: 2.11 / 1.95x; 3 inputs, U = 3, 0.98 / 1.01x). bf16
  // rows (U = 2) gained nothing from the same rule (U = 1 at 7 inputs: 0.99 / 1.00x)
  constexpr int U = sizeof(W) != 1 ? 2 : L == 8 ? std::max(1, std::min(4, 14 / (NP + 1))) : 4;
  // bf16 and int8 rows, one or two inputs: the row two ahead asked for at each row's start (past the item's rows
  // too). AMD EPYC Zen 3, [5632, 1024] experts from memory, 2 threads, interleaved
  // (runs apart): one input bf16 1.07-1.17x, int8 1.06-1.33x; two inputs bf16 0.99-1.08x, int8 1.03-1.55x. Left out
  // where it lost or was not steady: fp32 rows (0.90-0.98x at one input), four int8 inputs (0.96x), int4 blocks
  // (8 KB ahead: 1.05-1.12x in three runs, 0.98-1.00x in three later ones)
  // int8 rows on 16 lanes (one input on AMD Zen 5, int8_wide_rows) ask for the row ~8 KB ahead instead: [5632, 1024]
  // / [1024, 2816] experts from memory, interleaved, one thread 0.95 / 0.98 of the machine's read bandwidth against
  // 0.79 / 0.86 without (two rows ahead 0.86; two threads at ~40 GB/s: 1.06 / 1.12 against 1.00 / 1.07); a line a step
  // (beside the line read) rather than the row's lines at its start: 1.00 / 1.07x on two threads, 1.03 / 1.05x on
  // one (int8 x int8 rows, rows_int8_dot: 0.98-1.04x, kept as they were)
  constexpr bool wide_int8 = L == 16 && sizeof(W) == 1;
  constexpr bool prefetch = (kPrefetch || wide_int8) && NP <= 2 && sizeof(W) <= 2;
  // Rows longer than 4 KB ask a line a step ~8 KB ahead instead of two rows' lines at once (at 14336 inputs 224 or
  // 448 lines a row: the burst outran what the core keeps in flight). AMD Zen 5 running the avx2 set, 2 threads, from
  // memory, interleaved in one process, bf16 / int8: [4096, 14336] (Mixtral's down projection) 1.28 / 1.74x,
  // [4096, 7168] 1.22 / 1.45x, [2880, 2880] 1.29 / 1.07x; the same form on rows of 2-4 KB 0.86-1.09x (not kept)
  const int64_t ahead = wide_int8 ? rows_ahead(K) : 2;  // rows
  const bool stream = !wide_int8 && K * int64_t(sizeof(W)) > 4096;
  for (int64_t r = r0; r < r1; ++r) {
    const W* wr = w + r * K;
    if constexpr (prefetch && !wide_int8) if (!stream) prefetch_bytes(wr + ahead * K, K * int64_t(sizeof(W)));
    vf a[U][NP];
    for (int u = 0; u < U; ++u)
      for (int p = 0; p < NP; ++p) a[u][p] = vf{};
    int64_t k = 0;
    for (; k + U * L <= K; k += U * L) {
      vf wu[U];
      for (int u = 0; u < U; ++u) wu[u] = widen(wr + k + u * L);
      if constexpr (prefetch && wide_int8) __builtin_prefetch(wr + k + ahead * K);  // a line a step
      if constexpr (prefetch && !wide_int8) if (stream) __builtin_prefetch(wr + k + kAheadBytes / int64_t(sizeof(W)));
      for (int p = 0; p < NP; ++p)
        for (int u = 0; u < U; ++u) a[u][p] += wu[u] * load<vf>(xs[p] + k + u * L);
    }
    for (; k + L <= K; k += L) {
      vf w0 = widen(wr + k);
      for (int p = 0; p < NP; ++p) a[0][p] += w0 * load<vf>(xs[p] + k);
    }
    for (int p = 0; p < NP; ++p) {
      vf t = a[0][p];
      for (int u = 1; u < U; ++u) t += a[u][p];
      float s = hsum(t);
      for (int64_t kk = k; kk < K; ++kk) s += one(wr[kk]) * xs[p][kk];
      ys[p][r] = sc.ptr ? s * sc.at(r) : s;
    }
  }
}

#ifdef ZOO_BF16_DOT
// bf16 weights times bf16 inputs: vdpbf16ps multiplies 32 pairs and adds them into 16 fp32 lanes, so a step
// reads 64 weights (two cache lines) with no widening
template <int NP>
static void rows_bf16_dot(const uint16_t* w, int64_t K, int64_t r0, int64_t r1, const uint16_t* const* xs,
                          float* const* ys) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* wr = w + r * K;
    __m512 a[2][NP];
    for (int p = 0; p < NP; ++p) a[0][p] = a[1][p] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
      for (int p = 0; p < NP; ++p) {
        a[0][p] = _mm512_dpbf16_ps(a[0][p], w0, (__m512bh)_mm512_loadu_si512(xs[p] + k));
        a[1][p] = _mm512_dpbf16_ps(a[1][p], w1, (__m512bh)_mm512_loadu_si512(xs[p] + k + 32));
      }
    }
    if (k < K) {  // the last 1..63 inputs: masked loads read zeros past the row's end
      const int64_t n0 = std::min<int64_t>(32, K - k), n1 = K - k - n0;
      const __mmask32 m0 = n0 == 32 ? ~__mmask32(0) : (__mmask32(1) << n0) - 1, m1 = (__mmask32(1) << n1) - 1;
      const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, wr + k);
      const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, wr + k + 32);
      for (int p = 0; p < NP; ++p) {
        a[0][p] = _mm512_dpbf16_ps(a[0][p], w0, (__m512bh)_mm512_maskz_loadu_epi16(m0, xs[p] + k));
        a[1][p] = _mm512_dpbf16_ps(a[1][p], w1, (__m512bh)_mm512_maskz_loadu_epi16(m1, xs[p] + k + 32));
      }
    }
    for (int p = 0; p < NP; ++p) ys[p][r] = _mm512_reduce_add_ps(_mm512_add_ps(a[0][p], a[1][p]));
  }
}
#endif

#ifdef ZOO_DOT8
// 8-bit dot products (ZOO_DOT8: the avx512-bf16 set's vpdpbusd, or AVX2's multiply-adds): acc plus, in each 32-bit
// lane, the four products of adjacent unsigned bytes u and signed bytes s. AVX2: vpmaddubsw sums product pairs into
// 16 bits (saturating: the callers' operands, codes <= 15 times |q| <= 127, stay below 2^15) and vpmaddwd the pairs.
static inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#ifdef ZOO_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
#endif

#if defined(ZOO_DOT8) && !defined(ZOO_VNNI)
// The AVX2 forms of round_to_8_bits and rows_int8_dot (below, for the set with vpdpbusd). Rounding: the same
// arithmetic 8 lanes at a time (max over |x| keeping the running max on a NaN, clamp, round half to even).
static float round_to_8_bits(const float* x, int64_t K, int offset, uint8_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), magnitude), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  // each 32-bit lane's low byte, to the low 4 bytes of each 128-bit half, then the halves' words together
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (k = 0; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv), lo), hi);
    const __m256i r = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(offset));
    const __m256i b =
        _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(r, low_bytes), _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), _mm256_castsi256_si128(b));
  }
  for (; k < K; ++k) q[k] = uint8_t(int(std::nearbyint(std::min(127.f, std::max(-127.f, x[k] * inv)))) + offset);
  return s;
}

static inline int32_t hsum_epi32(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1)));
}

// int8 weights times 8-bit inputs q (signed, stored as they are: offset 0 on this set): vpmaddubsw takes |w| as its
// unsigned operand and q with w's sign (vpsignb) as its signed one, so |pair sums| <= 2 * 128 * 127 never saturate
template <int NP>
static void rows_int8_dot(const int8_t* w, const Scales& sc, int64_t K, int64_t r0, int64_t r1,
                          const uint8_t* const* xs, const float* xscale, float* const* ys) {
  const __m256i ones = _mm256_set1_epi16(1);
  // one or two inputs: the row two ahead asked for, as rows_dense does (AMD EPYC Zen 3, [5632, 1024] experts from
  // memory, 2 threads, interleaved: 1.11x at one input, 1.18x at two)
  // rows longer than 4 KB a line a step ~8 KB ahead, as rows_dense asks (AMD Zen 5, 2 threads, from memory,
  // interleaved: [4096, 14336] 1.51x, [4096, 7168] 1.27x, [2880, 2880] 1.01x)
  constexpr bool prefetch = kPrefetch && NP <= 2;
  const bool stream = K > 4096;
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* wr = w + r * K;
    if constexpr (prefetch) if (!stream) prefetch_bytes(wr + 2 * K, K);
    __m256i a[NP];
    for (int p = 0; p < NP; ++p) a[p] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      if constexpr (prefetch) if (stream) __builtin_prefetch(wr + k + kAheadBytes);
      const __m256i wv = load<__m256i>(wr + k), magnitude = _mm256_abs_epi8(wv);
      for (int p = 0; p < NP; ++p) {
        const __m256i signed_q = _mm256_sign_epi8(load<__m256i>(xs[p] + k), wv);
        a[p] = _mm256_add_epi32(a[p], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), ones));
      }
    }
    const float row_scale = sc.ptr ? sc.at(r) : 1.f;
    for (int p = 0; p < NP; ++p) {
      int32_t total = hsum_epi32(a[p]);
      for (int64_t j = k; j < K; ++j) total += int32_t(int8_t(xs[p][j])) * wr[j];
      ys[p][r] = float(total) * xscale[p] * row_scale;
    }
  }
}
#endif

#ifdef ZOO_VNNI
// One input row rounded to 8 bits for the int8 dot products: q = round(x / s) (half to even) in [-127, 127] with
// s = max|x| / 127 (1 for a row of zeros), stored q + offset; returns s. Vectorised: the scalar loop of the baseline
// build (a library call per rounding) took 15-20 us a call for two rows of 2816, a third of a small call's time.
static float round_to_8_bits(const float* x, int64_t K, int offset, uint8_t* q) {
  __m512 m = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + k)), m);  // (a NaN: m kept)
  float amax = _mm512_reduce_max_ps(m);
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (k = 0; k + 16 <= K; k += 16) {  // clamped as std::min / std::max do (a NaN gives -127), rounded to even
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + k), vinv), lo), hi);
    const __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(r));
  }
  for (; k < K; ++k) q[k] = uint8_t(int(std::nearbyint(std::min(127.f, std::max(-127.f, x[k] * inv)))) + offset);
  return s;
}

// int8 weights times 8-bit inputs (stored q + 128, unsigned, as vpdpbusd takes them): 64 products a step summed
// exactly in int32 lanes; a second vpdpbusd with ones sums the row's weights, to take off the 128 * sum(w) the
// offset adds: y = (sum((q + 128) w) - 128 sum(w)) * input scale * row scale. AMD Zen 5, [5632, 1024] / [1024, 2816]
// experts from memory, interleaved, one input, the rows ~8 KB ahead asked for against none: one thread 1.13 / 1.05x,
// two at ~40 GB/s 1.03 / 0.96x (4 KB: 1.08 / 1.06x, 1.06 / 0.98x)
template <int NP>
static void rows_int8_dot(const int8_t* w, const Scales& sc, int64_t K, int64_t r0, int64_t r1,
                          const uint8_t* const* xs, const float* xscale, float* const* ys) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t ahead = rows_ahead(K);  // rows: one or two inputs ask for the weights ~8 KB ahead
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* wr = w + r * K;
    if constexpr (NP <= 2) prefetch_bytes(wr + ahead * K, K);
    __m512i a[NP], s = _mm512_setzero_si512();
    for (int p = 0; p < NP; ++p) a[p] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const __m512i wv = _mm512_loadu_si512(wr + k);
      s = _mm512_dpbusd_epi32(s, ones, wv);
      for (int p = 0; p < NP; ++p) a[p] = _mm512_dpbusd_epi32(a[p], _mm512_loadu_si512(xs[p] + k), wv);
    }
    if (k < K) {  // the last 1..63 inputs: masked loads read zeros (a zero weight adds nothing)
      const __mmask64 m = (__mmask64(1) << (K - k)) - 1;
      const __m512i wv = _mm512_maskz_loadu_epi8(m, wr + k);
      s = _mm512_dpbusd_epi32(s, ones, wv);
      for (int p = 0; p < NP; ++p) a[p] = _mm512_dpbusd_epi32(a[p], _mm512_maskz_loadu_epi8(m, xs[p] + k), wv);
    }
    const int32_t row_sum = _mm512_reduce_add_epi32(s);
    const float row_scale = sc.ptr ? sc.at(r) : 1.f;
    for (int p = 0; p < NP; ++p)
      ys[p][r] = float(_mm512_reduce_add_epi32(a[p]) - 128 * row_sum) * xscale[p] * row_scale;
  }
}
#endif

// int4 rows past the last full block of 64: torch packs them two rows per byte (row 2j low, 2j+1 high) per k.
// Only small layers have such a tail (16, 32 or 48 rows). 16 rows at a time (8 bytes per k), their sums in
// registers over a group's k in order, as a row at a time summed them (that form, its k loop inner and strided, took
// ~1.9 us a tail row of 1024 inputs, ~95x a full block's rows; this one ~0.13 us, ~6x: AMD Zen 5, one thread, in
// cache). X: float inputs, or 8-bit ones (int8_t: exact int32 dots per group, sxs their per-group sums, and the
// outputs times the inputs' scales xscale)
template <class X>
static void int4_tail(const uint8_t* w, const Scales& sc, int64_t N, int64_t K, int64_t g, int64_t r0, int64_t r1,
                      int np, const X* const* xs, const float* const* sxs, const float* xscale, float* const* ys) {
  using Acc = std::conditional_t<std::is_same_v<X, float>, float, int32_t>;
  const int64_t full = N / 64 * 64, half = (N - full) / 2;  // (the pack needs N a multiple of 16: half of 8)
  const uint8_t* t = w + full * K / 2;
  for (int p = 0; p < np; ++p)
    for (int64_t c = 0; c < half; c += 8) {  // rows full + 2 c .. full + 2 c + 15
      float total[16] = {};
      for (int64_t gi = 0; gi < K / g; ++gi) {
        Acc even[8] = {}, odd[8] = {};  // rows full + 2 (c + l) and full + 2 (c + l) + 1
        for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
          const uint8_t* b = t + k * half + c;
          const Acc xk = Acc(xs[p][k]);
          for (int l = 0; l < 8; ++l) {
            even[l] += Acc(b[l] & 15) * xk;
            odd[l] += Acc(b[l] >> 4) * xk;
          }
        }
        for (int j = 0; j < 16; ++j) {
          const int64_t r = full + 2 * c + j;
          const float s = sc.scale(gi, r), dot = float(j % 2 ? odd[j / 2] : even[j / 2]);
          total[j] += s * dot + (sc.zero(gi, r) - 8 * s) * sxs[p][gi];
        }
      }
      for (int j = 0; j < 16; ++j) {
        const int64_t r = full + 2 * c + j;
        if (r >= r0 && r < r1) ys[p][r] = xscale ? total[j] * xscale[p] : total[j];
      }
    }
}

// torch's CPU int4 pack, one block of 64 rows: for each k, 32 bytes; byte j holds row j (low nibble) and row
// j + 32 (high nibble). Scale and zero per group of g inputs: w = (q - 8) * s + z, so a group contributes
// s * sum(q x) + (z - 8 s) * sum(x), and sum(x) per group is precomputed (sxs).
//
// SUB (the avx2 set, where converting codes to floats bounded the kernel: a vcvtdq2ps per 8 codes, ~29 vector
// instructions per 64 codes at one input): no conversion. The low nibble's bits read as a float are the subnormal
// lo 2^-149 and the high nibble's, masked where it lies, 16 hi 2^-149, both exact; xs are the inputs times 2^S per row
// (a power of two chosen so that the products are normal floats; used where fused multiply-adds take subnormal
// operands at full speed, as on Zen 3: subnormal_codes_on) and unscale[p] is 2^(149 - S). Scaling by powers of two is
// exact, so the outputs are those of the converted codes, bit for bit (but where a product falls below 2^-126: an
// input under ~2^-100 of its row's largest).
// AMD EPYC Zen 3, [5632, 1024] / [1024, 2816] experts, interleaved: one input 1.19-1.35x in L2 (1 thread), 1.03-1.42x
// from memory (2 threads, with the prefetch below); two inputs and more 0.96-1.10x (the multiply-adds bound them).
template <int NP, bool SUB = false>
static void block_int4(const uint8_t* blk, const Scales& sc, int64_t K, int64_t g, int64_t n0, const float* const* xs,
                       const float* const* sxs, float* const* ys, const float* unscale = nullptr) {
  constexpr int C = 32 / L;  // L-byte pieces per k; piece c gives rows c*L.. (low) and 32 + c*L.. (high)
  // On 8 lanes (AVX2: 16 registers, which 2 C NP = 8 NP sums overflowed) several inputs go one piece at a time over a
  // group's inputs, and at most 4 inputs at once (8 sums); the same products added in the same order, so the same
  // outputs. 304M model, everything int4, prefill on AMD EPYC Zen 3, interleaved: 1.52x at 16 tokens (4 pairs per
  // expert), 1.49x at 64 (1.33 / 1.27x one piece at a time without the split)
  if constexpr (L == 8 && NP > 4) {
    block_int4<4, SUB>(blk, sc, K, g, n0, xs, sxs, ys, unscale);
    return block_int4<NP - 4, SUB>(blk, sc, K, g, n0, xs + 4, sxs + 4, ys + 4, SUB ? unscale + 4 : nullptr);
  }
  // Two inputs go two pieces at a time: one piece's 4 sums were 4 chains of dependent multiply-adds, the
  // multiply-adds' latency (4 cycles on Zen 3) allowing one a cycle of the two it can start; 8 sums fill both
  // (interleaved, AMD EPYC Zen 3: 1.26-1.39x on subnormals, 1.17-1.20x converting, in L2 and from memory; 6 inputs,
  // 4 + 2, 1.11x). Three inputs stay one piece at a time (two pieces: 12 sums, spilled, 0.65-0.82x; 2 + 1: 0.84-1.14x)
  constexpr int PC = L == 8 && NP == 2 ? 2 : (L == 8 && NP >= 2) ? 1 : C;
  // one or two inputs on subnormals: the block's bytes 8 KB ahead asked for, a cache line every other k (~1.05-1.2x
  // from memory, measured with SUB; the converting form was bound by its instructions, not its reads)
  constexpr bool prefetch = SUB && kPrefetch && NP <= 2;
  vf acc[NP][2 * C];
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 2 * C; ++c) acc[p][c] = vf{};
  for (int64_t gi = 0; gi < K / g; ++gi) {
    for (int c0 = 0; c0 < C; c0 += PC) {
      vf ga[NP][2 * PC];
      for (int p = 0; p < NP; ++p)
        for (int j = 0; j < 2 * PC; ++j) ga[p][j] = vf{};
      for (int64_t k = gi * g; k < (gi + 1) * g; ++k) {
        const uint8_t* b = blk + k * 32;
        if constexpr (prefetch) if ((k & 1) == 0) __builtin_prefetch(b + 8192);
        for (int c = 0; c < PC; ++c) {
          vf lo, hi;
#ifdef ZOO_SUBNORMAL_CODES
          if constexpr (SUB)
            nibbles_as_subnormals(b + (c0 + c) * L, lo, hi);
          else
#endif
            nibbles_to_float(b + (c0 + c) * L, lo, hi);
          for (int p = 0; p < NP; ++p) {
            float x = xs[p][k];
            ga[p][c] += lo * x;
            ga[p][PC + c] += hi * x;
          }
        }
      }
      for (int j = 0; j < 2 * PC; ++j) {
        const int c = j < PC ? c0 + j : C + c0 + j - PC;  // the piece's index among all 2 C
        vf s, zm;
        if (sc.bf16) {  // L (scale, zero) pairs of bf16 as L 32-bit lanes: scale in the low half, zero in the high
          vu32 sz = load<vu32>(static_cast<const uint16_t*>(sc.ptr) + (gi * sc.N + n0 + c * L) * 2);
          s = (vf)(sz << 16);
          zm = (vf)(sz & 0xffff0000u) - 8 * s;
        } else {
          for (int i = 0; i < L; ++i) {
            s[i] = sc.scale(gi, n0 + c * L + i);
            zm[i] = sc.zero(gi, n0 + c * L + i) - 8 * s[i];
          }
        }
        for (int p = 0; p < NP; ++p) {
          vf sum = ga[p][j];
          if constexpr (SUB) sum *= j < PC ? unscale[p] : unscale[p] * 0.0625f;
          acc[p][c] += sum * s + zm * sxs[p][gi];
        }
      }
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 2 * C; ++c) std::memcpy(ys[p] + n0 + c * L, &acc[p][c], sizeof(vf));
}

#ifdef ZOO_BF16_DOT
// int8 weights times bf16 inputs on vdpbf16ps: 32 codes widened to bf16 (exact: |q| <= 128) per step, each
// multiplied with NP inputs' 32 values as they are; the row scale multiplies the fp32 sum. The same products as the
// float path's (both exact in fp32), a third of its instructions per weight at one input and fewer still at several.
template <int NP>
static void rows_int8_bf16(const int8_t* w, const Scales& sc, int64_t K, int64_t r0, int64_t r1,
                           const uint16_t* const* xs, float* const* ys) {
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* wr = w + r * K;
    __m512 a[NP];
    for (int p = 0; p < NP; ++p) a[p] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t n = std::min<int64_t>(32, K - k);  // the last 1..31 inputs: masked loads read zeros past the end
      const __mmask32 m = n == 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
      const __m512i q = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, wr + k));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
      const __m512bh wb = _mm512_cvtne2ps_pbh(hi, lo);
      for (int p = 0; p < NP; ++p)
        a[p] = _mm512_dpbf16_ps(a[p], wb, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[p] + k));
    }
    for (int p = 0; p < NP; ++p) ys[p][r] = _mm512_reduce_add_ps(a[p]) * sc.at(r);
  }
}
#endif

#ifdef ZOO_BF16_DOT
// Group gi's (scale, z - 8 s) for rows r..r + rows - 1, rows <= 16 (the stored [K/g, N, 2] layout: one run of pairs;
// lanes past them read as zeros)
static inline void scale_pairs16(const Scales& sc, int64_t gi, int64_t r, int64_t rows, __m512& s, __m512& zm) {
  const __mmask16 m = __mmask16((1u << rows) - 1);
  __m512 z;
  if (sc.bf16) {
    const __m512i u = _mm512_maskz_loadu_epi32(m, static_cast<const uint16_t*>(sc.ptr) + (gi * sc.N + r) * 2);
    s = (__m512)_mm512_slli_epi32(u, 16), z = (__m512)_mm512_and_si512(u, _mm512_set1_epi32(int32_t(0xffff0000u)));
  } else {
    const float* pr = static_cast<const float*>(sc.ptr) + (gi * sc.N + r) * 2;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const uint32_t two = rows == 16 ? ~0u : (1u << 2 * rows) - 1;  // each row's two words
    const __m512 a = _mm512_maskz_loadu_ps(__mmask16(two), pr), b = _mm512_maskz_loadu_ps(__mmask16(two >> 16), pr + 16);
    s = _mm512_permutex2var_ps(a, even, b);
    z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
  }
  zm = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z);  // z - 8 s, as row_scales rounds it
}

// int4 codes times bf16 inputs on vdpbf16ps, one block of 64 rows as block_int4 reads it: codes 0..15 and bf16
// inputs are exact in bf16 and their products exact in fp32, so this sums what block_int4 sums (in another order)
// with half the multiply-adds and no widening to fp32. Per pair (k, k + 1), one 64-byte load holds the 64 rows'
// codes at k and at k + 1 (32 bytes each; byte j: row j's code in its low nibble, row 32 + j's in its high). For 16
// rows a vpermw puts the 16-bit word holding row r's byte at k beside the word holding it at k + 1 (one 32-bit lane
// per row, in order), a per-word shift brings the row's nibble down (0 or 8 bits: its byte's place in the word;
// + 4 for the high nibbles' rows) and a second vpermw looks the codes up as bf16 (it reads an index's low 5 bits, so
// the table repeats 0..15 and no mask is needed). One input (decode) adds into two sets of sums, k in steps of 4, so
// that no multiply-add waits on the one before it: AMD Zen 5, one [64, 1024] block in L2, one thread, 64 GB/s
// against 47 for the former form (byte widening, four lookups and four unpacks a pair, one set of sums); [5632,
// 1024] / [1024, 2816] experts from memory, 2 threads, interleaved, 1.09 / 1.10x. With one or two inputs each
// group asks for the codes 8 KB ahead: 1.11 / 1.13x more (0.97 / 0.86 of the machine's read bandwidth at 52-62
// GB/s against 0.88 / 0.75; 4 KB 1.07 / 1.06x, 16 KB 1.07 / 1.09x); a line ahead beside each line read rather than a
// group's lines at its start: 1.04-1.08x more (one and two threads; 16 KB ahead the same)
template <int NP>
static void block_int4_bf16(const uint8_t* blk, const Scales& sc, int64_t K, int64_t g, int64_t n0,
                            const uint16_t* const* xb, const float* const* sxs, float* const* ys) {
  alignas(64) uint16_t codes[32], place[2][32], shift[2][32];
  for (int i = 0; i < 32; ++i) {  // small integers: their bf16 is the top half of their fp32
    const float f = float(i & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    codes[i] = uint16_t(u >> 16);
  }
  for (int h = 0; h < 2; ++h)  // rows 16 h + m: bytes 16 h + m of the k half (words 0..15) and of the k + 1 half
    for (int m = 0; m < 16; ++m) {
      place[h][2 * m] = uint16_t(8 * h + m / 2);
      place[h][2 * m + 1] = uint16_t(16 + 8 * h + m / 2);
      shift[0][2 * m] = shift[0][2 * m + 1] = uint16_t(8 * (m & 1));
      shift[1][2 * m] = shift[1][2 * m + 1] = uint16_t(8 * (m & 1) + 4);
    }
  const __m512i table = _mm512_load_si512(codes), lo_shift = _mm512_load_si512(shift[0]);
  const __m512i hi_shift = _mm512_load_si512(shift[1]);
  const __m512i places[2] = {_mm512_load_si512(place[0]), _mm512_load_si512(place[1])};
  constexpr int U = NP <= 2 ? 2 : 1;  // sets of sums per input
  __m512 acc[NP][4];
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4; ++c) acc[p][c] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < K / g; ++gi) {
    __m512 ga[U][NP][4];  // [c]: rows 16 c .. 16 c + 15 in order
    for (int u = 0; u < U; ++u)
      for (int p = 0; p < NP; ++p)
        for (int c = 0; c < 4; ++c) ga[u][p][c] = _mm512_setzero_ps();
    for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += 2 * U) {
      for (int u = 0; u < U; ++u) {
        const int64_t k = k0 + 2 * u;
        const __m512i both = _mm512_loadu_si512(blk + k * 32);
        if constexpr (NP <= 2) __builtin_prefetch(blk + k * 32 + kAheadBytes);  // the codes ~8 KB ahead
        __m512bh w[4];
        for (int h = 0; h < 2; ++h) {
          const __m512i q = _mm512_permutexvar_epi16(places[h], both);
          w[h] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(q, lo_shift), table);
          w[2 + h] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(q, hi_shift), table);
        }
        for (int p = 0; p < NP; ++p) {
          int32_t pair;
          std::memcpy(&pair, xb[p] + k, 4);
          const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
          for (int c = 0; c < 4; ++c) ga[u][p][c] = _mm512_dpbf16_ps(ga[u][p][c], w[c], x);
        }
      }
    }
    for (int c = 0; c < 4; ++c) {  // rows 16 c .. 16 c + 15
      __m512 s, zm;
      // 16 rows' scales in one load (against one at a time, interleaved: [5632, 1024] 0.95-1.11x, [1024, 2816]
      // 1.26-1.74x, its groups' scales 4 KB apart)
      scale_pairs16(sc, gi, n0 + 16 * c, 16, s, zm);
      for (int p = 0; p < NP; ++p) {
        __m512 rows = ga[0][p][c];
        for (int u = 1; u < U; ++u) rows = _mm512_add_ps(rows, ga[u][p][c]);
        acc[p][c] = _mm512_fmadd_ps(rows, s, _mm512_fmadd_ps(zm, _mm512_set1_ps(sxs[p][gi]), acc[p][c]));
      }
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(ys[p] + n0 + 16 * c, acc[p][c]);
}
#endif

#ifdef ZOO_DOT8
// int4 codes times 8-bit inputs (q signed, x ~ q * input scale) on vpdpbusd, one block of 64 rows as block_int4
// reads it. vpdpbusd sums the products of four adjacent bytes into a 32-bit lane, so each byte's codes for four
// consecutive k are brought together: byte unpacks pair k with k + 1 and k + 2 with k + 3, 16-bit unpacks join the
// pairs. Both work within 128-bit lanes, so the vectors are 256-bit (512-bit ones would need cross-lane shuffles
// on top). Vector v of the four holds bytes 4v..4v+3 in its low half and 16+4v..16+4v+3 in its high half; its low
// nibbles are those rows, its high nibbles the rows 32 above (vectors 4..7 here). The codes (0..15) are the
// unsigned operand.
// int4_step_codes: the 8 vectors of codes of one step (four k, 128 bytes at b), as the dots take them
static inline void int4_step_codes(const uint8_t* b, __m256i* q) {
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i w0 = load<__m256i>(b), w1 = load<__m256i>(b + 32);
  const __m256i w2 = load<__m256i>(b + 64), w3 = load<__m256i>(b + 96);
  const __m256i lo01 = _mm256_unpacklo_epi8(w0, w1), hi01 = _mm256_unpackhi_epi8(w0, w1);
  const __m256i lo23 = _mm256_unpacklo_epi8(w2, w3), hi23 = _mm256_unpackhi_epi8(w2, w3);
  const __m256i t[4] = {_mm256_unpacklo_epi16(lo01, lo23), _mm256_unpackhi_epi16(lo01, lo23),
                        _mm256_unpacklo_epi16(hi01, hi23), _mm256_unpackhi_epi16(hi01, hi23)};
  for (int v = 0; v < 4; ++v) {
    q[v] = _mm256_and_si256(t[v], low4);
    q[4 + v] = _mm256_and_si256(_mm256_srli_epi16(t[v], 4), low4);
  }
}
// int4_group_dots: the exact int32 dots of inputs 0..C-1 with inputs k0..k1 (one group) of the block's rows; with
// `ahead`, the bytes that far ahead of each step are asked for (software prefetch)
template <int C>
static inline void int4_group_dots(const uint8_t* blk, int64_t k0, int64_t k1, const int8_t* const* xs,
                                   __m256i (*dot)[8], int64_t ahead = 0) {
  __m256i d[C][8];
  for (int p = 0; p < C; ++p)
    for (int c = 0; c < 8; ++c) d[p][c] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 4) {
    const uint8_t* b = blk + k * 32;
    if (ahead) __builtin_prefetch(b + ahead), __builtin_prefetch(b + ahead + 64);  // (this step's 128 bytes)
    __m256i q[8];
    int4_step_codes(b, q);
    for (int p = 0; p < C; ++p) {
      const __m256i xv = _mm256_set1_epi32(load<int32_t>(xs[p] + k));
      for (int c = 0; c < 8; ++c) d[p][c] = dot4_add(d[p][c], q[c], xv);
    }
  }
  for (int p = 0; p < C; ++p)
    for (int c = 0; c < 8; ++c) dot[p][c] = d[p][c];
}

#if !defined(ZOO_VNNI)
// AVX2, four inputs and more: a group's codes unpacked once (int4_group_dots' unpacking, 8 vectors a step) into q,
// which every input's dots then read from L1 as vpmaddubsw's memory operand (block_int4_dot)
static inline void int4_group_unpack(const uint8_t* blk, int64_t k0, int64_t k1, __m256i* q) {
  for (int64_t k = k0; k < k1; k += 4, q += 8) int4_step_codes(blk + k * 32, q);
}
static inline void int4_unpacked_dots(const __m256i* q, int64_t k0, int64_t k1, const int8_t* x, __m256i* dot) {
  __m256i d[8];
  for (int c = 0; c < 8; ++c) d[c] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 4, q += 8) {
    const __m256i xv = _mm256_set1_epi32(load<int32_t>(x + k));
    for (int c = 0; c < 8; ++c) d[c] = dot4_add(d[c], q[c], xv);
  }
  for (int c = 0; c < 8; ++c) dot[c] = d[c];
}
#endif

// Per group, s * sum(q xq) + (z - 8 s) * sum(xq) in fp32 (sxs: the per-group sums of q), times the input's scale at
// the end. The dots go two inputs at a time (the group's codes read again from L1): with 8 accumulators an input,
// more would not fit the 32 registers (measured in L2, 64 rows x 1024: 4 inputs 2x, 8 inputs 2.5x the speed of all
// at once)
template <int NP>
static void block_int4_dot(const uint8_t* blk, const Scales& sc, int64_t K, int64_t g, int64_t n0,
                           const int8_t* const* xs, const float* const* sxs, const float* xscale, float* const* ys) {
  __m256 acc[NP][8];
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 8; ++c) acc[p][c] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < K / g; ++gi) {
    __m256i dot[NP][8];
#ifdef ZOO_VNNI
    // one or two inputs: the block's bytes ~8 KB ahead asked for (AMD Zen 5, [5632, 1024] / [1024, 2816] experts from
    // memory, interleaved: 1.17 / 1.21x on two threads, 1.21 / 1.25x on one)
    constexpr int64_t ahead = NP <= 2 ? kAheadBytes : 0;
    for (int p = 0; p + 1 < NP; p += 2) int4_group_dots<2>(blk, gi * g, (gi + 1) * g, xs + p, dot + p, ahead);
    if constexpr (NP % 2 == 1) int4_group_dots<1>(blk, gi * g, (gi + 1) * g, xs + NP - 1, dot + NP - 1, ahead);
#else  // AVX2's 16 registers hold one input's 8 sums beside the 8 code vectors
    // one or two inputs: the block's bytes 8 KB ahead asked for (Zen 3, [5632, 1024] experts from memory, 2
    // threads, interleaved: 1.17-1.22x at one input, 1.12x at two; 2 KB ahead 1.09-1.18x)
    constexpr int64_t ahead = kPrefetch && NP <= 2 ? 8192 : 0;
    // four inputs and more: the group's codes unpacked once (groups to 256 inputs: 16 KiB on the stack; a
    // thread_local std::vector<__m256i> there segfaulted under two threads). Zen 3, interleaved, against
    // unpacking per input: 4 inputs 1.01-1.17x, 8 1.25x; 304M model, everything int4, prefill 1.15-1.20x at 16-64
    // tokens; two inputs 0.95-0.99x (so from four)
    alignas(32) __m256i q[NP >= 4 ? 512 : 1];
    if (NP >= 4 && g <= 256) {
      int4_group_unpack(blk, gi * g, (gi + 1) * g, q);
      for (int p = 0; p < NP; ++p) int4_unpacked_dots(q, gi * g, (gi + 1) * g, xs[p], dot[p]);
    } else {
      for (int p = 0; p < NP; ++p) int4_group_dots<1>(blk, gi * g, (gi + 1) * g, xs + p, dot + p, ahead);
    }
#endif
    // the group's scales, vector c's rows: r..r+3 (low half) and r+16..r+19 (high), r = n0 + c / 4 * 32 + c % 4 * 4;
    // taken apart from the products, so that the compiler unrolls both and keeps the sums in registers (a loop over
    // c with the two cases inside kept them in memory: about 0.7x the speed from memory, measured)
    __m256 s[8], zm[8];
    if (sc.bf16) {  // (scale, zero) pairs of bf16 as 32-bit lanes: scale in the low half, zero in the high
      for (int c = 0; c < 8; ++c) {
        const uint16_t* sz = static_cast<const uint16_t*>(sc.ptr) + (gi * sc.N + n0 + c / 4 * 32 + c % 4 * 4) * 2;
        const __m256i pairs = _mm256_inserti128_si256(_mm256_castsi128_si256(load<__m128i>(sz)),
                                                      load<__m128i>(sz + 32), 1);
        s[c] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        zm[c] = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
        zm[c] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s[c], zm[c]);
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        vf8 sv, zv;
        for (int i = 0; i < 8; ++i) {
          const int64_t r = n0 + c / 4 * 32 + c % 4 * 4 + i / 4 * 16 + i % 4;
          sv[i] = sc.scale(gi, r);
          zv[i] = sc.zero(gi, r) - 8 * sv[i];
        }
        s[c] = (__m256)sv, zm[c] = (__m256)zv;
      }
    }
    for (int p = 0; p < NP; ++p) {
      const __m256 sx = _mm256_set1_ps(sxs[p][gi]);
      for (int c = 0; c < 8; ++c)
        acc[p][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[p][c]), s[c], _mm256_fmadd_ps(zm[c], sx, acc[p][c]));
    }
  }
  for (int p = 0; p < NP; ++p)
    for (int c = 0; c < 8; ++c) {
      const __m256 y = _mm256_mul_ps(acc[p][c], _mm256_set1_ps(xscale[p]));
      float* out = ys[p] + n0 + c / 4 * 32 + c % 4 * 4;
      _mm_storeu_ps(out, _mm256_castps256_ps128(y));
      _mm_storeu_ps(out + 16, _mm256_extractf128_ps(y, 1));
    }
}
#endif

// One 32-code chunk of a 2- or 3-bit row as eight 32-bit words: 2 bits, lane i holds byte i (codes 4i..4i+3);
// 3 bits, lanes 0..3 hold the four 24-bit words (8 codes each) and lanes 4..7 the same words, read from bit 12.
// codes_to_float (the 16-lane kernels' odd chunk): each lane's code at bit `shift`, as a float.
#ifdef ZOO_X86_PACKED
// x86 (AVX2 and up): the bytes widened in one instruction (3 bits: one byte shuffle); on AVX-512 processors each
// code is turned into a float by a lookup in a table of 8 floats (vpermps reads an index's low 3 bits: no mask, no
// int-to-float convert). (The 8-lane sets mask the codes where they lie instead: rows_packed_step.)
template <int BITS>
static inline vw8 packed_words(const uint8_t* b) {
  if (BITS == 2) return (vw8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)b));
  uint32_t last;  // bytes 8..11, read apart: never past the chunk (the row may end there)
  std::memcpy(&last, b + 8, 4);
  const __m128i v = _mm_insert_epi32(_mm_loadl_epi64((const __m128i*)b), int(last), 2);
  const __m128i words = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1));
  return (vw8)_mm256_broadcastsi128_si256(words);
}
#if ZOO_LANES == 16
template <int BITS>
static inline vf8 codes_to_float(vw8 words, vw8 shift) {
  // 2 bits: the index's third bit is the next code's, so the table repeats 0..3
  const __m256 table = BITS == 2 ? _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3) : _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return (vf8)_mm256_permutevar8x32_ps(table, _mm256_srlv_epi32((__m256i)words, (__m256i)shift));
}
#endif
#else
template <int BITS>
static inline vw8 packed_words(const uint8_t* b) {
  if (BITS == 2) return __builtin_convertvector(load<vb8>(b), vw8);
  uint32_t u[4];
  for (int i = 0; i < 4; ++i) u[i] = b[3 * i] | (b[3 * i + 1] << 8) | (b[3 * i + 2] << 16);
  return vw8{u[0], u[1], u[2], u[3], u[0], u[1], u[2], u[3]};
}
#endif

// The scales of an item's rows [r0, r1) (at most 64), read once per item along the rows, as floats
// [K/g][r1 - r0] (s[gi * R + i] for row r0 + i): the stored [K/g, N, 2] layout puts a row's groups 4 N or 8 N
// bytes apart, and with N a multiple of 512 or 1024 all of them fall in one L1 set (8 ways), so a row-by-row read
// missed L1 on every group past the eighth. The zero terms, sum over groups of (z - zero_offset s) * (sum of the
// group's inputs), go here too, for all rows at once: zt[p * R + i] (vectorised over the rows; the groups in order).
// zero_offset is 8 (w = (q - 8) s + z), or 16 where a kernel reads each code as 1 + q/8 (rows_int3_vbmi).
struct RowScales {
  const float* s;
  float zt[8 * 64];
};
template <int NP>
static void row_scales(const Scales& sc, int64_t G, int64_t r0, int64_t r1, const float* const* sxs, RowScales& out,
                       float zero_offset = 8.f) {
  const int64_t R = r1 - r0;
  thread_local std::vector<float> buf;
  buf.resize(2 * G * R + 16);
  float *s = buf.data(), *zm = s + G * R + 16;  // (+16: not 4 KiB apart, which stalled its loads on the stores)
  for (int64_t gi = 0; gi < G; ++gi) {
    float *sg = s + gi * R, *zg = zm + gi * R;
    if (sc.bf16) {  // (scale, zero) pairs of bf16 as 32-bit words: scale in the low half, zero in the high
      const uint16_t* pr = static_cast<const uint16_t*>(sc.ptr) + (gi * sc.N + r0) * 2;
      for (int64_t i = 0; i < R; ++i) {
        uint32_t u, lo, hi;
        std::memcpy(&u, pr + 2 * i, 4);
        lo = u << 16, hi = u & 0xffff0000u;
        float sv, zv;
        std::memcpy(&sv, &lo, 4);
        std::memcpy(&zv, &hi, 4);
        sg[i] = sv, zg[i] = zv - zero_offset * sv;
      }
    } else {
      const float* pr = static_cast<const float*>(sc.ptr) + (gi * sc.N + r0) * 2;
      for (int64_t i = 0; i < R; ++i) sg[i] = pr[2 * i], zg[i] = pr[2 * i + 1] - zero_offset * pr[2 * i];
    }
  }
  // the next item's scales (the rows after these, most often this thread's next item), asked for now, to come from
  // memory while this item runs: each group's are a run of their own, K/g short runs at a time that the hardware
  // prefetchers did not follow (this function was a quarter of the 2-bit kernel's time, waiting on them)
  const int64_t pair_bytes = sc.bf16 ? 4 : 8;
  for (int64_t gi = 0; r1 + R <= sc.N && gi < G; ++gi)
    for (int64_t b = 0; b < R * pair_bytes; b += 64)
      __builtin_prefetch(static_cast<const char*>(sc.ptr) + (gi * sc.N + r1) * pair_bytes + b);
  for (int p = 0; p < NP; ++p) {
    float* zt = out.zt + p * R;
    for (int64_t i = 0; i < R; ++i) zt[i] = 0;
    for (int64_t gi = 0; gi < G; ++gi)
      for (int64_t i = 0; i < R; ++i) zt[i] += zm[gi * R + i] * sxs[p][gi];
  }
  out.s = s;
}

// 2- or 3-bit codes packed densely along each row (zoo.moe.packing). 32 codes (4 * BITS bytes) at a time as
// eight lanes x four shifts; the inputs come permuted to match (permute_for_packed, layout 0), so each shift's lanes
// multiply contiguous inputs. Groups are multiples of 32, so a 32-code chunk never straddles two.
// RS rows a step, A sums per row and input: one input (decode) goes two rows at a time with two sums each, so each
// input vector read serves both rows and four chains of multiply-adds run side by side. AMD EPYC Zen 3 (avx2 set),
// [5632, 1024] experts, interleaved, against one row at a time with one sum and the codes turned into floats by a
// lookup (before): one token, from memory, 2 threads, 3-bit 1.18x, 2-bit 1.33x (in L2, 1 thread: 1.13 / 1.24x; four
// rows a step: no better); 2 inputs 1.01 / 1.15x, 4 inputs 1.01 / 1.04x (the convert alone).
// Each code is masked where it lies (bit BITS s of its lane: no shift) and turned into a float, its inputs having
// come times 2^-(BITS s) (moe_gemv; a power of two: exact), so the product is code * input. Against shifting each
// code down first, interleaved as above (3 runs): one input 2-bit 1.10-1.24x, 3-bit 0.98-1.03x; two inputs 1.06 /
// 1.05-1.07x; four 1.01-1.03 / 1.02-1.07x.
// SUB (the avx2 set): no conversion, as in block_int4's SUB form: a masked code's bits are the subnormal
// code * 2^(BITS s - 149), the inputs come times 2^S per row too and each group's sums go times 2^(149 - S)
// (unscale): the same outputs bit for bit. Interleaved as above: one input 2-bit 1.20x in L2, 1.02-1.08x from memory;
// 3-bit 1.26x in L2, 1.12-1.27x from memory; two inputs 1.07-1.12x; four 0.96-1.19x.
template <int NP, int BITS, int RS, int A, bool SUB>
static inline void rows_packed_step(const uint8_t* wr, int64_t row_bytes, int64_t K, int64_t g, const RowScales& rs,
                                    int64_t R, int64_t i0, const float* const* xs, float* const* ys, int64_t r,
                                    const float* unscale) {
  const vw8 base = BITS == 2 ? vw8{0, 0, 0, 0, 0, 0, 0, 0} : vw8{0, 0, 0, 0, 12, 12, 12, 12};
  vf8 acc[RS][NP];
  for (int j = 0; j < RS; ++j)
    for (int p = 0; p < NP; ++p) acc[j][p] = vf8{};
  for (int64_t gi = 0; gi < K / g; ++gi) {
    vf8 ga[RS][NP][A];
    for (int j = 0; j < RS; ++j)
      for (int p = 0; p < NP; ++p)
        for (int a = 0; a < A; ++a) ga[j][p][a] = vf8{};
    for (int64_t c = gi * g / 32; c < (gi + 1) * g / 32; ++c) {
      vw8 words[RS];
      for (int j = 0; j < RS; ++j) {
        words[j] = packed_words<BITS>(wr + j * row_bytes + c * 4 * BITS);
        if (BITS == 3) words[j] = words[j] >> base;  // then every lane's shift is the same: an immediate
      }
      for (int s = 0; s < 4; ++s)
        for (int j = 0; j < RS; ++j) {
          const vw8 masked = words[j] & (((1u << BITS) - 1) << (BITS * s));
          const vf8 q = SUB ? (vf8)masked : __builtin_convertvector(vi32_8(masked), vf8);
          for (int p = 0; p < NP; ++p) ga[j][p][s % A] += q * load<vf8>(xs[p] + c * 32 + s * 8);
        }
    }
    for (int j = 0; j < RS; ++j) {
      const float s = rs.s[gi * R + i0 + j];
      for (int p = 0; p < NP; ++p) {
        vf8 sum = ga[j][p][0];
        for (int a = 1; a < A; ++a) sum += ga[j][p][a];
        acc[j][p] += sum * (SUB ? s * unscale[p] : s);
      }
    }
  }
  for (int j = 0; j < RS; ++j)
    for (int p = 0; p < NP; ++p) ys[p][r + j] = hsum(acc[j][p]) + rs.zt[p * R + i0 + j];
}
template <int NP, int BITS, bool SUB = false>
static void rows_packed(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                        const float* const* xs, const float* const* sxs, float* const* ys,
                        const float* unscale = nullptr) {
  constexpr int RS = NP == 1 ? 2 : 1, A = NP == 1 ? 2 : 1;
  const int64_t row_bytes = K * BITS / 8, R = r1 - r0;
  RowScales rs;
  row_scales<NP>(sc, K / g, r0, r1, sxs, rs);
  // one input: the rows two steps ahead asked for (AMD EPYC Zen 3, from memory, 2 threads, interleaved, 4 runs:
  // [1024, 2816] experts 1.15-1.24x; [5632, 1024] 0.97-1.10x; two inputs, one row a step, lost: 0.87-0.96x)
  constexpr bool prefetch = kPrefetch && NP == 1;
  int64_t r = r0;
  for (; r + RS <= r1; r += RS) {
    if constexpr (prefetch) prefetch_bytes(w + (r + 2 * RS) * row_bytes, RS * row_bytes);
    rows_packed_step<NP, BITS, RS, A, SUB>(w + r * row_bytes, row_bytes, K, g, rs, R, r - r0, xs, ys, r, unscale);
  }
  for (; r < r1; ++r)
    rows_packed_step<NP, BITS, 1, A, SUB>(w + r * row_bytes, row_bytes, K, g, rs, R, r - r0, xs, ys, r, unscale);
}

#if ZOO_LANES == 16
// The 16-lane form of rows_packed (AVX-512): two 32-code chunks of one group (8 * BITS bytes) a step, as 16 lanes x
// four shifts, the inputs permuted per chunk pair to match (permute_for_packed, layout 1: lane j of shift s takes
// the input that lane j % 8 of chunk j / 8 takes in the 8-lane layout); a group's odd last chunk (g / 32 odd) goes
// the 8-lane way. 2 bits: lane j holds byte j; 3 bits: lanes 0..3 the first chunk's four 24-bit words, 4..7 the
// same read from bit 12, 8..15 the second chunk's likewise.
template <int BITS>
static inline __m512i packed_words16(const uint8_t* b) {
  if (BITS == 2) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b));
  // 24 bytes (a masked load: never past the pair), dwords 0..3 to 128-bit lanes 0 and 1, dwords 3..6 to 2 and 3,
  // then each lane's 12 bytes of four words to four 32-bit lanes
  const __m512i v = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(0xffffff, b));
  const __m512i spread = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 3, 4, 5, 6, 3, 4, 5, 6), v);
  return _mm512_shuffle_epi8(spread, _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9,
                                                                          10, 11, -1)));
}

// shift s's 16 codes times the group's scale, by a lookup in a table of 16 floats (vpermps reads an index's low 4
// bits) holding the codes times the scale: no conversion, and no per-group sum to scale.
// 2 bits: the low 4 bits hold two codes, so tables i & 3 and i >> 2 read shifts 0 and 1 without a shift (w4: the
// words shifted by 4, for shifts 2 and 3)
struct ScaledTables {
  __m512 t0, t1;
  ScaledTables(int bits, float s) {
    const __m512 vs = _mm512_set1_ps(s);
    t0 = bits == 2 ? _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3), vs)
                   : _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7), vs);
    t1 = _mm512_mul_ps(_mm512_setr_ps(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), vs);
  }
};
template <int BITS>
static inline __m512 codes16(__m512i w, __m512i w4, int s, const ScaledTables& t) {
  if (BITS == 2) return _mm512_permutexvar_ps(s < 2 ? w : w4, s % 2 ? t.t1 : t.t0);
  const __m512i shift = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 12, 12, 12, 12, 0, 0, 0, 0, 12, 12, 12, 12),
                                         _mm512_set1_epi32(3 * s));
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(w, shift), t.t0);
}

template <int NP, int BITS>
static void rows_packed16(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                          const float* const* xs, const float* const* sxs, float* const* ys) {
  // A independent chains per input (FMA latency: one input alone would wait on one chain)
  constexpr int A = NP == 1 ? 4 : NP == 2 ? 2 : 1;
  const int64_t R = r1 - r0, G = K / g, pairs = g / 64;
  const bool odd = g % 64 != 0;
  const vw8 base8 = BITS == 2 ? vw8{0, 0, 0, 0, 0, 0, 0, 0} : vw8{0, 0, 0, 0, 12, 12, 12, 12};
  RowScales rs;
  row_scales<NP>(sc, G, r0, r1, sxs, rs);
  // one or two inputs ask for the row ~8 KB ahead: AMD Zen 5, [5632, 1024] / [1024, 2816] experts from memory,
  // interleaved, 2 threads: 3-bit 2.3 / 2.2x (0.42 / 0.56 of the machine's read bandwidth at 43-53 GB/s), 2-bit 1.15
  // / 1.15x; one thread 2.4 / 2.4x and 1.14 / 1.18x (2 KB ahead: about the same). (The rows were waiting on memory.)
  const int64_t row_bytes = K * BITS / 8, ahead = rows_ahead(row_bytes);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wp = w + r * (K * BITS / 8);
    if constexpr (NP <= 2) prefetch_bytes(wp + ahead * row_bytes, row_bytes);
    __m512 acc[A][NP];
    vf8 acc8[NP];
    for (int p = 0; p < NP; ++p) {
      for (int a = 0; a < A; ++a) acc[a][p] = _mm512_setzero_ps();
      acc8[p] = vf8{};
    }
    int64_t k = 0;
    for (int64_t gi = 0; gi < G; ++gi) {
      const float s = rs.s[gi * R + r - r0];
      const ScaledTables t(BITS, s);
      for (int64_t i = 0; i < pairs; ++i, wp += 8 * BITS, k += 64) {
        const __m512i words = packed_words16<BITS>(wp);
        const __m512i w4 = BITS == 2 ? _mm512_srli_epi32(words, 4) : words;
        for (int j = 0; j < 4; ++j) {
          const __m512 q = codes16<BITS>(words, w4, j, t);
          for (int p = 0; p < NP; ++p)
            acc[j % A][p] = _mm512_fmadd_ps(q, _mm512_loadu_ps(xs[p] + k + j * 16), acc[j % A][p]);
        }
      }
      if (odd) {  // the group's last chunk, alone, in the 8-lane layout
        const vw8 words = packed_words<BITS>(wp);
        vf8 ga8[NP];
        for (int p = 0; p < NP; ++p) ga8[p] = vf8{};
        for (int j = 0; j < 4; ++j) {
          const vf8 q = codes_to_float<BITS>(words, base8 + BITS * j);
          for (int p = 0; p < NP; ++p) ga8[p] += q * load<vf8>(xs[p] + k + j * 8);
        }
        for (int p = 0; p < NP; ++p) acc8[p] += ga8[p] * s;
        wp += 4 * BITS, k += 32;
      }
    }
    for (int p = 0; p < NP; ++p) {
      __m512 t = acc[0][p];
      for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, acc[a][p]);
      ys[p][r] = _mm512_reduce_add_ps(t) + (odd ? hsum(acc8[p]) : 0.f) + rs.zt[p * R + r - r0];
    }
  }
}
#endif

#ifdef ZOO_BF16_DOT
// 16 rows' step sums as sums per group, each a vector of the 16 rows (lane i: row i): D[i] is row i's 16 lanes (lane
// l: codes 16 l..16 l + 15 of the step), L lanes a group (L = g / 16, or 16 where g >= 256), out[m]: the step's group
// m. Adjacent lanes are added across row pairs (E[i] lane 4 q + 2 h + m: row 2 i + h, lanes 4 q + 2 m and + 1), then
// across row quadruples (F lane 4 q + t: row 4 i + t, lanes 4 q..4 q + 3; L = 2 keeps m apart), then the 128-bit
// quarters transposed (quarter q of F[0..3]: rows 0..15 of lanes 4 q..4 q + 3).
static inline void quarters(const __m512 F[4], __m512 Q[4]) {
  const __m512 a0 = _mm512_shuffle_f32x4(F[0], F[1], 0x44), a1 = _mm512_shuffle_f32x4(F[0], F[1], 0xEE);
  const __m512 a2 = _mm512_shuffle_f32x4(F[2], F[3], 0x44), a3 = _mm512_shuffle_f32x4(F[2], F[3], 0xEE);
  Q[0] = _mm512_shuffle_f32x4(a0, a2, 0x88), Q[1] = _mm512_shuffle_f32x4(a0, a2, 0xDD);
  Q[2] = _mm512_shuffle_f32x4(a1, a3, 0x88), Q[3] = _mm512_shuffle_f32x4(a1, a3, 0xDD);
}
template <bool INT>  // int32 lanes (kept in __m512 for the shuffles) or fp32
static inline __m512 add(__m512 a, __m512 b) {
  if constexpr (INT) return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  return _mm512_add_ps(a, b);
}
template <int L, bool INT = false>
static inline void step_group_sums(const __m512 D[16], __m512* out) {
  __m512 E[8];
  for (int i = 0; i < 8; ++i)
    E[i] = add<INT>(_mm512_shuffle_ps(D[2 * i], D[2 * i + 1], 0x88), _mm512_shuffle_ps(D[2 * i], D[2 * i + 1], 0xDD));
  if constexpr (L == 2) {
    __m512 F0[4], F1[4], Q0[4], Q1[4];
    for (int i = 0; i < 4; ++i)
      F0[i] = _mm512_shuffle_ps(E[2 * i], E[2 * i + 1], 0x88), F1[i] = _mm512_shuffle_ps(E[2 * i], E[2 * i + 1], 0xDD);
    quarters(F0, Q0), quarters(F1, Q1);
    for (int q = 0; q < 4; ++q) out[2 * q] = Q0[q], out[2 * q + 1] = Q1[q];
  } else {
    __m512 F[4], Q[4];
    for (int i = 0; i < 4; ++i)
      F[i] = add<INT>(_mm512_shuffle_ps(E[2 * i], E[2 * i + 1], 0x88), _mm512_shuffle_ps(E[2 * i], E[2 * i + 1], 0xDD));
    quarters(F, Q);
    if constexpr (L == 4) for (int q = 0; q < 4; ++q) out[q] = Q[q];
    if constexpr (L == 8) out[0] = add<INT>(Q[0], Q[1]), out[1] = add<INT>(Q[2], Q[3]);
    if constexpr (L == 16) out[0] = add<INT>(add<INT>(Q[0], Q[1]), add<INT>(Q[2], Q[3]));
  }
}

// 2- or 3-bit codes times bf16 inputs on vdpbf16ps, in the inputs' own order: a step's 32 codes (4 BITS bytes) are
// 32 bf16 words, code k + i in word i. Each 128-bit lane takes 8 codes, whose BITS bytes start at byte BITS l of a
// 16-byte load broadcast to the four lanes; vpshufb puts the two bytes around code i's bits in word i, a per-word
// shift brings the code down and vpermw looks it up as bf16 (it reads an index's low 5 bits: the table repeats the
// 2^BITS codes). Codes and bf16 inputs are exact in bf16, their products in fp32: the same products as
// rows_packed16's, per group summed, times the scale, plus the zero terms (row_scales) at the end. Used for 3 bits.
template <int BITS>
struct PackedBf16 {
  __m512i pick, shift, table;
  PackedBf16() {
    alignas(64) uint8_t pk[64];
    alignas(64) uint16_t sh[32], tb[32];
    for (int l = 0; l < 4; ++l)
      for (int j = 0; j < 8; ++j) {
        pk[16 * l + 2 * j] = uint8_t(BITS * l + BITS * j / 8);
        pk[16 * l + 2 * j + 1] = uint8_t(BITS * l + BITS * j / 8 + 1);
        sh[8 * l + j] = uint16_t(BITS * j % 8);
      }
    for (int i = 0; i < 32; ++i) {  // small integers: their bf16 is the top half of their fp32
      const float f = float(i & ((1 << BITS) - 1));
      uint32_t u;
      std::memcpy(&u, &f, 4);
      tb[i] = uint16_t(u >> 16);
    }
    pick = _mm512_load_si512(pk), shift = _mm512_load_si512(sh), table = _mm512_load_si512(tb);
  }
  // the 32 codes at b; whole: 16 bytes from b may be read (else only the step's 4 BITS)
  __m512bh words(const uint8_t* b, bool whole) const {
    const __m128i v = whole ? _mm_loadu_si128((const __m128i*)b)
                            : _mm_maskz_loadu_epi8(__mmask16((1 << (4 * BITS)) - 1), b);
    const __m512i q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(v), pick);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(q, shift), table);
  }
};

template <int NP, int BITS>
static void rows_packed_bf16(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                             const uint16_t* const* xb, const float* const* sxs, float* const* ys) {
  const PackedBf16<BITS> pb;
  const int64_t R = r1 - r0, G = K / g, row_bytes = K * BITS / 8, ahead = rows_ahead(row_bytes);
  RowScales rs;
  row_scales<NP>(sc, G, r0, r1, sxs, rs);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wp = w + r * row_bytes;
    if constexpr (NP <= 2) prefetch_bytes(wp + ahead * row_bytes, row_bytes);
    // two sums per input and group, two per input across groups (alternate groups): no add waits on the one before
    // (each indexed by constants only, so that they stay in registers)
    __m512 acc0[NP], acc1[NP];
    for (int p = 0; p < NP; ++p) acc0[p] = acc1[p] = _mm512_setzero_ps();
    const float* scale = rs.s + (r - r0);
    // a group's steps at b (its codes) and k (its first input); WHOLE: every step may read 16 bytes
    auto group = [&](const uint8_t* b, int64_t k, float s, __m512* acc, auto whole) {
      __m512 ga0[NP], ga1[NP];
      for (int p = 0; p < NP; ++p) ga0[p] = ga1[p] = _mm512_setzero_ps();
      const uint8_t* end = b + g * BITS / 8;
      for (; b + 8 * BITS <= end; b += 8 * BITS, k += 64) {
        const __m512bh q0 = pb.words(b, whole || b + 16 <= wp + row_bytes);
        const __m512bh q1 = pb.words(b + 4 * BITS, whole || b + 4 * BITS + 16 <= wp + row_bytes);
        for (int p = 0; p < NP; ++p) {
          ga0[p] = _mm512_dpbf16_ps(ga0[p], q0, (__m512bh)_mm512_loadu_si512(xb[p] + k));
          ga1[p] = _mm512_dpbf16_ps(ga1[p], q1, (__m512bh)_mm512_loadu_si512(xb[p] + k + 32));
        }
      }
      if (b < end) {  // an odd last step (groups of 32 inputs, 96, ...)
        const __m512bh q = pb.words(b, whole || b + 16 <= wp + row_bytes);
        for (int p = 0; p < NP; ++p) ga0[p] = _mm512_dpbf16_ps(ga0[p], q, (__m512bh)_mm512_loadu_si512(xb[p] + k));
      }
      const __m512 sv = _mm512_set1_ps(s);
      for (int p = 0; p < NP; ++p) acc[p] = _mm512_fmadd_ps(_mm512_add_ps(ga0[p], ga1[p]), sv, acc[p]);
    };
    // the groups before the last read 16 bytes at each step unchecked: a step's own 4 BITS bytes and the last
    // group's (8 at least, g >= 32) follow it in the row; the last one or two groups check
    const int64_t group_bytes = g * BITS / 8;
    int64_t gi = 0;
    const uint8_t* b = wp;
    for (; gi + 2 < G; gi += 2, b += 2 * group_bytes) {
      group(b, gi * g, scale[gi * R], acc0, std::true_type{});
      group(b + group_bytes, (gi + 1) * g, scale[(gi + 1) * R], acc1, std::true_type{});
    }
    for (; gi < G; ++gi, b += group_bytes) group(b, gi * g, scale[gi * R], acc0, std::false_type{});
    for (int p = 0; p < NP; ++p)
      ys[p][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[p], acc1[p])) + rs.zt[p * R + r - r0];
  }
}

// 3-bit codes on VBMI (Ice Lake, Zen 4 and later; function-level targets, called only where the processor has
// it), 64 codes (24 bytes) a step: vpermb puts codes 8 m..8 m + 7 (bytes 3 m..3 m + 2) in qword m, and
// vpmultishiftqb takes each code where it is wanted, no table: five instructions for 64 codes on bf16 inputs where
// the table's kernel spends six, three on 8-bit inputs where codes_as_bytes spends eight.
//  - times bf16 inputs (vdpbf16ps): code 8 m + j (first vector) and 8 m + 4 + j (second) to bits 4..6 of word
//    4 m + j's low byte, vpternlogd keeping those three bits under 0x3F80: the bf16 1 + q/8, exact. A group's dot
//    is then sum(x) + sum(x q) / 8, so it is scaled by 8 s and the zero terms take z - 16 s for z - 8 s (the same
//    sums of the group's inputs). The inputs come permuted to the words' order (layout 5: per 64 inputs, word
//    4 m + j <- input 8 m + j, word 32 + 4 m + j <- input 8 m + 4 + j).
//  - times 8-bit inputs (vpdpbusd): code 8 m + j to byte 8 m + j, masked to its 3 bits: the inputs in their order.
// Groups a multiple of 64.
#define ZOO_VBMI __attribute__((target("avx512vbmi")))
struct Int3Vbmi {
  __m512i window, first, second, bytes, keep, one;
  ZOO_VBMI Int3Vbmi() {
    alignas(64) uint8_t wi[64], a[64], b[64], c[64];
    for (int m = 0; m < 8; ++m)
      for (int j = 0; j < 8; ++j) {
        wi[8 * m + j] = uint8_t(3 * m + j);
        a[8 * m + j] = uint8_t((3 * (j / 2) - 4) & 63);  // (the high bytes' fields are cleared anyway)
        b[8 * m + j] = uint8_t((3 * (j / 2 + 4) - 4) & 63);
        c[8 * m + j] = uint8_t(3 * j);
      }
    window = _mm512_load_si512(wi), first = _mm512_load_si512(a), second = _mm512_load_si512(b);
    bytes = _mm512_load_si512(c), keep = _mm512_set1_epi16(0x70), one = _mm512_set1_epi16(0x3F80);
  }
  // the step's codes at b, qword m holding codes 8 m..; whole: 32 bytes from b may be read (else only the 24)
  ZOO_VBMI inline __m512i codes(const uint8_t* b, bool whole) const {
    const __m256i v = whole ? _mm256_loadu_si256((const __m256i*)b) : _mm256_maskz_loadu_epi8(0xffffff, b);
    return _mm512_permutexvar_epi8(window, _mm512_castsi256_si512(v));
  }
  ZOO_VBMI inline __m512bh words(__m512i c, bool second_half) const {
    return (__m512bh)_mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(second_half ? second : first, c), keep,
                                               one, 0xEA);  // (a & keep) | one
  }
  ZOO_VBMI inline __m512i as_bytes(__m512i c) const {
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(bytes, c), _mm512_set1_epi8(7));
  }
};

// one group's steps into acc (scale s): b its codes, k its first input; STEPS its steps of 64 (0: g / 64, at run
// time); LAST: the row's last group, whose last step reads its 24 bytes only. Q8: 8-bit inputs (int8_t), else bf16.
template <int NP, int STEPS, bool LAST, bool Q8>
ZOO_VBMI static inline __attribute__((always_inline)) void int3_vbmi_group(
    const Int3Vbmi& v, const uint8_t* b, int64_t k, int64_t g, float s, const void* const* xs, __m512* acc) {
  __m512 ga[NP];    // one chain per input (two spill at 8 inputs)
  __m512i gi32[NP];
  for (int p = 0; p < NP; ++p) ga[p] = _mm512_setzero_ps(), gi32[p] = _mm512_setzero_si512();
  const int64_t steps = STEPS ? STEPS : g / 64;
#pragma GCC unroll 2
  for (int64_t i = 0; i < steps; ++i, b += 24) {
    const __m512i c = v.codes(b, !LAST || i + 1 < steps);
    if constexpr (Q8) {
      const __m512i q = v.as_bytes(c);
      for (int p = 0; p < NP; ++p)
        gi32[p] = _mm512_dpbusd_epi32(gi32[p], q, _mm512_loadu_si512(static_cast<const int8_t*>(xs[p]) + k + 64 * i));
    } else {
      const __m512bh q0 = v.words(c, false), q1 = v.words(c, true);
      for (int p = 0; p < NP; ++p) {
        const uint16_t* x = static_cast<const uint16_t*>(xs[p]) + k + 64 * i;
        ga[p] = _mm512_dpbf16_ps(ga[p], q0, (__m512bh)_mm512_loadu_si512(x));
        ga[p] = _mm512_dpbf16_ps(ga[p], q1, (__m512bh)_mm512_loadu_si512(x + 32));
      }
    }
  }
  const __m512 sv = _mm512_set1_ps(Q8 ? s : 8 * s);
  for (int p = 0; p < NP; ++p) acc[p] = _mm512_fmadd_ps(Q8 ? _mm512_cvtepi32_ps(gi32[p]) : ga[p], sv, acc[p]);
}

template <int NP, int STEPS, bool Q8>
ZOO_VBMI static void rows_int3_vbmi_steps(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0,
                                         int64_t r1, const void* const* xs, const float* const* sxs,
                                         const float* xscale, float* const* ys) {
  const Int3Vbmi v;
  const int64_t R = r1 - r0, G = K / g, row_bytes = K * 3 / 8, group_bytes = g * 3 / 8;
  RowScales rs;
  row_scales<NP>(sc, G, r0, r1, sxs, rs, Q8 ? 8.f : 16.f);
  // each row's 16 lane sums kept until its block of 16 rows is done, then added across lanes for the 16 at once
  // (step_group_sums: a vector of the rows' sums) where a row's own horizontal sum was a chain of dependent adds at
  // its end (~29% of the kernel's samples): AMD Zen 5, [5632, 1024] experts, bf16 inputs, one thread from L3 1.07x;
  // from memory, 2 threads, interleaved in one process, [5632, 1024] / [1024, 2816]: 1.04 / 1.03x, 8-bit inputs
  // 1.03 / 1.07x (with the 2-bit rows' FULL blocks beside)
  __m512 sums[NP][16];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wp = w + r * row_bytes;
    __m512 acc0[NP], acc1[NP];  // alternate groups: no FMA waits on the one before
    for (int p = 0; p < NP; ++p) acc0[p] = acc1[p] = _mm512_setzero_ps();
    const float* scale = rs.s + (r - r0);
    int64_t gi = 0;
    for (; gi + 3 <= G; gi += 2) {
      // the weights ~8 KB ahead, a line (or less) a pair of groups, as the 2-bit rows ask: against a row's lines all
      // asked for at its start (rows_ahead), AMD Zen 5, 2 threads, interleaved in one process, bf16 / 8-bit inputs:
      // [5632, 1024] 1.07 / 1.04-1.05x, [2048, 2048] 0.94-1.05 / 0.99-1.06x, [4096, 14336] (Mixtral's down
      // projection, 84 lines a row: the burst outran what the core keeps in flight) 1.50 / 1.27x
      if constexpr (NP <= 2) __builtin_prefetch(wp + gi * group_bytes + kAheadBytes);
      int3_vbmi_group<NP, STEPS, false, Q8>(v, wp + gi * group_bytes, gi * g, g, scale[gi * R], xs, acc0);
      int3_vbmi_group<NP, STEPS, false, Q8>(v, wp + (gi + 1) * group_bytes, (gi + 1) * g, g, scale[(gi + 1) * R],
                                            xs, acc1);
    }
    if (gi + 2 == G)
      int3_vbmi_group<NP, STEPS, false, Q8>(v, wp + gi * group_bytes, gi * g, g, scale[gi * R], xs, acc1), ++gi;
    int3_vbmi_group<NP, STEPS, true, Q8>(v, wp + gi * group_bytes, gi * g, g, scale[gi * R], xs, acc0);
    const int i = (r - r0) % 16;
    for (int p = 0; p < NP; ++p) sums[p][i] = _mm512_add_ps(acc0[p], acc1[p]);
    if (i == 15 || r + 1 == r1) {  // the block's last row: its rows' sums, lane i row rb + i
      const int64_t rb = r - i;
      const __mmask16 m = __mmask16((2u << i) - 1);
      for (int p = 0; p < NP; ++p) {
        for (int j = i + 1; j < 16; ++j) sums[p][j] = _mm512_setzero_ps();
        __m512 y;
        step_group_sums<16>(sums[p], &y);
        y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(m, rs.zt + p * R + rb - r0));
        if constexpr (Q8) y = _mm512_mul_ps(y, _mm512_set1_ps(xscale[p]));
        _mm512_mask_storeu_ps(ys[p] + rb, m, y);
      }
    }
  }
}

// xs: bf16 inputs in layout 5, or (Q8) 8-bit ones in their order with their scales xscale
template <int NP, bool Q8>
static void rows_int3_vbmi(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                           const void* const* xs, const float* const* sxs, const float* xscale, float* const* ys) {
  if (g == 64) return rows_int3_vbmi_steps<NP, 1, Q8>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
  if (g == 128) return rows_int3_vbmi_steps<NP, 2, Q8>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
  rows_int3_vbmi_steps<NP, 0, Q8>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
}
#undef ZOO_VBMI
#endif

#ifdef ZOO_VNNI
// 2- or 3-bit codes times 8-bit inputs q (signed; x ~ q * input scale) on vpdpbusd, the codes (0..7) the unsigned
// operand: a chunk pair's 64 codes expanded to 64 bytes in registers, one vpdpbusd per input, exact int32 dots per
// group, then as block_int4_dot: s * dot + (z - 8 s) * sum(q) per group in fp32 (sxs: the sums of q), times the
// input's scale at the end. The inputs come permuted to the bytes' order (permute_for_packed, layout 2). A
// group's odd last chunk takes the same code with the second chunk's bytes read as zeros (zero codes add nothing).
// 2 bits: the 16 bytes broadcast to the four 128-bit lanes, lane s shifted by 2 s: byte 16 s + j = code 4 j + s.
// 3 bits: 128-bit lane l takes codes 16 l..16 l+15 (bytes 6 l..6 l+5): each 16-bit lane gathers the two bytes
// around one code (a byte shuffle) and shifts it down (vpsrlvw); byte 2 i of lane l = code 16 l + i, byte 2 i + 1
// = code 16 l + 8 + i. One or two inputs ask for the row ~8 KB ahead (AMD Zen 5, interleaved, [5632, 1024] /
// [1024, 2816] experts, g = 64, 3 bits: 2.5 / 2.2x on two threads, 2.6 / 2.6x on one: the rows had waited on memory).
template <int BITS>
static inline __m512i codes_as_bytes(const uint8_t* b, bool pair) {
  if (BITS == 2) {
    const __m128i v = pair ? _mm_loadu_si128((const __m128i*)b) : _mm_loadl_epi64((const __m128i*)b);
    const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0002000200020002, 0x0002000200020002, 0x0004000400040004,
                                             0x0004000400040004, 0x0006000600060006, 0x0006000600060006);
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i32x4(v), shifts), _mm512_set1_epi8(3));
  }
  alignas(64) static const int8_t lo[64] = {0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3,
                                            2, 3, 2, 3, 2, 3, 3, 4, 3, 4, 3, 4, 4, 5, 4, 5,
                                            0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3,
                                            2, 3, 2, 3, 2, 3, 3, 4, 3, 4, 3, 4, 4, 5, 4, 5};
  const __m512i mlo = _mm512_load_si512(lo), mhi = _mm512_add_epi8(mlo, _mm512_set1_epi8(3));
  // bit 3 m of a lane's 16-bit window m (m = 0..7), from byte 3 m / 8, at 3 m % 8; codes 8..15 three bytes on
  const __m512i shifts = _mm512_broadcast_i32x4(_mm_setr_epi16(0, 3, 6, 1, 4, 7, 2, 5));
  // lanes from bytes 0, 6, 12, 18: dwords 0, 1, 3, 4 (byte offsets 0, 4, 12, 16), the rest of the way in `lo`
  const __m512i v = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(pair ? 0xffffff : 0xfff, b));
  const __m512i spread = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 2, 3, 1, 2, 3, 4, 3, 4, 5, 6, 4, 5, 6, 7), v);
  const __m512i a = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(spread, mlo), shifts),
                                     _mm512_set1_epi16(7));
  const __m512i h = _mm512_slli_epi16(_mm512_srlv_epi16(_mm512_shuffle_epi8(spread, mhi), shifts), 8);
  return _mm512_ternarylogic_epi32(a, h, _mm512_set1_epi16(0x0700), 0xf8);  // a | (h & 0x0700)
}

template <int NP, int BITS>
static void rows_packed_dot(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                            const int8_t* const* xs, const float* const* sxs, const float* xscale, float* const* ys) {
  const int64_t R = r1 - r0, G = K / g, pairs = g / 64;
  const bool odd = g % 64 != 0;
  RowScales rs;
  row_scales<NP>(sc, G, r0, r1, sxs, rs);
  const int64_t ahead = rows_ahead(K * BITS / 8);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wp = w + r * (K * BITS / 8);
    if constexpr (NP <= 2) prefetch_bytes(wp + ahead * (K * BITS / 8), K * BITS / 8);
    __m512 acc0[NP], acc1[NP];  // two chains, alternating groups (a group of 64 is one vpdpbusd: the FMA would wait)
    for (int p = 0; p < NP; ++p) acc0[p] = acc1[p] = _mm512_setzero_ps();
    int64_t k = 0;
    auto group = [&](int64_t gi, __m512 (&acc)[NP]) {
      __m512i d[NP];
      for (int p = 0; p < NP; ++p) d[p] = _mm512_setzero_si512();
      for (int64_t i = 0; i < pairs; ++i, wp += 8 * BITS, k += 64) {
        const __m512i codes = codes_as_bytes<BITS>(wp, true);
        for (int p = 0; p < NP; ++p) d[p] = _mm512_dpbusd_epi32(d[p], codes, _mm512_loadu_si512(xs[p] + k));
      }
      if (odd) {  // 32 inputs: 2 bits, four 8-byte runs (one per shift) to the low halves of the 128-bit lanes
        const __m512i codes = codes_as_bytes<BITS>(wp, false);
        for (int p = 0; p < NP; ++p) {
          const __m512i x32 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(xs[p] + k)));
          const __m512i xq = BITS == 2 ? _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3), x32) : x32;
          d[p] = _mm512_dpbusd_epi32(d[p], codes, xq);
        }
        wp += 4 * BITS, k += 32;
      }
      const __m512 vs = _mm512_set1_ps(rs.s[gi * R + r - r0]);
      for (int p = 0; p < NP; ++p) acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[p]), vs, acc[p]);
    };
    int64_t gi = 0;
    // groups of whole chunk pairs: two groups a step, written out (1.09-1.34x the two lambda calls a step below on
    // 2/3-bit [5632, 1024] / [1024, 2816] / [4096, 8192] experts, the same outputs: interleaved, 2 threads)
    if (!odd) {
      const int64_t gb = pairs * 8 * BITS;  // a group's bytes
      for (; gi + 2 <= G; gi += 2, wp += 2 * gb, k += 2 * g) {
        __m512i d0[NP], d1[NP];
        for (int p = 0; p < NP; ++p) d0[p] = d1[p] = _mm512_setzero_si512();
        for (int64_t i = 0; i < pairs; ++i) {
          const __m512i a = codes_as_bytes<BITS>(wp + i * 8 * BITS, true);
          const __m512i b = codes_as_bytes<BITS>(wp + gb + i * 8 * BITS, true);
          for (int p = 0; p < NP; ++p) {
            d0[p] = _mm512_dpbusd_epi32(d0[p], a, _mm512_loadu_si512(xs[p] + k + 64 * i));
            d1[p] = _mm512_dpbusd_epi32(d1[p], b, _mm512_loadu_si512(xs[p] + k + g + 64 * i));
          }
        }
        const __m512 s0 = _mm512_set1_ps(rs.s[gi * R + r - r0]), s1 = _mm512_set1_ps(rs.s[(gi + 1) * R + r - r0]);
        for (int p = 0; p < NP; ++p) {
          acc0[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0[p]), s0, acc0[p]);
          acc1[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1[p]), s1, acc1[p]);
        }
      }
    }
    // groups ending in an odd chunk, and a last group left over, go through `group`
    for (; gi + 2 <= G; gi += 2) group(gi, acc0), group(gi + 1, acc1);
    if (gi < G) group(gi, acc0);
    for (int p = 0; p < NP; ++p)
      ys[p][r] = (_mm512_reduce_add_ps(_mm512_add_ps(acc0[p], acc1[p])) + rs.zt[p * R + r - r0]) * xscale[p];
  }
}
#endif

#ifdef ZOO_BF16_DOT
// The 2-bit rows on AVX-512 (bf16 and 8-bit inputs), 16 rows at a time (an item's last block may hold fewer), one
// input after the other, 256 codes (64 bytes, one load) a step: step_inputs(p, k) gives input p's vectors for the
// step at k, row_dots(v, x) a row's 16 lane sums from its step's 64 code bytes v and those inputs (fp32, or int32
// where INT), lane l holding codes 16 l..16 l + 15, all of one group (g divides 256 or 256 divides g). The 16 rows'
// lane sums become per-group sums of the 16 rows (step_group_sums), each times its group's 16 scales as stored, the
// zero terms beside them, so the scales need no preparation per item and the rows no reduction each; the outputs
// come times out_scale[p] where given (8-bit inputs' scales). The first input asks for the block ahead one line
// beside each line it reads, codes and scales. AMD Zen 5, [5632, 1024] / [1024, 2816] experts, g = 64, 2 threads,
// interleaved against a row at a time with each row's scales gathered first (row_scales and a 16 x 16
// transposition, a third of an item's time): bf16 inputs, one 1.43 / 1.55x, two 1.13 / 1.48x, four 1.58 / 1.47x,
// eight 0.97 / 1.41x; 8-bit inputs, one 1.21 / 1.50x, two 1.32 / 1.36x, four 1.40 / 1.06x. The block's lines asked
// for all at once came too late (its loads waited on memory: 1.30 / 1.08x).
// One block of rows rb.. (FULL: 16, the rows written out with no check; else `rows`, fewer). Whole blocks go through
// FULL: with the check in the loop the compiler kept it a loop, each row's sums stored to the stack and read back by
// step_group_sums. AMD Zen 5, [5632, 1024] experts, one thread, the same two experts from L3, against the loop: 8-bit
// inputs 1.44x, bf16 1.09x; from memory, 2 threads, interleaved in one process, [5632, 1024] / [1024, 2816]: bf16
// 1.03 / 1.11x, 8-bit inputs 0.99 / 1.10x (the larger gains where the machine read 60-65 GB/s).
template <int NP, int L, bool INT, bool FULL, class StepInputs, class RowDots>
static inline __attribute__((always_inline)) void int2_row_block(const uint8_t* w, const Scales& sc, int64_t K,
                                                                 int64_t g, int64_t rb, int64_t rows,
                                                                 int64_t row_bytes, int64_t ahead,
                                                                 const float* const* sxs, const float* out_scale,
                                                                 float* const* ys, StepInputs& step_inputs,
                                                                 RowDots& row_dots) {
  if constexpr (FULL) rows = 16;
  const int64_t pair_bytes = sc.bf16 ? 4 : 8;
  const uint8_t *wb = w + rb * row_bytes, *wf = wb + ahead * row_bytes;
  const char* sf = static_cast<const char*>(sc.ptr) + (rb + ahead) * pair_bytes;
  for (int p = 0; p < NP; ++p) {
    __m512 acc = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
    // one step at k: 256 codes, or (PART) the row's last K - k < 256, its bytes loaded under a mask (lanes past them
    // zeros, as are the inputs': step_inputs) and only its groups scaled (g divides 256 there)
    auto step = [&](int64_t k, auto part) __attribute__((always_inline)) {
      constexpr bool PART = decltype(part)::value;
      const __mmask64 bytes = PART ? ~0ull >> (64 - (K - k) / 4) : ~0ull;
      const auto x = step_inputs(p, k);
      __m512 D[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (!FULL && i >= rows) {  // (rows past the item's end: zeros)
          D[i] = _mm512_setzero_ps();
          continue;
        }
        const uint8_t* b = wb + i * row_bytes + k / 4;
        const __m512i v = PART ? _mm512_maskz_loadu_epi8(bytes, b) : _mm512_loadu_si512(b);
        if (p == 0) __builtin_prefetch(wf + i * row_bytes + k / 4);
        D[i] = row_dots(v, x);
      }
      __m512 sums[16 / L];
      step_group_sums<L, INT>(D, sums);
      for (int m = 0; m < 16 / L; ++m) {
        if (PART && k + 16 * L * m >= K) break;
        const int64_t gi = (k + 16 * L * m) / g;
        __m512 s, zm;
        scale_pairs16(sc, gi, rb, rows, s, zm);
        if (p == 0) prefetch_bytes(sf + gi * sc.N * pair_bytes, 16 * pair_bytes);
        acc = _mm512_fmadd_ps(s, INT ? _mm512_cvtepi32_ps(_mm512_castps_si512(sums[m])) : sums[m], acc);
        if (L < 16 || k % g == 0) zacc = _mm512_fmadd_ps(zm, _mm512_set1_ps(sxs[p][gi]), zacc);  // once a group
      }
    };
    int64_t k = 0;
    for (; k + 256 <= K; k += 256) step(k, std::false_type());
    if (k < K) step(k, std::true_type());
    const __m512 y = _mm512_add_ps(acc, zacc);
    _mm512_mask_storeu_ps(ys[p] + rb, __mmask16((1u << rows) - 1),
                          out_scale ? _mm512_mul_ps(y, _mm512_set1_ps(out_scale[p])) : y);
  }
}
template <int NP, int L, bool INT, class StepInputs, class RowDots>
static void int2_row_blocks(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                            const float* const* sxs, const float* out_scale, float* const* ys, StepInputs step_inputs,
                            RowDots row_dots) {
  const int64_t row_bytes = K / 4;
  const int64_t ahead = 16 * ((rows_ahead(row_bytes) + 15) / 16);  // rows: whole blocks, ~8 KB or more
  int64_t rb = r0;
  for (; rb + 16 <= r1; rb += 16)
    int2_row_block<NP, L, INT, true>(w, sc, K, g, rb, 16, row_bytes, ahead, sxs, out_scale, ys, step_inputs, row_dots);
  if (rb < r1)
    int2_row_block<NP, L, INT, false>(w, sc, K, g, rb, r1 - rb, row_bytes, ahead, sxs, out_scale, ys, step_inputs,
                                      row_dots);
}
template <int NP, bool INT, class StepInputs, class RowDots>
static void int2_rows(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                      const float* const* sxs, const float* out_scale, float* const* ys, StepInputs step_inputs,
                      RowDots row_dots) {
  switch (g >= 256 ? 16 : g / 16) {  // lanes a group (g divides 256 or 256 divides g)
    case 2: return int2_row_blocks<NP, 2, INT>(w, sc, K, g, r0, r1, sxs, out_scale, ys, step_inputs, row_dots);
    case 4: return int2_row_blocks<NP, 4, INT>(w, sc, K, g, r0, r1, sxs, out_scale, ys, step_inputs, row_dots);
    case 8: return int2_row_blocks<NP, 8, INT>(w, sc, K, g, r0, r1, sxs, out_scale, ys, step_inputs, row_dots);
    default: return int2_row_blocks<NP, 16, INT>(w, sc, K, g, r0, r1, sxs, out_scale, ys, step_inputs, row_dots);
  }
}
// 2-bit codes times bf16 inputs on vdpbf16ps: 16-bit word w of a step holds codes 8 w + j at bits 2 j, so pass j
// shifts the words right by 2 j and looks the low 5 bits up as bf16 (vpermw: the table repeats the 4 codes), against
// the inputs x[8 w + j] (layout 4: pass j's 32 words, word w <- input 8 w + j). Codes and bf16 inputs are exact in
// bf16, their products in fp32: the products rows_packed16 sums.
struct Bf16Step {
  __m512bh x[8];
};
template <int NP>
static void rows_int2_bf16(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                           const uint16_t* const* xb, const float* const* sxs, float* const* ys) {
  const __m512i table = PackedBf16<2>().table;  // the codes 0..3 as bf16, repeated
  auto step_inputs = [&](int p, int64_t k) {
    Bf16Step st;
    if (k + 256 <= K) {
      for (int j = 0; j < 8; ++j) st.x[j] = (__m512bh)_mm512_loadu_si512(xb[p] + k + 32 * j);
    } else {  // a last step of n < 256 codes: pass j's n / 8 words at k + n / 8 j, zeros past them
      const int64_t w = (K - k) / 8;
      for (int j = 0; j < 8; ++j) st.x[j] = (__m512bh)_mm512_maskz_loadu_epi16(~0u >> (32 - w), xb[p] + k + w * j);
    }
    return st;
  };
  auto row_dots = [&](__m512i v, const Bf16Step& st) {
    __m512 d0 = _mm512_setzero_ps(), d1 = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      d0 = _mm512_dpbf16_ps(d0, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 2 * j), table), st.x[j]);
      d1 = _mm512_dpbf16_ps(d1, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 2 * j + 8), table),
                            st.x[4 + j]);
    }
    return _mm512_add_ps(d0, d1);
  };
  int2_rows<NP, false>(w, sc, K, g, r0, r1, sxs, nullptr, ys, step_inputs, row_dots);
}
#endif

#ifdef ZOO_VNNI
// 2-bit codes times 8-bit inputs: byte i of a step holds codes 4 i + j at bits 2 j, so pass j takes (bytes >> 2 j) & 3
// against the inputs q[4 i + j] (layout 3), four vpdpbusd into one int32 vector (int2_row_blocks adds the lane sums
// into group sums in int32, exact, then scales them).
struct Int8Step {
  __m512i x[4];
};
template <int NP>
static void rows_int2_dot256(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                             const int8_t* const* xs, const float* const* sxs, const float* xscale,
                             float* const* ys) {
  const __m512i three = _mm512_set1_epi8(3), top = _mm512_set1_epi8(0x3f);
  auto step_inputs = [&](int p, int64_t k) {
    Int8Step st;
    if (k + 256 <= K) {
      for (int j = 0; j < 4; ++j) st.x[j] = _mm512_loadu_si512(xs[p] + k + 64 * j);
    } else {  // a last step of n < 256 codes: pass j's n / 4 bytes at k + n / 4 j, zeros past them
      const int64_t b = (K - k) / 4;
      for (int j = 0; j < 4; ++j) st.x[j] = _mm512_maskz_loadu_epi8(~0ull >> (64 - b), xs[p] + k + b * j);
    }
    return st;
  };
  auto row_dots = [&](__m512i v, const Int8Step& st) {
    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, three), st.x[0]);
    d = _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(v, 2), three), st.x[1]);
    d = _mm512_dpbusd_epi32(d, _mm512_and_si512(_mm512_srli_epi16(v, 4), three), st.x[2]);
    d = _mm512_dpbusd_epi32(d, _mm512_srli_epi16(_mm512_andnot_si512(top, v), 6), st.x[3]);  // each byte's top 2 bits
    return _mm512_castsi512_ps(d);
  };
  int2_rows<NP, true>(w, sc, K, g, r0, r1, sxs, xscale, ys, step_inputs, row_dots);
}
#endif

#if defined(ZOO_DOT8) && !defined(ZOO_VNNI)
// rows_int2_dot256 on AVX2: the same layout (layout 3) and step, each 64-byte step as two 32-byte halves. Half h's
// pass j is (bytes >> 2 j) & 3 against inputs 64 j + 32 h.. of the step; the four passes' vpmaddubsw pair sums add in
// 16 bits (at most 4 * 2 * 3 * 127) before one vpmaddwd, so 32-bit lane l sums codes 128 h + 16 l.. + 15 of the step,
// all of one group; each lane is scaled by its group's scale into the fp32 accumulator. One or two inputs go two
// rows a step (each input vector loaded once for both) and ask for the rows two steps ahead; the row scales come row
// by row from row_scales (they were gathered so after it). AMD EPYC Zen 3, [5632, 1024] experts, g = 64, one input,
// interleaved: the scales row by row 1.10-1.16x from memory (2 threads), two rows a step 1.12x in L2 (1 thread,
// 1.00x from memory), the prefetch 1.06-1.08x from memory.
// RS rows from row r (item row i0), each 32-byte half of a step multiplied by the same input vectors
template <int NP, int RS>
static inline void rows_int2_dot256_step(const uint8_t* wp, int64_t row_bytes, int64_t K, int64_t g,
                                         const RowScales& rs, int64_t R, int64_t i0, const int8_t* const* xs,
                                         const float* xscale, float* const* ys, int64_t r, __m256i groups) {
  const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
  const int64_t G = K / g;
  __m256 acc[RS][NP];
  for (int j = 0; j < RS; ++j)
    for (int p = 0; p < NP; ++p) acc[j][p] = _mm256_setzero_ps();
  // one half of the step at k: 32 code bytes, or (PART: the row's last K - k < 256 codes, pass j's n / 4 bytes at
  // k + n / 4 j) the half's `live` 4-byte words of them loaded under a mask, the rest zeros, codes and inputs
  auto half = [&](int64_t k, int h, auto part) __attribute__((always_inline)) {
    constexpr bool PART = decltype(part)::value;
    const int64_t pass = PART ? (K - k) / 4 : 64;  // a pass's bytes
    const int live = PART ? int(std::min<int64_t>(8, std::max<int64_t>(0, pass / 4 - 8 * h))) : 8;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    auto bytes = [&](const void* p) {
      return PART ? _mm256_maskload_epi32(static_cast<const int*>(p), mask) : load<__m256i>(p);
    };
    for (int j = 0; j < RS; ++j) {
      const __m256i v = bytes(wp + j * row_bytes + 32 * h);
      const __m256i c0 = _mm256_and_si256(v, three), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 2), three);
      const __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(v, 4), three);
      const __m256i c3 = _mm256_and_si256(_mm256_srli_epi16(v, 6), three);
      const float* srow = rs.s + (i0 + j) * G;
      const __m256 vs = _mm256_permutevar8x32_ps(_mm256_loadu_ps(srow + (k + 128 * h) / g), groups);
      for (int p = 0; p < NP; ++p) {
        const int8_t* x = xs[p] + k + 32 * h;
        __m256i d = _mm256_maddubs_epi16(c0, bytes(x));
        d = _mm256_add_epi16(d, _mm256_maddubs_epi16(c1, bytes(x + pass)));
        d = _mm256_add_epi16(d, _mm256_maddubs_epi16(c2, bytes(x + 2 * pass)));
        d = _mm256_add_epi16(d, _mm256_maddubs_epi16(c3, bytes(x + 3 * pass)));
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(d, ones));
        // (PART: the lanes past the codes hold zeros; their scales, read past the row's groups, are left out)
        acc[j][p] = _mm256_fmadd_ps(sums, PART ? _mm256_and_ps(vs, _mm256_castsi256_ps(mask)) : vs, acc[j][p]);
      }
    }
  };
  int64_t k = 0;
  for (; k + 256 <= K; k += 256, wp += 64) half(k, 0, std::false_type()), half(k, 1, std::false_type());
  if (k < K) {
    half(k, 0, std::true_type());
    if (K - k > 128) half(k, 1, std::true_type());
  }
  for (int j = 0; j < RS; ++j)
    for (int p = 0; p < NP; ++p) ys[p][r + j] = (hsum((vf8)acc[j][p]) + rs.zt[p * R + i0 + j]) * xscale[p];
}

// dst[i * G + gi] = src[gi * R + i]: row_scales' scales row by row, 8 groups x 8 rows at a time transposed in
// registers. The compiler's form of row_scales writing them so stored each scale apart (~18% of rows_int2_dot256's
// samples in L2); AMD EPYC Zen 3, [5632, 1024] / [1024, 2816] experts, g = 64, interleaved against it: one input
// 1.08x in L2 (1 thread), 1.03-1.06x from memory (2 threads); two inputs 1.10 / 1.04x.
static void scales_by_row(const float* src, int64_t G, int64_t R, float* dst) {
  int64_t gi = 0;
  for (; gi + 8 <= G; gi += 8) {
    int64_t i = 0;
    for (; i + 8 <= R; i += 8) {
      __m256 v[8], t[8];
      for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_ps(src + (gi + j) * R + i);
      for (int j = 0; j < 8; j += 2)
        t[j] = _mm256_unpacklo_ps(v[j], v[j + 1]), t[j + 1] = _mm256_unpackhi_ps(v[j], v[j + 1]);
      for (int j = 0; j < 8; j += 4)
        for (int h = 0; h < 2; ++h) {
          v[j + 2 * h] = _mm256_shuffle_ps(t[j + h], t[j + h + 2], 0x44);
          v[j + 2 * h + 1] = _mm256_shuffle_ps(t[j + h], t[j + h + 2], 0xee);
        }
      // v[0..3]: rows i, i+1, i+2, i+3 (and i+4.. in the high halves) of groups gi..gi+3; v[4..7] of gi+4..gi+7
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(dst + (i + j) * G + gi, _mm256_permute2f128_ps(v[j], v[4 + j], 0x20));
        _mm256_storeu_ps(dst + (i + 4 + j) * G + gi, _mm256_permute2f128_ps(v[j], v[4 + j], 0x31));
      }
    }
    for (; i < R; ++i)
      for (int j = 0; j < 8; ++j) dst[i * G + gi + j] = src[(gi + j) * R + i];
  }
  for (; gi < G; ++gi)
    for (int64_t i = 0; i < R; ++i) dst[i * G + gi] = src[gi * R + i];
}

template <int NP>
static void rows_int2_dot256(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                             const int8_t* const* xs, const float* const* sxs, const float* xscale,
                             float* const* ys) {
  const int64_t R = r1 - r0, row_bytes = K / 4;
  RowScales rs;
  row_scales<NP>(sc, K / g, r0, r1, sxs, rs);
  thread_local std::vector<float> by_row;  // each row's group scales together
  by_row.resize(K / g * R + 8);  // (+8: the step reads 8 scales from a row's group, past the last row's end)
  scales_by_row(rs.s, K / g, R, by_row.data());
  rs.s = by_row.data();
  alignas(32) int32_t lane_group[8];  // lane l's group, counted from its half's first
  for (int l = 0; l < 8; ++l) lane_group[l] = int32_t(g <= 128 ? 16 * l / g : 0);
  const __m256i groups = _mm256_load_si256(reinterpret_cast<const __m256i*>(lane_group));
  constexpr int RS = NP <= 2 ? 2 : 1;
  constexpr bool prefetch = kPrefetch && NP <= 2;
  int64_t r = r0;
  for (; r + RS <= r1; r += RS) {
    if constexpr (prefetch) prefetch_bytes(w + (r + 2 * RS) * row_bytes, RS * row_bytes);
    rows_int2_dot256_step<NP, RS>(w + r * row_bytes, row_bytes, K, g, rs, R, r - r0, xs, xscale, ys, r, groups);
  }
  for (; r < r1; ++r)
    rows_int2_dot256_step<NP, 1>(w + r * row_bytes, row_bytes, K, g, rs, R, r - r0, xs, xscale, ys, r, groups);
}
#endif

#if defined(ZOO_DOT8) && !defined(ZOO_VNNI)
// 3-bit codes times 8-bit inputs on AVX2, which has no per-lane 16-bit shift (vpsrlvw) to bring each code down as
// codes_as_bytes does: each 16-bit lane takes the two bytes around one code (a byte shuffle) and keeps the code's 3
// bits where they lie (a mask, 7 << o with o = 3 m % 8 for code m of a 32-code chunk). The inputs come as 16-bit
// words q << (7 - o) (XW, in order), so every vpmaddwd product is 128 * code * q whatever o is: exact int32 sums per
// group, scaled by s / 128. A chunk is 12 bytes: codes 0..15 from bytes 0..5, 16..31 from bytes 6..11. One or two
// inputs go two rows a step and ask for the rows two steps ahead. AMD EPYC Zen 3, [5632, 1024] experts, g = 64, one
// input, interleaved, against the float kernel on q as floats (before): 1.84x in L2 (1 thread), 1.83x from memory
// (2 threads); two inputs 1.69 / 2.07x, four 1.57 / 1.54x; the prefetch alone 1.08-1.14x from memory.
struct Int3Lanes {
  __m256i lo, hi, mask;
  // code m's byte pair (3 m / 8 and the next; the chunk's last code lies in byte 11 alone, -1: a zero byte) and its
  // bits' mask there (a constructor of its own: an implicit one is not compiled for the instruction set)
  Int3Lanes()
      : lo(_mm256_setr_epi8(0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3, 3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, 6, 5,
                            6)),
        hi(_mm256_setr_epi8(6, 7, 6, 7, 6, 7, 7, 8, 7, 8, 7, 8, 8, 9, 8, 9, 9, 10, 9, 10, 9, 10, 10, 11, 10, 11, 10, 11,
                            11, -1, 11, -1)),
        mask(_mm256_setr_epi16(7, 7 << 3, 7 << 6, 7 << 1, 7 << 4, 7 << 7, 7 << 2, 7 << 5, 7, 7 << 3, 7 << 6, 7 << 1,
                               7 << 4, 7 << 7, 7 << 2, 7 << 5)) {}
};

// one chunk's codes (its 12 bytes in both 128-bit lanes) times the inputs from k, into d
template <int NP>
static inline void int3_chunk(const Int3Lanes& c, __m256i both, const int16_t* const* xs, int64_t k, __m256i* d) {
  const __m256i c0 = _mm256_and_si256(_mm256_shuffle_epi8(both, c.lo), c.mask);
  const __m256i c1 = _mm256_and_si256(_mm256_shuffle_epi8(both, c.hi), c.mask);
  for (int p = 0; p < NP; ++p)
    d[p] = _mm256_add_epi32(d[p], _mm256_add_epi32(_mm256_madd_epi16(c0, load<__m256i>(xs[p] + k)),
                                                   _mm256_madd_epi16(c1, load<__m256i>(xs[p] + k + 16))));
}

// A chunk's 12 bytes are read as 16 (the next chunk's first four unused), but the row's last chunk: there the 16
// bytes ending with it, moved down by 4 (never past the row, which may end the allocation), or apart if it is alone
static inline __m256i int3_last_chunk(const uint8_t* b, int64_t K) {
  if (K > 32) return _mm256_broadcastsi128_si256(_mm_srli_si128(_mm_loadu_si128((const __m128i*)(b - 4)), 4));
  uint32_t tail;
  std::memcpy(&tail, b + 8, 4);
  return _mm256_broadcastsi128_si256(_mm_insert_epi32(_mm_loadl_epi64((const __m128i*)b), int(tail), 2));
}

// RS rows from row r (item row i0), every chunk's codes of them multiplied by the same input vectors
template <int NP, int RS>
static inline void rows_int3_dot_step(const uint8_t* b, int64_t row_bytes, int64_t K, int64_t g, const RowScales& rs,
                                      int64_t R, int64_t i0, const int16_t* const* xs, const float* xscale,
                                      float* const* ys, int64_t r, const Int3Lanes& c) {
  __m256 acc[RS][NP];
  for (int j = 0; j < RS; ++j)
    for (int p = 0; p < NP; ++p) acc[j][p] = _mm256_setzero_ps();
  const int64_t G = K / g;
  for (int64_t gi = 0, k = 0; gi < G; ++gi) {
    __m256i d[RS][NP];
    for (int j = 0; j < RS; ++j)
      for (int p = 0; p < NP; ++p) d[j][p] = _mm256_setzero_si256();
    const int64_t whole = gi + 1 < G ? g / 32 : g / 32 - 1;
    for (int64_t i = 0; i < whole; ++i, k += 32, b += 12)
      for (int j = 0; j < RS; ++j)
        int3_chunk<NP>(c, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + j * row_bytes))), xs, k,
                       d[j]);
    if (gi + 1 == G)
      for (int j = 0; j < RS; ++j) int3_chunk<NP>(c, int3_last_chunk(b + j * row_bytes, K), xs, k, d[j]);
    for (int j = 0; j < RS; ++j) {
      const __m256 s = _mm256_set1_ps(rs.s[gi * R + i0 + j] * (1.f / 128));
      for (int p = 0; p < NP; ++p) acc[j][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[j][p]), s, acc[j][p]);
    }
  }
  for (int j = 0; j < RS; ++j)
    for (int p = 0; p < NP; ++p) ys[p][r + j] = (hsum((vf8)acc[j][p]) + rs.zt[p * R + i0 + j]) * xscale[p];
}

template <int NP>
static void rows_int3_dot(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                          const int16_t* const* xs, const float* const* sxs, const float* xscale, float* const* ys) {
  const int64_t R = r1 - r0, row_bytes = K * 3 / 8;
  RowScales rs;
  row_scales<NP>(sc, K / g, r0, r1, sxs, rs);
  const Int3Lanes c;
  constexpr int RS = NP <= 2 ? 2 : 1;  // (4 for one input: no faster)
  constexpr bool prefetch = kPrefetch && NP <= 2;
  int64_t r = r0;
  for (; r + RS <= r1; r += RS) {
    if constexpr (prefetch) prefetch_bytes(w + (r + 2 * RS) * row_bytes, RS * row_bytes);
    rows_int3_dot_step<NP, RS>(w + r * row_bytes, row_bytes, K, g, rs, R, r - r0, xs, xscale, ys, r, c);
  }
  for (; r < r1; ++r) rows_int3_dot_step<NP, 1>(w + r * row_bytes, row_bytes, K, g, rs, R, r - r0, xs, xscale, ys, r, c);
}

// 3-bit rows times many 8-bit inputs on AVX2: each chunk's 32 codes become 32 bytes once (shared by the inputs),
// then one vpmaddubsw an input, where rows_int3_dot spends two vpmaddwd on 16-bit words an input. Codes m and m + 8
// of a 16-code half lie at the same bit offset o = 3 m % 8 (three bytes apart), so a 32-bit lane takes the two bytes
// around each (a byte shuffle) and one vpsrlvd brings both down; vpackuswb leaves byte 16 l + 2 m + h = code
// 16 l + 8 h + m, the order the inputs come in (layout 2 of permute_for_packed, as codes_as_bytes' bytes). A group
// of up to 4 chunks is summed in 16 bits and four inputs' sums are added across lanes together (vphaddw), so that
// one vpmaddwd, conversion and multiply-add scale them; groups of 1, 2 or 4 chunks are unrolled (CH).
// AMD EPYC Zen 3, g = 64, interleaved, against rows_int3_dot: 8 inputs 1.27x in L2 (1 thread, 2 x [512, 1024]),
// 1.44x from memory (2 threads, 32 x [5632, 1024]), 1.34x ([1024, 2816]); 6 inputs 1.15 / 1.07 / 1.09x; 4 or 5
// inputs 0.91-1.09x, so from 6 (INT3_BYTES_FROM). Forms that lost: a multiply-high by 2^(16 - o) instead of the
// shift (0.6-0.9x), the group's chunks in a loop (in L2 0.80 / 0.93x at 4 / 8 inputs: the short loop, not the
// products, was the cost).
constexpr int INT3_BYTES_FROM = 6;
struct Int3Bytes {
  __m256i pick[2], shift[2];
  Int3Bytes() {
    alignas(32) int8_t t[2][32];
    alignas(32) int32_t o[2][8];
    for (int v = 0; v < 2; ++v)
      for (int l = 0; l < 8; ++l) {  // vector v's 32-bit lane l: codes m = 16 (l / 4) + 4 v + l % 4 and m + 8
        const int m = 16 * (l / 4) + 4 * v + l % 4;
        for (int h = 0; h < 2; ++h) {
          const int byte = 3 * (m + 8 * h) / 8;
          t[v][4 * l + 2 * h] = int8_t(byte);
          t[v][4 * l + 2 * h + 1] = int8_t(byte < 11 ? byte + 1 : -1);  // (-1: a zero byte; the last code needs none)
        }
        o[v][l] = 3 * m % 8;
      }
    for (int v = 0; v < 2; ++v) pick[v] = load<__m256i>(t[v]), shift[v] = load<__m256i>(o[v]);
  }
  __m256i codes(__m256i both) const {  // a chunk's 12 bytes (in both 128-bit lanes) as 32 code bytes
    const __m256i seven = _mm256_set1_epi16(7);
    const __m256i c0 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(both, pick[0]), shift[0]), seven);
    const __m256i c1 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(both, pick[1]), shift[1]), seven);
    return _mm256_packus_epi16(c0, c1);
  }
};

// inputs 4 q .. 4 q + 3's 16-bit group sums added across lanes (each lane then sums 4 of a sum's: below 2^15 for up
// to 4 chunks, |4 * 4 * 2 * 7 * 127|), widened, scaled: lanes [p0 p1 p2 p3 | p0 p1 p2 p3]
template <int NP>
static inline void int3_four_sums(const __m256i* h, __m256 s, __m256* acc4) {
  const __m256i z = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
  for (int q = 0; q < (NP + 3) / 4; ++q) {
    const __m256i h1 = 4 * q + 1 < NP ? h[4 * q + 1] : z, h2 = 4 * q + 2 < NP ? h[4 * q + 2] : z;
    const __m256i h3 = 4 * q + 3 < NP ? h[4 * q + 3] : z;
    const __m256i y = _mm256_hadd_epi16(_mm256_hadd_epi16(h[4 * q], h1), _mm256_hadd_epi16(h2, h3));
    acc4[q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(y, ones)), s, acc4[q]);
  }
}

// CH: the group's chunks (1, 2 or 4: unrolled), or 0: any count (runs of up to 16 chunks summed in 16 bits)
template <int NP, int CH>
static void rows_int3_bytes_of(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                               const int8_t* const* xs, const float* const* sxs, const float* xscale,
                               float* const* ys) {
  const int64_t R = r1 - r0, row_bytes = K * 3 / 8, G = K / g, chunks = g / 32;
  RowScales rs;
  row_scales<NP>(sc, G, r0, r1, sxs, rs);
  const Int3Bytes c;
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int B = (NP + 3) / 4;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* b = w + r * row_bytes;
    __m256 acc[NP], acc4[B];  // per input (groups past 4 chunks), per 4 inputs (int3_four_sums)
    for (int p = 0; p < NP; ++p) acc[p] = _mm256_setzero_ps();
    for (int q = 0; q < B; ++q) acc4[q] = _mm256_setzero_ps();
    for (int64_t gi = 0, k = 0; gi < G; ++gi) {
      const __m256 s = _mm256_set1_ps(rs.s[gi * R + r - r0]);
      __m256i h[NP];
      if (CH > 0 && gi + 1 < G) {  // (the row's last chunk is read apart: int3_last_chunk)
        for (int j = 0; j < CH; ++j) {
          const __m256i q = c.codes(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + 12 * j))));
          for (int p = 0; p < NP; ++p) {
            const __m256i d = _mm256_maddubs_epi16(q, load<__m256i>(xs[p] + k + 32 * j));
            h[p] = j ? _mm256_add_epi16(h[p], d) : d;
          }
        }
        k += 32 * CH, b += 12 * CH;
        int3_four_sums<NP>(h, s, acc4);
        continue;
      }
      for (int64_t i = 0; i < chunks; i += 16) {  // each lane two products of at most 7 * 127 a chunk
        for (int p = 0; p < NP; ++p) h[p] = _mm256_setzero_si256();
        for (int64_t j = i; j < std::min(chunks, i + 16); ++j, k += 32, b += 12) {
          const __m256i both = k + 32 < K ? _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b))
                                          : int3_last_chunk(b, K);
          const __m256i q = c.codes(both);
          for (int p = 0; p < NP; ++p)
            h[p] = _mm256_add_epi16(h[p], _mm256_maddubs_epi16(q, load<__m256i>(xs[p] + k)));
        }
        if (chunks <= 4) {
          int3_four_sums<NP>(h, s, acc4);
        } else {
          for (int p = 0; p < NP; ++p)
            acc[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(h[p], ones)), s, acc[p]);
        }
      }
    }
    alignas(32) float lanes[8];
    for (int p = 0; p < NP; ++p) {
      if (p % 4 == 0) _mm256_store_ps(lanes, acc4[p / 4]);
      const float total = hsum((vf8)acc[p]) + lanes[p % 4] + lanes[4 + p % 4];
      ys[p][r] = (total + rs.zt[p * R + r - r0]) * xscale[p];
    }
  }
}

template <int NP>
static void rows_int3_bytes(const uint8_t* w, const Scales& sc, int64_t K, int64_t g, int64_t r0, int64_t r1,
                            const int8_t* const* xs, const float* const* sxs, const float* xscale, float* const* ys) {
  if constexpr (NP >= INT3_BYTES_FROM) {
    switch (g / 32) {
      case 1: return rows_int3_bytes_of<NP, 1>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
      case 2: return rows_int3_bytes_of<NP, 2>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
      case 4: return rows_int3_bytes_of<NP, 4>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
      default: return rows_int3_bytes_of<NP, 0>(w, sc, K, g, r0, r1, xs, sxs, xscale, ys);
    }
  }
}
#endif

// Dequantise one int4 block of 64 rows into the transposed weight wt [K, N] (float or bf16, rounded to nearest
// even): the pack is k-major, so each k's 64 values are contiguous in wt too.
static inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline void store(uint16_t* p, vf v) {
  vu32 u = (vu32)v;
  u += 0x7fffu + ((u >> 16) & 1u);
  vu16 h = __builtin_convertvector(u >> 16, vu16);
  std::memcpy(p, &h, sizeof h);
}

template <class OUT>
static void dequant_block_int4(const uint8_t* blk, const Scales& sc, int64_t K, int64_t g, int64_t N, int64_t n0,
                               OUT* wt) {
  constexpr int C = 32 / L;
  for (int64_t gi = 0; gi < K / g; ++gi) {
    vf s[2 * C], zm[2 * C];
    for (int c = 0; c < 2 * C; ++c)
      for (int i = 0; i < L; ++i) {
        s[c][i] = sc.scale(gi, n0 + c * L + i);
        zm[c][i] = sc.zero(gi, n0 + c * L + i) - 8 * s[c][i];
      }
    for (int64_t k = gi * g; k < (gi + 1) * g; ++k)
      for (int c = 0; c < C; ++c) {
        vf lo, hi;
        nibbles_to_float(blk + k * 32 + c * L, lo, hi);
        store(wt + k * N + n0 + c * L, lo * s[c] + zm[c]);
        store(wt + k * N + n0 + (C + c) * L, hi * s[C + c] + zm[C + c]);
      }
  }
}

template <class OUT>
static void dequant_int4(const uint8_t* w, const Scales& sc, int64_t N, int64_t K, int64_t g, OUT* wt) {
  const int64_t blocks = N / 64;
  at::parallel_for(0, blocks + 1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      if (b < blocks) {
        dequant_block_int4(w + b * 64 * K / 2, sc, K, g, N, b * 64, wt);
        continue;
      }
      const int64_t full = blocks * 64, tail = N - full;  // two rows per byte past the last full block
      for (int64_t r = full; r < N; ++r)
        for (int64_t k = 0; k < K; ++k) {
          const int64_t j = r - full;
          float q = float((w[full * K / 2 + k * (tail / 2) + j / 2] >> (4 * (j & 1))) & 15);
          float s = sc.scale(k / g, r);
          float v = (q - 8) * s + sc.zero(k / g, r);
          if constexpr (sizeof(OUT) == 2) {
            uint32_t u;
            std::memcpy(&u, &v, 4);
            wt[k * N + r] = OUT((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
          } else {
            wt[k * N + r] = v;
          }
        }
    }
  });
}

// One row of 2/3-bit codes in their stored form (2 bits: four codes a byte; 3 bits: eight codes in three bytes,
// little end first) dequantised, w = (q - 8) s + z: eight codes a step, for the compiler to vectorise
template <int BITS, class OUT>
static inline void dequant_packed_row(const uint8_t* src, const Scales& sc, int64_t n, int64_t K, int64_t g,
                                      OUT* dst) {
  for (int64_t g0 = 0; g0 < K; g0 += g) {
    const float s = sc.scale(g0 / g, n), z = sc.zero(g0 / g, n);
    for (int64_t k = g0; k < g0 + g; k += 8) {
      const uint8_t* b = src + k * BITS / 8;
      const uint32_t word = BITS == 2 ? uint32_t(b[0]) | uint32_t(b[1]) << 8
                                      : uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16;
      for (int j = 0; j < 8; ++j) {
        const float v = (float((word >> (BITS * j)) & ((1u << BITS) - 1)) - 8.f) * s + z;
        if constexpr (sizeof(OUT) == 2) {
          uint32_t u;
          std::memcpy(&u, &v, 4);
          dst[k + j] = OUT((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        } else {
          dst[k + j] = v;
        }
      }
    }
  }
}

template <class OUT>
static void dequant_packed(const uint8_t* w, const Scales& sc, int64_t N, int64_t K, int64_t g, int bits, OUT* out) {
  const int64_t row_bytes = K * bits / 8;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (bits == 2)
        dequant_packed_row<2>(w + n * row_bytes, sc, n, K, g, out + n * K);
      else
        dequant_packed_row<3>(w + n * row_bytes, sc, n, K, g, out + n * K);
    }
  });
}

#ifdef ZOO_DOT8
// A chunk's 8-bit inputs as the dot products' signed operand (rows of q, for codes) and their scales
static inline void signed_8bit_inputs(const Problem& pb, int np, const int64_t* in_row, const int8_t** xqs,
                                      float* scales) {
  for (int p = 0; p < np; ++p) {
    xqs[p] = reinterpret_cast<const int8_t*>(pb.XQ) + in_row[p] * pb.K;
    scales[p] = pb.XQS[in_row[p]];
  }
}
#endif

#ifdef ZOO_SUBNORMAL_CODES
// A chunk's inputs scaled for the codes read as subnormals (XS) and their unscale factors; false where the call has
// none or where this thread reads subnormal operands as zeros (MXCSR's DAZ bit: torch.set_flush_denormal(True)), and
// the kernels convert the codes
static inline bool subnormal_inputs(const Problem& pb, int np, const int64_t* in_row, const float** xss,
                                    float* unscale) {
  if (!pb.XS || (_mm_getcsr() & 0x40)) return false;
  for (int p = 0; p < np; ++p) {
    xss[p] = pb.XS + in_row[p] * pb.K;
    unscale[p] = pb.XSU[in_row[p]];
  }
  return true;
}
#endif

// One chunk of a work item: its rows [r0, r1) of one expert for np of its pairs (1..8), whose input and output rows
// are in_row[0..np), out_row[0..np).
static void run_chunk(const Problem& pb, const Item& it, int np, const int64_t* in_row, const int64_t* out_row) {
  const float* xs[8];
  const float* sxs[8];
  float* ys[8];
  for (int p = 0; p < np; ++p) {
    xs[p] = pb.X + in_row[p] * pb.K;
    sxs[p] = pb.SX ? pb.SX + in_row[p] * (pb.K / pb.g) : nullptr;
    ys[p] = pb.Y + out_row[p] * pb.N;
  }
  const uint8_t* w = static_cast<const uint8_t*>(pb.w) + it.slot * pb.expert_bytes;
  Scales sc = pb.scales.of_slot(it.slot);
#define ZOO_NP(CALL)                                   \
  switch (np) {                                        \
    case 1: { constexpr int NP = 1; CALL; break; }     \
    case 2: { constexpr int NP = 2; CALL; break; }     \
    case 3: { constexpr int NP = 3; CALL; break; }     \
    case 4: { constexpr int NP = 4; CALL; break; }     \
    case 5: { constexpr int NP = 5; CALL; break; }     \
    case 6: { constexpr int NP = 6; CALL; break; }     \
    case 7: { constexpr int NP = 7; CALL; break; }     \
    default: { constexpr int NP = 8; CALL; break; }    \
  }
  switch (pb.kind) {
    case Kind::f32:
      ZOO_NP((rows_dense<NP>(reinterpret_cast<const float*>(w), sc, pb.K, it.r0, it.r1, xs, ys)));
      break;
    case Kind::bf16:
#ifdef ZOO_BF16_DOT
      if (pb.XB) {
        const uint16_t* xbs[8];
        for (int p = 0; p < np; ++p) xbs[p] = pb.XB + in_row[p] * pb.K;
        ZOO_NP((rows_bf16_dot<NP>(reinterpret_cast<const uint16_t*>(w), pb.K, it.r0, it.r1, xbs, ys)));
        break;
      }
#endif
      ZOO_NP((rows_dense<NP>(reinterpret_cast<const uint16_t*>(w), sc, pb.K, it.r0, it.r1, xs, ys)));
      break;
    case Kind::int8:
#ifdef ZOO_DOT8
      if (pb.XQ) {
        const uint8_t* xqs[8];
        float scales[8];
        for (int p = 0; p < np; ++p) {
          xqs[p] = pb.XQ + in_row[p] * pb.K;
          scales[p] = pb.XQS[in_row[p]];
        }
        ZOO_NP((rows_int8_dot<NP>(reinterpret_cast<const int8_t*>(w), sc, pb.K, it.r0, it.r1, xqs, scales, ys)));
        break;
      }
#endif
#ifdef ZOO_BF16_DOT
      if (pb.XB) {
        const uint16_t* xbs[8];
        for (int p = 0; p < np; ++p) xbs[p] = pb.XB + in_row[p] * pb.K;
        ZOO_NP((rows_int8_bf16<NP>(reinterpret_cast<const int8_t*>(w), sc, pb.K, it.r0, it.r1, xbs, ys)));
        break;
      }
#endif
      ZOO_NP((rows_dense<NP>(reinterpret_cast<const int8_t*>(w), sc, pb.K, it.r0, it.r1, xs, ys)));
      break;
    case Kind::int4:
#ifdef ZOO_DOT8
      if (pb.XQ) {
        const int8_t* xqs[8];
        float scales[8];
        signed_8bit_inputs(pb, np, in_row, xqs, scales);
        if (it.r1 - it.r0 == 64 && it.r0 + 64 <= pb.N / 64 * 64) {
          ZOO_NP((block_int4_dot<NP>(w + it.r0 * pb.K / 2, sc, pb.K, pb.g, it.r0, xqs, sxs, scales, ys)));
        } else {
          int4_tail(w, sc, pb.N, pb.K, pb.g, it.r0, it.r1, np, xqs, sxs, scales, ys);
        }
        break;
      }
#endif
#ifdef ZOO_BF16_DOT
      if (pb.XB && it.r1 - it.r0 == 64 && it.r0 + 64 <= pb.N / 64 * 64) {
        const uint16_t* xbs[8];
        for (int p = 0; p < np; ++p) xbs[p] = pb.XB + in_row[p] * pb.K;
        ZOO_NP((block_int4_bf16<NP>(w + it.r0 * pb.K / 2, sc, pb.K, pb.g, it.r0, xbs, sxs, ys)));
        break;
      }
#endif
      if (it.r1 - it.r0 == 64 && it.r0 + 64 <= pb.N / 64 * 64) {
#ifdef ZOO_SUBNORMAL_CODES
        const float* xss[8];
        float unscale[8];
        if (subnormal_inputs(pb, np, in_row, xss, unscale)) {
          ZOO_NP((block_int4<NP, true>(w + it.r0 * pb.K / 2, sc, pb.K, pb.g, it.r0, xss, sxs, ys, unscale)));
          break;
        }
#endif
        ZOO_NP((block_int4<NP>(w + it.r0 * pb.K / 2, sc, pb.K, pb.g, it.r0, xs, sxs, ys)));
      } else {
        int4_tail(w, sc, pb.N, pb.K, pb.g, it.r0, it.r1, np, xs, sxs, nullptr, ys);
      }
      break;
    case Kind::int2:
    case Kind::int3: {
#ifdef ZOO_DOT8
      if (pb.XQ) {  // (on AVX2 2-bit rows outside steps of 256 run the float kernel: moe_gemv)
        const int8_t* xqs[8];
        float scales[8];
        signed_8bit_inputs(pb, np, in_row, xqs, scales);
        if (pb.kind == Kind::int2 && int2_steps_of_256(pb.g)) {
          ZOO_NP((rows_int2_dot256<NP>(w, sc, pb.K, pb.g, it.r0, it.r1, xqs, sxs, scales, ys)));
#ifdef ZOO_VNNI
        } else if (pb.kind == Kind::int2) {
          ZOO_NP((rows_packed_dot<NP, 2>(w, sc, pb.K, pb.g, it.r0, it.r1, xqs, sxs, scales, ys)));
        } else if (pb.int3_vbmi) {
          ZOO_NP((rows_int3_vbmi<NP, true>(w, sc, pb.K, pb.g, it.r0, it.r1, (const void* const*)xqs, sxs, scales,
                                           ys)));
        } else {
          ZOO_NP((rows_packed_dot<NP, 3>(w, sc, pb.K, pb.g, it.r0, it.r1, xqs, sxs, scales, ys)));
#else
        } else {
          if (np >= INT3_BYTES_FROM) {  // (rows_int3_bytes: instantiated from there only)
            ZOO_NP((rows_int3_bytes<NP>(w, sc, pb.K, pb.g, it.r0, it.r1, xqs, sxs, scales, ys)));
          } else {
            const int16_t* xws[8];
            for (int p = 0; p < np; ++p) xws[p] = pb.XW + in_row[p] * pb.K;
            ZOO_NP((rows_int3_dot<NP>(w, sc, pb.K, pb.g, it.r0, it.r1, xws, sxs, scales, ys)));
          }
#endif
        }
        break;
      }
#endif
#ifdef ZOO_BF16_DOT
      if (pb.XB) {  // 2 bits: in steps of 256 only (moe_gemv_rows)
        const uint16_t* xbs[8];
        for (int p = 0; p < np; ++p) xbs[p] = pb.XB + in_row[p] * pb.K;
        if (pb.kind == Kind::int2) {
          ZOO_NP((rows_int2_bf16<NP>(w, sc, pb.K, pb.g, it.r0, it.r1, xbs, sxs, ys)));
        } else {
          if (pb.int3_vbmi) {
            ZOO_NP((rows_int3_vbmi<NP, false>(w, sc, pb.K, pb.g, it.r0, it.r1, (const void* const*)xbs, sxs,
                                              nullptr, ys)));
          } else {
            ZOO_NP((rows_packed_bf16<NP, 3>(w, sc, pb.K, pb.g, it.r0, it.r1, xbs, sxs, ys)));
          }
        }
        break;
      }
#endif
#if ZOO_LANES == 16
#define ZOO_ROWS_PACKED rows_packed16
#else
#define ZOO_ROWS_PACKED rows_packed
#endif
#ifdef ZOO_SUBNORMAL_CODES
      const float* xss[8];
      float unscale[8];
      if (subnormal_inputs(pb, np, in_row, xss, unscale)) {
        if (pb.kind == Kind::int2) {
          ZOO_NP((rows_packed<NP, 2, true>(w, sc, pb.K, pb.g, it.r0, it.r1, xss, sxs, ys, unscale)));
        } else {
          ZOO_NP((rows_packed<NP, 3, true>(w, sc, pb.K, pb.g, it.r0, it.r1, xss, sxs, ys, unscale)));
        }
        break;
      }
#endif
      if (pb.kind == Kind::int2) {
        ZOO_NP((ZOO_ROWS_PACKED<NP, 2>(w, sc, pb.K, pb.g, it.r0, it.r1, xs, sxs, ys)));
      } else {
        ZOO_NP((ZOO_ROWS_PACKED<NP, 3>(w, sc, pb.K, pb.g, it.r0, it.r1, xs, sxs, ys)));
      }
#undef ZOO_ROWS_PACKED
      break;
    }
  }
#undef ZOO_NP
}

#ifdef ZOO_BF16_DOT
// Whether a block of bf16 or int8 rows goes through a tile for np pairs (run_on_tile): from 8 pairs whose bf16 inputs
// pass L1's 32 KB (the rows kernels then read them from L2 for every weight vector), else from 16. Measured on the
// 304M model's experts (8, 2 threads), tile against rows: [5632, 1024] bf16 0.77x at 8 pairs, 1.06x at 16, 1.16x at
// 48 (int8 0.74 / 1.11 / 1.59x); [1024, 2816] bf16 1.01x at 4, 1.45x at 8, 1.95x at 48 (int8 0.97 / 1.28 / 1.89x);
// tiles past L2 too, bf16 [512, 14336] / [1024, 8192] / [2048, 4096]: 1.15-1.24x at 8 pairs, 1.71-1.80x at 16
static inline bool tile_serves(int np, int64_t K) { return np >= 16 || (np >= 8 && np * K >= 16384); }

// An item of several pairs on a full block of bf16 or int8 rows with bf16 inputs: the block as a tile of bf16 pairs
// (gemm_bf16, tiles.h) and every pair's input multiplied there, 6 at a time with no horizontal sums, where the rows
// kernels load each input once per weight vector and sum each row's lanes at its end. int8: the codes are exact in
// bf16 and the row scales multiply the fp32 sums, as rows_int8_bf16 computes. Whether it served the item.
static bool run_on_tile(const Problem& pb, const Item& it, const int64_t* in_row, const int64_t* out_row) {
  const bool serves = pb.kind == Kind::int8 && pb.int8_tile_from > 0 ? it.np >= pb.int8_tile_from
                                                                       : tile_serves(it.np, pb.K);
  if (!pb.XB || pb.XQ || !serves || it.r1 - it.r0 != 64 || pb.K % 32 != 0 ||
      (pb.kind != Kind::bf16 && pb.kind != Kind::int8))
    return false;
  thread_local std::vector<uint32_t> tile;
  tile.resize(pb.K / 2 * 64);
  const char* w = static_cast<const char*>(pb.w) + it.slot * pb.expert_bytes;
  float rs[64];
  if (pb.kind == Kind::bf16) {
    gemm_bf16::bf16_tile(reinterpret_cast<const uint16_t*>(w) + it.r0 * pb.K, pb.K, tile.data());
  } else {
    gemm_bf16::int8_tile(reinterpret_cast<const int8_t*>(w) + it.r0 * pb.K, pb.K, tile.data());
    const Scales sc = pb.scales.of_slot(it.slot);
    for (int n = 0; n < 64; ++n) rs[n] = sc.at(it.r0 + n);
  }
  thread_local std::vector<const uint16_t*> xs;
  thread_local std::vector<float*> ys;
  xs.resize(it.np), ys.resize(it.np);
  for (int p = 0; p < it.np; ++p) xs[p] = pb.XB + in_row[p] * pb.K, ys[p] = pb.Y + out_row[p] * pb.N + it.r0;
  gemm_bf16::tile_times_inputs(tile.data(), pb.K, it.np, xs.data(), pb.kind == Kind::int8 ? rs : nullptr, ys.data());
  return true;
}
#endif

#if ZOO_LANES == 8 && defined(ZOO_DOT8)
// AVX2 strips for many inputs on bf16 or int8 rows: 16 rows widened to fp32 and laid out [K][16] (strip[k * 16 + i]
// = row i's weight k), then each input multiplied there 6 at a time: a broadcast input times the strip's two
// vectors into 12 accumulators (with the 2 weight vectors and the input, 15 of AVX2's 16 registers), no horizontal
// sums, where the rows kernels load every input once per weight vector and sum each row's lanes at its end.
namespace strip8 {
constexpr int TOKENS = 6;

// 8 vectors of 8 floats transposed: r[i][j] -> r[j][i]
static inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
  }
}

// rows [16, K] (row stride K, K a multiple of 8) as the strip: 8 rows x 8 inputs at a time, widened and transposed
template <class W>
static void make_strip(const W* rows, int64_t K, float* strip) {
  for (int64_t k = 0; k < K; k += 8)
    for (int h = 0; h < 2; ++h) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = (__m256)widen(rows + (8 * h + i) * K + k);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(strip + (k + j) * 16 + 8 * h, r[j]);
    }
}

// NT inputs times the strip: ys[t][0..15] = the strip's rows . xs[t] (times the rows' scales rs, if any)
template <int NT>
static void strip_times_rows(const float* strip, int64_t K, const float* const* xs, const float* rs, float* const* ys) {
  __m256 acc[2][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(strip + k * 16), w1 = _mm256_loadu_ps(strip + k * 16 + 8);
    for (int t = 0; t < NT; ++t) {
      const __m256 x = _mm256_broadcast_ss(xs[t] + k);
      acc[0][t] = _mm256_fmadd_ps(w0, x, acc[0][t]);
      acc[1][t] = _mm256_fmadd_ps(w1, x, acc[1][t]);
    }
  }
  const __m256 s0 = rs ? _mm256_loadu_ps(rs) : _mm256_set1_ps(1.f), s1 = rs ? _mm256_loadu_ps(rs + 8) : s0;
  for (int t = 0; t < NT; ++t) {
    _mm256_storeu_ps(ys[t], _mm256_mul_ps(acc[0][t], s0));
    _mm256_storeu_ps(ys[t] + 8, _mm256_mul_ps(acc[1][t], s1));
  }
}
}  // namespace strip8

// From this many pairs an item goes through strips: the 304M model's bf16 gate_up experts [8 x 5632, 1024], 2 threads,
// AMD EPYC Zen 3, strips against the rows kernel: 0.61x at 2 pairs per expert, 0.67x at 4, 0.97x at 8, 1.55x at
// 16, 1.91x at 32 (a strip costs about what 5 pairs do on the rows kernel; then each pair costs a fifth)
constexpr int STRIP_PAIRS = 8;

// An item of several pairs on bf16 or int8 rows (16-row multiples, K a multiple of 8) through strips. Whether it did.
static bool run_on_strips(const Problem& pb, const Item& it, const int64_t* in_row, const int64_t* out_row) {
  if (pb.XQ || it.np < STRIP_PAIRS || (it.r1 - it.r0) % 16 != 0 || pb.K % 8 != 0 ||
      (pb.kind != Kind::bf16 && pb.kind != Kind::int8))
    return false;
  thread_local std::vector<float> strip;
  strip.resize(pb.K * 16);
  const char* w = static_cast<const char*>(pb.w) + it.slot * pb.expert_bytes;
  const Scales sc = pb.scales.of_slot(it.slot);
  const float* xs[strip8::TOKENS];
  float* ys[strip8::TOKENS];
  float rs[16];
  for (int64_t r = it.r0; r < it.r1; r += 16) {
    if (pb.kind == Kind::bf16) {
      strip8::make_strip(reinterpret_cast<const uint16_t*>(w) + r * pb.K, pb.K, strip.data());
    } else {
      strip8::make_strip(reinterpret_cast<const int8_t*>(w) + r * pb.K, pb.K, strip.data());
      for (int i = 0; i < 16; ++i) rs[i] = sc.at(r + i);
    }
    for (int p0 = 0; p0 < it.np; p0 += strip8::TOKENS) {
      const int n = std::min(strip8::TOKENS, it.np - p0);
      for (int t = 0; t < n; ++t) xs[t] = pb.X + in_row[p0 + t] * pb.K, ys[t] = pb.Y + out_row[p0 + t] * pb.N + r;
      const float* scales = pb.kind == Kind::int8 ? rs : nullptr;
      switch (n) {
        case 1: strip8::strip_times_rows<1>(strip.data(), pb.K, xs, scales, ys); break;
        case 2: strip8::strip_times_rows<2>(strip.data(), pb.K, xs, scales, ys); break;
        case 3: strip8::strip_times_rows<3>(strip.data(), pb.K, xs, scales, ys); break;
        case 4: strip8::strip_times_rows<4>(strip.data(), pb.K, xs, scales, ys); break;
        case 5: strip8::strip_times_rows<5>(strip.data(), pb.K, xs, scales, ys); break;
        default: strip8::strip_times_rows<6>(strip.data(), pb.K, xs, scales, ys); break;
      }
    }
  }
  return true;
}
#endif

// One work item: its pairs through the tile where it serves, else 8 at a time through the rows kernels (the
// block's rows come from memory for the first 8, from the cache for the rest)
static void run_item(const Problem& pb, const Item& it) {
  const int64_t *in_row = pb.in_rows + it.first, *out_row = pb.out_rows + it.first;
#ifdef ZOO_BF16_DOT
  if (run_on_tile(pb, it, in_row, out_row)) return;
#endif
#if ZOO_LANES == 8 && defined(ZOO_DOT8)
  if (run_on_strips(pb, it, in_row, out_row)) return;
#endif
  for (int c = 0; c < it.np; c += 8) run_chunk(pb, it, std::min(8, it.np - c), in_row + c, out_row + c);
}

// Take item i from the front (its own thread) or the back (a thread done with its own) of a run [lo, hi) kept as
// hi << 32 | lo, in one compare-and-swap: false once the run is empty. Items number far below 2^32.
static inline bool take_item(std::atomic<uint64_t>& run, bool front, int64_t& i) {
  uint64_t v = run.load();
  for (;;) {
    const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
    if (lo >= hi) return false;
    if (run.compare_exchange_weak(v, front ? (hi << 32) | (lo + 1) : ((hi - 1) << 32) | lo)) {
      i = int64_t(front ? lo : hi - 1);
      return true;
    }
  }
}

static void run_items(const Problem& pb, const std::vector<Item>& items) {
  // Each thread one contiguous run of items (its experts' rows read in order, as the hardware prefetchers follow),
  // the runs of about equal work: rows x (pairs + 1), a read of the rows and a dot product per pair. A split by item
  // count gave an expert that 12 pairs chose as many items as one that 2 did. 304M model, 2 threads, interleaved,
  // the same greedy tokens: prefill at 16 / 32 / 64 tokens int4 1.04-1.05 / 1.07-1.13 / 1.05-1.10x, int8 1.05 / 1.06 /
  // 1.08x, bf16 0.98-1.00 / 1.04-1.09 / 0.99-1.01x; decode (one pair an item: the same split) 0.98-1.03x. Items taken
  // one at a time from a shared counter instead: prefill 0.96-1.07x, decode 0.72x (int4; int8 0.90x).
  // A thread done with its run then takes items from the back of the others' (the work is only estimated, and
  // memory serves the two threads unevenly): against the runs alone, three runs, prefill int4 1.00-1.10x, int8
  // 1.02-1.14x, bf16 1.03-1.06x, decode 0.99-1.07x.
  const int64_t n = (int64_t)items.size(), threads = std::min<int64_t>(at::get_num_threads(), n);
  auto work = [](const Item& it) { return double(it.r1 - it.r0) * (it.np + 1); };
  double total = 0;
  for (const Item& it : items) total += work(it);
  std::vector<int64_t> start(threads + 1, n);  // thread t's run: items [start[t], start[t + 1])
  start[0] = 0;
  double done = 0;
  for (int64_t i = 0, t = 1; i < n && t < threads; ++i) {
    done += work(items[i]);
    while (t < threads && done >= total * t / threads) start[t++] = i + 1;
  }
  std::vector<std::atomic<uint64_t>> runs(threads);
  for (int64_t t = 0; t < threads; ++t) runs[t] = (uint64_t(start[t + 1]) << 32) | uint64_t(start[t]);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    int64_t i;
    for (int64_t t = t0; t < t1; ++t)
      while (take_item(runs[t], true, i)) run_item(pb, items[i]);
    for (int64_t u = 0; u < threads; ++u)
      while (take_item(runs[u], false, i)) run_item(pb, items[i]);
  });
}
