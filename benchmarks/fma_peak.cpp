// The vector FMA rate of this CPU: what no matmul can beat (roofline.py's fma_peak).
//
// Every thread runs kChains independent chains of FMAs on registers alone: no loads, no stores,
// nothing but the multiply-add units, with enough chains to cover their latency (4-5 cycles on
// two pipes). float32 counts 2 FLOPs per lane per vfmadd; bfloat16 counts vdpbf16ps's 2 products
// and 2 sums per float32 lane (AVX512-BF16 only: AMX tiles, where present, go faster still).
// Measured on a 2-core Zen 4 VM: float32 116 GFLOP/s on one thread, 218-220 on two; the engine's
// float32 linears ran the demo model's prefill at 214-230 by their own timers.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>

#include <chrono>
#include <immintrin.h>

namespace {

constexpr int kChains = 12;

using hybridkv_cpu::kLanes;  // cpu_math.h, put in front of this file by the loader
using hybridkv_cpu::splat;
using hybridkv_cpu::vfloat;

// One FMA instruction a vector, written out: whether a * b + c contracts depends on the flags.
#if defined(__AVX512F__)
inline vfloat fma_vec(vfloat a, vfloat b, vfloat c) {
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
#elif defined(__AVX2__)
inline vfloat fma_vec(vfloat a, vfloat b, vfloat c) {
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#endif

// FLOPs done by one thread in `steps` steps of kChains float32 FMAs; sink keeps the chains live.
double float_chains(int64_t steps, float* sink) {
#if defined(__AVX512F__) || defined(__AVX2__)
  vfloat acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = splat(1.f + i);
  const vfloat b = splat(0.999999f), c = splat(1e-7f);  // a fixed point near 0.1: no denormals
  for (int64_t s = 0; s < steps; ++s)
    for (int i = 0; i < kChains; ++i) acc[i] = fma_vec(acc[i], b, c);
  float total = 0.f;
  for (int i = 0; i < kChains; ++i) total += acc[i][0];
  *sink += total;
  return 2.0 * kLanes * kChains * static_cast<double>(steps);
#else
  (void)steps;
  (void)sink;
  return 0.0;
#endif
}

#if defined(__AVX512F__)
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) double bf16_chains(int64_t steps, float* sink) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.f);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3c00);  // bf16 2^-7: sums stay small
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3c00);
  for (int64_t s = 0; s < steps; ++s)
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  float total = 0.f;
  for (int i = 0; i < kChains; ++i) total += _mm512_cvtss_f32(acc[i]);
  *sink += total;
  return 4.0 * 16 * kChains * static_cast<double>(steps);
}
#endif

}  // namespace

// FLOP/s of every torch thread running FMA chains at once for about `seconds`; 0 when this build
// has no vector FMA of that kind ("float32", or "bfloat16" on AVX512-BF16).
double fma_peak(std::string kind, double seconds) {
  const bool bf16 = kind == "bfloat16";
  TORCH_CHECK(bf16 || kind == "float32", "fma_peak: kind is float32 or bfloat16, got ", kind);
#if defined(__AVX512F__)
  if (bf16 && !__builtin_cpu_supports("avx512bf16")) return 0.0;
#else
  if (bf16) return 0.0;
#endif
  auto run = [&](int64_t steps) {
    const int n = at::get_num_threads();
    std::vector<double> flops(n, 0.0);
    std::vector<float> sinks(n, 0.f);
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
#if defined(__AVX512F__)
        flops[i] = bf16 ? bf16_chains(steps, &sinks[i]) : float_chains(steps, &sinks[i]);
#else
        flops[i] = float_chains(steps, &sinks[i]);
#endif
      }
    });
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double total = 0.0;
    for (double f : flops) total += f;
    return std::make_pair(total, took);
  };
  int64_t steps = 1 << 16;
  auto [flops, took] = run(steps);
  while (took < seconds / 4 && steps < (int64_t(1) << 40)) {  // grow to a measurable run
    steps *= 4;
    std::tie(flops, took) = run(steps);
  }
  return took > 0 ? flops / took : 0.0;
}
