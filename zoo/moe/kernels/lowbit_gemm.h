// Prefill on int8 / int4 / 2/3-bit weights without a dequantised copy in memory: zoo::lowbit_gemm, y = x @ W.T for
// many rows of bf16 inputs x [M, K] and one matrix stored as int8 rows with a scale per row, in torch's CPU int4 pack
// or as 2/3-bit codes packed along each row (zoo.moe.packing). The dense
// path (the weight converted to bf16, then a bf16 matmul) writes the whole bf16 weight to memory and reads it back,
// 2x (int8) or 4x (int4) the stored bytes twice; here each block of 64 output rows is turned into a tile that stays
// in the cache (K/2 x 64 pairs of bf16: 128 KB at K = 1024) and every input row is multiplied by it there, with
// vdpbf16ps (the products of bf16 pairs summed in fp32, as a bf16 matmul sums them). The tiles: tiles.h. Included by
// moe_gemv.cpp inside namespace zoo_kernels; the set with AVX512-BF16 only (the op refuses other sets).
#ifdef ZOO_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512bf16")
namespace gemm_bf16 {

// bits 8: w int8 [N, K], sc one scale per row; 4: torch's int4 pack, 2 / 3: codes packed densely along each row;
// sc (scale, zero) per group
static void lowbit_gemm(const uint16_t* x, int64_t M, const void* w, int bits, const Scales& sc, int64_t N, int64_t K,
                        int64_t g, uint16_t* y) {
  at::parallel_for(0, N / 64, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> tile(K / 2 * 64);
    float rs[64];
    for (int64_t b = begin; b < end; ++b) {
      if (bits == 8) {
        int8_tile(static_cast<const int8_t*>(w) + b * 64 * K, K, tile.data());
        for (int n = 0; n < 64; ++n) rs[n] = sc.at(b * 64 + n);
      } else if (bits == 4) {
        dequant_tile(static_cast<const uint8_t*>(w) + b * 64 * K / 2, sc, K, g, b * 64, tile.data());
      } else if (bits == 3) {
        packed_tile<3>(static_cast<const uint8_t*>(w) + b * 64 * K * 3 / 8, sc, K, g, b * 64, tile.data());
      } else {
        packed_tile<2>(static_cast<const uint8_t*>(w) + b * 64 * K / 4, sc, K, g, b * 64, tile.data());
      }
      const uint16_t* xs[TOKENS];
      uint16_t* ys[TOKENS];
      for (int64_t m = 0; m < M; m += TOKENS) {
        const int64_t n = std::min<int64_t>(TOKENS, M - m);
        for (int64_t t = 0; t < n; ++t) xs[t] = x + (m + t) * K, ys[t] = y + (m + t) * N + b * 64;
        tile_times_inputs(tile.data(), K, n, xs, bits == 8 ? rs : nullptr, ys);
      }
    }
  });
}

}  // namespace gemm_bf16
#pragma GCC pop_options
#endif  // ZOO_X86

// zoo::lowbit_gemm: x [M, K] bf16 @ W.T -> [M, N] bf16, W [N, K] stored as int8 rows with scales [N] (bits 8), or
// in torch's int4 pack (bits 4) or 2/3-bit codes packed along each row (bits 2, 3) with (scale, zero) pairs
// [K/g, N, 2]. Only where the set in use has bf16 dot products and N is a multiple of 64 (zoo.moe.in_place asks
// first).
at::Tensor lowbit_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, int64_t bits,
                       int64_t group_size) {
  TORCH_CHECK(g_isa == 3, "lowbit_gemm needs bf16 dot products (the avx512-bf16 set); the set in use is ", g_isa);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 3 || bits == 2, "bits must be 8, 4, 3 or 2, got ", bits);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && weight.size(1) * 8 % bits == 0,
              bits == 8   ? "weight must be a contiguous int8 [N, K]"
              : bits == 4 ? "weight must be a contiguous uint8 [N, K/2] int4 pack"
                          : "weight must be a contiguous uint8 [N, K * bits / 8] of packed codes");
  const int64_t N = weight.size(0), K = weight.size(1) * 8 / bits, M = x.size(0);
  TORCH_CHECK(N % 64 == 0 && K % 32 == 0, "N must be divisible by 64 and K by 32");
  TORCH_CHECK(bits == 8 || (group_size >= 32 && group_size % 32 == 0 && K % group_size == 0),
              "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [M, K]");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == (bits == 8 ? N : K / group_size * N * 2) &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16),
              "scales must be contiguous float32/bfloat16: [N] (8 bits), [K/g, N, 2] (4, 3, 2 bits)");
  const Scales sc = Scales::of(scale, N);
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef ZOO_X86
  gemm_bf16::lowbit_gemm(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, weight.data_ptr(), int(bits), sc, N, K,
                         group_size, reinterpret_cast<uint16_t*>(y.data_ptr()));
#endif
  return y;
}
