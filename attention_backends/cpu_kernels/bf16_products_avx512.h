// prefill_attention_bf16.cpp's two products on AVX512-BF16 vectors, for CPUs with bf16 dot
// products but no AMX (AMD Zen 4 and Zen 5): the loader puts this file in front of that kernel
// for its vector build (bf16_products_amx.h is the tile build's). vdpbf16ps gives each of 16
// float lanes the dot product of a bf16 pair, so a K^T or V vector in the kernel's packed layout
// (pairs along the reduction dimension, side by side) meets a broadcast pair of Q or of the
// weights: half the instructions of the float32-FMA kernel for the same products, and the keys
// are not widened. On a 2-core AMD EPYC (family 25 model 17, Zen 4; 512-bit operations on 256-bit
// units), a 1,024-token causal prompt with the demo model's heads (9 / 3, D 64), a layer:
// 3.6-3.9 ms, against 7.0-7.6 for the float32-FMA kernel on the same bf16 inputs and 12.2 for
// SDPA's bf16 flash attention (which the backend used here before); workload c 0.98 -> 0.67 s.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace hybridkv_bf16 {

constexpr int64_t kKeyBlock = 64;  // keys per packed block: four 16-key sub-blocks
constexpr int kRowBlock = 4;       // rows per register block: 4 x 4 float accumulators

// Whether this CPU can run these products (the build is for AVX512-BF16).
inline bool products_ready() { return __builtin_cpu_supports("avx512bf16"); }

struct ThreadProducts {};  // no per-thread state

inline __m512bh pair_splat(const uint16_t* p) {  // a bf16 pair broadcast to every lane
  uint32_t pair;
  std::memcpy(&pair, p, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// S [16 x 64] (row stride 64 floats) = Q [16 x D] . K^T for one packed key block: K^T holds four
// 16-key sub-blocks of [D / 2 d pairs][16 keys] bf16 pairs, so one vector is a d pair of 16 keys.
inline void score_block(const uint16_t* qbuf, int64_t D, const uint16_t* kblock, float* S) {
  for (int64_t r0 = 0; r0 < 16; r0 += kRowBlock) {
    __m512 acc[kRowBlock][4];
    for (int r = 0; r < kRowBlock; ++r)
      for (int s = 0; s < 4; ++s) acc[r][s] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; ++dp) {
      __m512bh kv[4];
      for (int s = 0; s < 4; ++s) kv[s] = (__m512bh)_mm512_loadu_si512(kblock + s * 16 * D + dp * 32);
      for (int r = 0; r < kRowBlock; ++r) {
        const __m512bh qp = pair_splat(qbuf + (r0 + r) * D + 2 * dp);
        for (int s = 0; s < 4; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], qp, kv[s]);
      }
    }
    for (int r = 0; r < kRowBlock; ++r)
      for (int s = 0; s < 4; ++s) _mm512_store_ps(S + (r0 + r) * kKeyBlock + s * 16, acc[r][s]);
  }
}

// O [16 x D] (row stride D floats) += P [16 x 64] bf16 . V for one packed key block: V holds two
// 32-key halves of [D / 16 chunks][16 key pairs][16 d][2], so one vector is a key pair of 16 d.
inline void accumulate_values(const uint16_t* pbuf, int64_t D, const uint16_t* vblock, float* O) {
  for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {  // D is a multiple of 64: whole groups of 4 chunks
    for (int64_t r0 = 0; r0 < 16; r0 += kRowBlock) {
      __m512 acc[kRowBlock][4];
      for (int r = 0; r < kRowBlock; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_load_ps(O + (r0 + r) * D + (c0 + c) * 16);
      for (int64_t kk = 0; kk < 2; ++kk)
        for (int64_t kp = 0; kp < 16; ++kp) {
          __m512bh vv[4];
          for (int c = 0; c < 4; ++c)
            vv[c] = (__m512bh)_mm512_loadu_si512(vblock + kk * 32 * D + (c0 + c) * 512 + kp * 32);
          for (int r = 0; r < kRowBlock; ++r) {
            const __m512bh pp = pair_splat(pbuf + (r0 + r) * kKeyBlock + kk * 32 + 2 * kp);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pp, vv[c]);
          }
        }
      for (int r = 0; r < kRowBlock; ++r)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(O + (r0 + r) * D + (c0 + c) * 16, acc[r][c]);
    }
  }
}

}  // namespace hybridkv_bf16
