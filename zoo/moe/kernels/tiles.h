// Tiles of bf16 pairs for many input rows on one block of 64 output rows (AVX512-BF16): the block, stored as bf16
// rows, int8 rows or torch's int4 pack, becomes a K/2 x 64 tile of bf16 pairs that stays in the cache (128 KB at
// K = 1024), tile[kp * 64 + n] holding row n's weights at k = 2 kp and 2 kp + 1, and each input row is multiplied
// there with vdpbf16ps (a broadcast pair of inputs times 16 rows' pairs, summed in fp32 as a bf16 matmul sums them),
// 6 inputs at a time in 4 x 6 accumulators: no horizontal sums, and a weight load serves 6 inputs. Used by
// zoo::lowbit_gemm (lowbit_gemm.h: prefill on one int8 / int4 matrix) and by zoo::moe_gemv's items of several
// inputs on bf16 and int8 experts (moe_gemv_body.h). Included by moe_gemv.cpp inside namespace zoo_kernels.
#ifdef ZOO_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
namespace gemm_bf16 {

constexpr int TOKENS = 6;  // input rows per step: 4 x 6 accumulators + 4 weight vectors + 1 input fit 32 registers

// One 64-row block of the pack (for each k, 32 bytes: byte i holds row i in its low nibble, row 32 + i in its high
// one) dequantised, w = (q - 8) s + z rounded to bf16 as dequantize_int4 rounds it, into tile[kp * 64 + n]: row n's
// weights at k = 2 kp (low half) and 2 kp + 1 (high half), the pair vdpbf16ps multiplies with a broadcast input pair.
static void dequant_tile(const uint8_t* blk, const Scales& sc, int64_t K, int64_t g, int64_t n0, uint32_t* tile) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // cvtne2ps_pbh puts its second operand's 16 values first: this index interleaves them with the first's
  alignas(64) int16_t order[32];
  for (int i = 0; i < 16; ++i) order[2 * i] = int16_t(i), order[2 * i + 1] = int16_t(16 + i);
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t gi = 0; gi < K / g; ++gi) {
    __m512 s[4], zm[4];  // rows n0 + 16 c + i: c = 0, 1 the low nibbles of bytes 0..15, 16..31; c = 2, 3 the high
    for (int c = 0; c < 4; ++c) {
      alignas(64) float sv[16], zv[16];
      for (int i = 0; i < 16; ++i) {
        sv[i] = sc.scale(gi, n0 + 16 * c + i);
        zv[i] = sc.zero(gi, n0 + 16 * c + i) - 8 * sv[i];
      }
      s[c] = _mm512_load_ps(sv);
      zm[c] = _mm512_load_ps(zv);
    }
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 2) {
      __m512 w[2][4];  // [k, k + 1][c]
      for (int j = 0; j < 2; ++j) {
        const uint8_t* p = blk + (k + j) * 32;
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)));
        const __m512i codes[4] = {a, b, _mm512_srli_epi32(a, 4), _mm512_srli_epi32(b, 4)};
        for (int c = 0; c < 4; ++c) w[j][c] = _mm512_fmadd_ps(_mm512_permutexvar_ps(codes[c], table), s[c], zm[c]);
      }
      for (int c = 0; c < 4; ++c) {
        const __m512i pairs = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w[1][c], w[0][c]));
        _mm512_storeu_si512(tile + (k / 2) * 64 + 16 * c, pairs);
      }
    }
  }
}

// 16 vectors of 16 32-bit words transposed: r[i][j] -> r[j][i]
static inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // a[2i] lane L: columns 4L, 4L+1 of rows 2i, 2i+1; a[2i+1]: columns 4L+2, 4L+3
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + j] lane L: column 4L + j of rows 4i..4i+3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j: lane L of b[j], b[4 + j], b[8 + j], b[12 + j]
    const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

// One 64-row block of int8 rows [64, K] as the same tile of bf16 pairs (the codes, exact in bf16; the row scales
// are applied to the sums): 32 inputs of 16 rows at a time, widened, then transposed so that each row's pair of
// inputs becomes one lane
static void int8_tile(const int8_t* blk, int64_t K, uint32_t* tile) {
  for (int c = 0; c < 4; ++c)
    for (int64_t k = 0; k < K; k += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(blk + (16 * c + i) * K + k)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
        r[i] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // 16 words: inputs (k + 2j, k + 2j + 1) of row 16c + i
      }
      transpose16(r);  // r[j]: the pair j of rows 16c..16c+15
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + (k / 2 + j) * 64 + 16 * c, r[j]);
    }
}

// One 64-row block of 2- or 3-bit codes packed densely along each row (zoo.moe.packing) dequantised into the tile:
// per group, each row's 2^BITS weights w = q s + (z - 8 s) rounded to bf16 as dequant_tile rounds them, a table of
// 32 words (the 2^BITS repeated); then per row 32 codes (4 BITS bytes) at a time, their bytes broadcast to the
// 128-bit lanes, vpshufb putting the two bytes around code i in word i, a per-word shift bringing it down and
// vpermw looking it up in the row's table (it reads the low 5 bits): the row's 32 weights in order, so pairs
// (k + 2j, k + 2j + 1) in 32-bit words, transposed as int8_tile's. Loads are masked to the 32 codes' own bytes (a
// row may end the allocation).
template <int BITS>
static void packed_tile(const uint8_t* blk, const Scales& sc, int64_t K, int64_t g, int64_t n0, uint32_t* tile) {
  const int64_t row_bytes = K * BITS / 8;
  alignas(64) uint8_t pk[64];
  alignas(64) uint16_t sh[32];
  for (int l = 0; l < 4; ++l)  // 128-bit lane l: codes 8 l..8 l + 7, from byte BITS l on
    for (int j = 0; j < 8; ++j) {
      pk[16 * l + 2 * j] = uint8_t(BITS * l + BITS * j / 8);
      pk[16 * l + 2 * j + 1] = uint8_t(BITS * l + BITS * j / 8 + 1);
      sh[8 * l + j] = uint16_t(BITS * j % 8);
    }
  const __m512i pick = _mm512_load_si512(pk), shift = _mm512_load_si512(sh);
  const __m512 codes = _mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                       _mm512_set1_epi32((1 << BITS) - 1)));  // lane i: code i % 2^BITS
  const __mmask16 chunk = __mmask16((1u << (4 * BITS)) - 1);
  __m512i tables[64];  // the block's rows' weights in the current group
  for (int64_t k = 0; k < K; k += 32) {
    if (k % g == 0)
      for (int n = 0; n < 64; ++n) {
        const float sv = sc.scale(k / g, n0 + n);
        const __m512 w = _mm512_fmadd_ps(codes, _mm512_set1_ps(sv), _mm512_set1_ps(sc.zero(k / g, n0 + n) - 8 * sv));
        tables[n] = (__m512i)_mm512_cvtne2ps_pbh(w, w);
      }
    for (int c = 0; c < 4; ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int n = 16 * c + i;
        const __m512i v = _mm512_broadcast_i32x4(_mm_maskz_loadu_epi8(chunk, blk + n * row_bytes + k * BITS / 8));
        r[i] = _mm512_permutexvar_epi16(_mm512_srlv_epi16(_mm512_shuffle_epi8(v, pick), shift), tables[n]);
      }
      transpose16(r);  // r[j]: the pair j of rows 16c..16c+15
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + (k / 2 + j) * 64 + 16 * c, r[j]);
    }
  }
}

// One 64-row block of bf16 rows [64, K] as the tile: each row's pair (k, k + 1) is already one 32-bit word, so the
// tile is the block's words transposed, 16 rows x 16 words at a time
static void bf16_tile(const uint16_t* blk, int64_t K, uint32_t* tile) {
  for (int c = 0; c < 4; ++c)
    for (int64_t k = 0; k < K; k += 32) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(blk + (16 * c + i) * K + k);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(tile + (k / 2 + j) * 64 + 16 * c, r[j]);
    }
}

// NT input rows times the tile: for each t, the block's 64 outputs ys[t][0..63], accumulated over all K in fp32 and
// stored as floats or rounded to bf16; rs: the rows' scales (int8) or null
template <int NT, class OUT>
static void tile_times_rows(const uint32_t* tile, int64_t K, const uint16_t* const* xs, const float* rs,
                            OUT* const* ys) {
  __m512 acc[4][NT];
  for (int c = 0; c < 4; ++c)
    for (int t = 0; t < NT; ++t) acc[c][t] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh w[4];
    for (int c = 0; c < 4; ++c) w[c] = (__m512bh)_mm512_loadu_si512(tile + kp * 64 + 16 * c);
    for (int t = 0; t < NT; ++t) {
      int32_t pair;
      std::memcpy(&pair, xs[t] + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) acc[c][t] = _mm512_dpbf16_ps(acc[c][t], w[c], xb);
    }
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 scale = rs ? _mm512_loadu_ps(rs + 16 * c) : _mm512_set1_ps(1.f);
    for (int t = 0; t < NT; ++t) {
      if constexpr (std::is_same_v<OUT, float>)
        _mm512_storeu_ps(ys[t] + 16 * c, acc[c][t] * scale);
      else
        _mm256_storeu_si256((__m256i*)(ys[t] + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[c][t] * scale));
    }
  }
}

// n inputs (any number) times the tile, TOKENS at a time: xs[i] an input row, ys[i] where its 64 outputs go
template <class OUT>
static void tile_times_inputs(const uint32_t* tile, int64_t K, int64_t n, const uint16_t* const* xs, const float* rs,
                              OUT* const* ys) {
  for (int64_t i = 0; i < n; i += TOKENS) {
    switch (std::min<int64_t>(TOKENS, n - i)) {
      case 1: tile_times_rows<1>(tile, K, xs + i, rs, ys + i); break;
      case 2: tile_times_rows<2>(tile, K, xs + i, rs, ys + i); break;
      case 3: tile_times_rows<3>(tile, K, xs + i, rs, ys + i); break;
      case 4: tile_times_rows<4>(tile, K, xs + i, rs, ys + i); break;
      case 5: tile_times_rows<5>(tile, K, xs + i, rs, ys + i); break;
      default: tile_times_rows<6>(tile, K, xs + i, rs, ys + i); break;
    }
  }
}

}  // namespace gemm_bf16
#pragma GCC pop_options
#endif  // ZOO_X86
