// moe_gemv's kernels without torch (ZOO_KERNELS_STANDALONE), for processors this machine's torch is not built for:
// tests/test_kernels_standalone.py builds this for ARM64 and runs it under an emulator. One problem on stdin, its
// outputs Y [T, k, N] in fp32 on stdout.
//
// stdin: the task (int64: 0 moe_gemv, 1 dequantise), then for moe_gemv 12 int64 (kind, bits, group_size, T, k, K, N,
// S, per_slot, x_f32, scale_bf16, E), the inputs x (fp32 or bf16, [T, K] or [T, k, K]), indices [T, k] and the
// expert -> slot map [E] (int64), the stack [S, N, ...] in its stored form, and for 8 bits or fewer its scales
// (fp32 or bf16); for a dequantisation 5 int64 (bits 4, 3 or 2, group_size, N, K, scale_bf16), one matrix's codes and
// its scales: out the fp32 weight as prefill gets it (4 bits: transposed, [K, N]; 2/3 bits: [N, K]).
#define ZOO_KERNELS_STANDALONE 1
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <thread>

namespace at {  // the torch calls the kernels make: the range split between two threads, as torch's would be
inline int get_num_threads() { return 2; }
// ZOO_STANDALONE_IN_ORDER set: the two halves one after the other, so the first finds the second's items untaken (the
// kernels' items then all go through the path a thread takes when it is done with its own run)
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end - begin <= std::max<int64_t>(grain, 1)) {
    if (begin < end) f(begin, end);
    return;
  }
  const int64_t middle = begin + (end - begin) / 2;
  if (std::getenv("ZOO_STANDALONE_IN_ORDER")) {
    f(begin, middle);
    f(middle, end);
    return;
  }
  std::thread other([&] { f(middle, end); });
  f(begin, middle);
  other.join();
}
}  // namespace at

#include "../zoo/moe/kernels/moe_gemv.cpp"

#include <cstdio>
#include <cstdlib>

static std::vector<char> read_bytes(size_t n) {
  std::vector<char> v(n);
  if (std::fread(v.data(), 1, n, stdin) != n) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
  return v;
}

static int dequantise() {
  using namespace zoo_kernels;
  const std::vector<char> head = read_bytes(5 * sizeof(int64_t));
  int64_t h[5];
  std::memcpy(h, head.data(), sizeof h);
  const auto [bits, g, N, K, scale_bf16] = h;
  const std::vector<char> w = read_bytes(N * K * bits / 8), scales = read_bytes(K / g * N * 2 * (scale_bf16 ? 2 : 4));
  Scales sc;
  sc.ptr = scales.data();
  sc.bf16 = scale_bf16;
  sc.N = N;
  std::vector<float> out(N * K);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(w.data());
  if (bits == 4) {
    dequant_int4_any(codes, sc, N, K, g, out.data());
  } else {
    dequant_packed_any(codes, sc, N, K, g, int(bits), out.data());
  }
  std::fwrite(out.data(), sizeof(float), out.size(), stdout);
  return 0;
}

int main() {
  using namespace zoo_kernels;
  int64_t task;
  std::memcpy(&task, read_bytes(sizeof task).data(), sizeof task);
  if (task == 1) return dequantise();
  const std::vector<char> head = read_bytes(12 * sizeof(int64_t));
  int64_t h[12];
  std::memcpy(h, head.data(), sizeof h);
  const auto [kind_code, bits, g, T, k, K, N, S, per_slot, x_f32, scale_bf16, E] = h;
  const Kind kind = Kind(kind_code);
  const int64_t rows = per_slot ? T * k : T;
  const std::vector<char> x = read_bytes(rows * K * (x_f32 ? 4 : 2));
  const std::vector<char> idx = read_bytes(T * k * sizeof(int64_t)), map = read_bytes(E * sizeof(int64_t));
  const int64_t expert_bytes = kind == Kind::f32 ? N * K * 4 : kind == Kind::bf16 ? N * K * 2 : N * K * bits / 8;
  const std::vector<char> w = read_bytes(S * expert_bytes);
  const int64_t per_slot_scales = bits == 8 ? N : bits < 8 ? K / g * N * 2 : 0;
  const std::vector<char> scales = read_bytes(S * per_slot_scales * (scale_bf16 ? 2 : 4));
  Scales sc;
  sc.ptr = bits <= 8 ? scales.data() : nullptr;
  sc.bf16 = scale_bf16;
  sc.N = N;
  sc.per_slot = per_slot_scales;
  std::vector<int64_t> slot_map(E);
  std::memcpy(slot_map.data(), map.data(), E * sizeof(int64_t));
  const Call call{kind, bits, g, T, k, K, N, bool(per_slot), x.data(), bool(x_f32),
                  reinterpret_cast<const int64_t*>(idx.data()), slot_map, w.data(), expert_bytes, sc};
  std::vector<float> y(T * k * N);
  moe_gemv_rows(call, y.data());
  std::fwrite(y.data(), sizeof(float), y.size(), stdout);
  return 0;
}
