// Vector-friendly float math shared by the CPU kernels. The loader (cpu_kernels/build.py) puts
// this file in front of each kernel's source, so a change here rebuilds every kernel.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace hybridkv_cpu {

// Whether the CPU has AVX512-BF16 (vdpbf16ps), for kernels built for AVX-512 that use it on the
// CPUs that have it (Sapphire Rapids, Zen 4 and later) and keep their float32 loops elsewhere.
inline bool cpu_has_avx512_bf16() {
#if defined(__AVX512F__)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

// One vector register of floats, in GCC's vector extensions: the compiler emits AVX-512 or AVX2
// code from the ISA flags the loader passes (build.py), and plain code elsewhere.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));

// x in every lane. Written x - 0, not 0 + x: 0 + (-0) is +0, so the compiler must emit that add
// (a scalar vaddss before each broadcast in a GEMM loop), while x - 0 is x for every x and
// folds to a bare broadcast.
inline vfloat splat(float x) { return x - vfloat{}; }

inline vfloat load_vec(const float* p) {  // unaligned
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load_vec(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift, exact
#if defined(__AVX512F__)
  // One widening load and a shift. GCC splits __builtin_convertvector's 16-lane widening into two
  // 8-lane halves (six instructions a vector), which made the bf16 decode kernel's value loop
  // issue-bound on it.
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return (vfloat)_mm512_castsi512_ps(u);
#else
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  const vuint u = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}
// FP8 KV cache bytes -> float32, exact (kv_cache_dtype; scale 1.0), through F16C's vcvtph2ps.
// e5m2 is the high byte of an IEEE half: the byte shifted left by 8 is that half. e4m3fn's low 7
// bits shifted left by 7 are a half with the same 3-bit mantissa and an exponent field that means
// the same number against bias 15 instead of 7 (subnormals included): the value times 2^-8. With
// the byte in a 16-bit lane, shifting left by 8 and arithmetically right by 1 puts those bits there
// and the sign in bits 15 and 14; clearing bit 14 leaves the half. fp8_scaled_vec returns that
// half widened (e4m3fn: value x 2^-8, for kernels that fold the 2^8 into their own scaling,
// DeferredRead below); load_vec the value. (e4m3fn's NaN byte, 0x7F/0xFF, reads as +-480: the
// writers saturate to +-448 and store it only for a NaN input.) Without F16C (the loader's "base"
// build) the lanes go through c10's conversion.
#if defined(__AVX512F__) || defined(__F16C__)
template <bool E4M3>
inline vfloat fp8_scaled_vec(const uint8_t* p) {
#if defined(__AVX512F__)
  __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
  if constexpr (E4M3) h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return (vfloat)_mm512_cvtph_ps(h);
#else
  __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
  if constexpr (E4M3) h = _mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return (vfloat)_mm256_cvtph_ps(h);
#endif
}
inline vfloat load_vec(const c10::Float8_e4m3fn* p) {
  return fp8_scaled_vec<true>(reinterpret_cast<const uint8_t*>(p)) * (vfloat{} + 256.f);
}
inline vfloat load_vec(const c10::Float8_e5m2* p) { return fp8_scaled_vec<false>(reinterpret_cast<const uint8_t*>(p)); }
#endif
template <typename scalar_t>
inline vfloat load_vec(const scalar_t* p) {  // other types (fp16; FP8 without F16C): widened lane by lane
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
// float -> bfloat16 bits, round to nearest even, lane-parallel (c10::BFloat16's conversion has a
// NaN branch that keeps GCC from vectorizing a loop of it: ~5 ns an element). NaN stays a quiet NaN.
// v rounded to bfloat16, kept in the high 16 bits of each 32-bit lane (the low bits zero): the
// float value of the rounded number, in whole-width lane operations only.
inline vuint bf16_rounded_lanes(vfloat v) {
  vuint u;
  std::memcpy(&u, &v, sizeof(u));
  const vuint rounded = (u + (vuint{} + 0x7FFFu) + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const vuint nan = (vuint)((u & 0x7FFFFFFFu) > 0x7F800000u);  // all ones in NaN lanes
  return (rounded & ~nan) | (nan & 0x7FC00000u);
}
inline vhalf to_bf16_bits(vfloat v) {
#if defined(__AVX512F__)
  // One narrowing instruction (vpmovdw): GCC splits __builtin_convertvector's 16-lane narrowing
  // into 8-lane halves, as it does the widening (load_vec).
  vuint u = bf16_rounded_lanes(v) >> 16;
  __m512i w;
  std::memcpy(&w, &u, sizeof(w));
  const __m256i h = _mm512_cvtepi32_epi16(w);
  vhalf out;
  std::memcpy(&out, &h, sizeof(out));
  return out;
#else
  return __builtin_convertvector(bf16_rounded_lanes(v) >> 16, vhalf);
#endif
}
inline void store_vec(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_vec(c10::BFloat16* p, vfloat v) {
  const vhalf h = to_bf16_bits(v);
  std::memcpy(p, &h, sizeof(h));
}

// n elements of a type load_vec reads, as float32 at dst (exact): whole vectors, then the tail
// one by one. For FP8 rows the vectors matter: c10's scalar conversion is a dozen instructions an
// element.
template <typename T>
inline void widen(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_vec(dst + i, load_vec(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
// A row of n elements as float32: a float row as it is, any other widened into scratch (n floats).
template <typename T>
inline const float* float_row(const T* src, int64_t n, float* scratch) {
  if constexpr (std::is_same<T, float>::value) {
    return src;
  } else {
    widen(src, n, scratch);
    return scratch;
  }
}
// v rounded to scalar_t's precision and back to float (what a torch op's output dtype does to it).
template <typename scalar_t>
inline vfloat round_vec(vfloat v) {
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value) {
    const vuint u = bf16_rounded_lanes(v);  // no narrowing and widening back
    std::memcpy(&v, &u, sizeof(v));
  }
  return v;
}

// A scalar of any element type the kernels read (float, c10::BFloat16, c10::Half, the FP8 types) as float.
template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}
// x as an FP8 cache stores it (kv_cache_dtype): clamped to the format's finite range, then c10's
// round-to-nearest-even conversion, the bits torch's x.clamp(-max, max).to(fp8) gives.
template <typename fp8_t>
inline fp8_t saturate_to_fp8(float x) {
  constexpr float limit = std::is_same<fp8_t, c10::Float8_e4m3fn>::value ? 448.f : 57344.f;
  return fp8_t(std::min(std::max(x, -limit), limit));  // NaN stays NaN, as torch.clamp leaves it
}

// Cache elements read with a power-of-two factor left for the caller to apply once: `load` and
// `scalar` give the value divided by `scale`. e4m3fn's widening then skips its multiply by 2^8 in
// the inner loops, and a kernel multiplies its query by `scale` (exact scores: every product is
// the same number) and its output by `scale` (exact: the sums are of exactly scaled terms).
// Other types: scale 1, the plain reads.
template <typename T>
struct DeferredRead {
  static constexpr float scale = 1.f;
  static vfloat load(const T* p) { return load_vec(p); }
  static float scalar(T x) { return to_float(x); }
};
#if defined(__AVX512F__) || defined(__F16C__)
template <>
struct DeferredRead<c10::Float8_e4m3fn> {
  static constexpr float scale = 256.f;
  static vfloat load(const c10::Float8_e4m3fn* p) { return fp8_scaled_vec<true>(reinterpret_cast<const uint8_t*>(p)); }
  static float scalar(c10::Float8_e4m3fn x) { return to_float(x) * (1.f / 256.f); }
};
#endif

inline float hsum(vfloat v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// The sums (or maxima, hmax_each) of kLanes vectors at once: lane i of the result is the sum of
// acc[i]'s lanes. A transposing tree of shuffles and adds (log2(kLanes) levels, kLanes - 1 adds of whole vectors)
// instead of kLanes scalar horizontal sums: at level s every pair (acc[i], acc[i + n/2]) becomes
// one vector holding both halves' partial sums side by side, and pairing i with i + n/2 leaves the
// final lanes in natural order. acc is overwritten. (GCC's __builtin_shuffle: the masks are
// constants after inlining, so each shuffle is one permute instruction.)
namespace detail {
template <int S>  // group size before the split; lo picks each group's first half, hi its second
inline vuint split_mask(bool hi) {
  vuint m;
  for (int j = 0; j < kLanes; ++j) {
    const int half = S / 2, og = j / half, within = j % half;
    const int lane = (og / 2) * S + (hi ? half : 0) + within;
    m[j] = (og % 2 ? kLanes : 0) + lane;
  }
  return m;
}
template <int S, typename Op>
inline void combine_level(vfloat* acc, int n, Op op) {
  const vuint lo = split_mask<S>(false), hi = split_mask<S>(true);
  for (int i = 0; i < n / 2; ++i)
    acc[i] = op(__builtin_shuffle(acc[i], acc[i + n / 2], lo), __builtin_shuffle(acc[i], acc[i + n / 2], hi));
}
template <typename Op>
inline vfloat reduce_each(vfloat* acc, Op op) {
  if constexpr (kLanes == 16) {
    combine_level<16>(acc, 16, op);
    combine_level<8>(acc, 8, op);
    combine_level<4>(acc, 4, op);
    combine_level<2>(acc, 2, op);
  } else {
    combine_level<8>(acc, 8, op);
    combine_level<4>(acc, 4, op);
    combine_level<2>(acc, 2, op);
  }
  return acc[0];
}
}  // namespace detail
inline vfloat hsum_each(vfloat* acc) {
  return detail::reduce_each(acc, [](vfloat x, vfloat y) { return x + y; });
}
// The same tree with max: lane i of the result is the largest of acc[i]'s lanes.
inline vfloat hmax_each(vfloat* acc) {
  return detail::reduce_each(acc, [](vfloat x, vfloat y) { return x > y ? x : y; });
}

// exp(x) for x <= 0 (scores minus their row maximum), in plain arithmetic so that the loop over
// a row vectorizes: Cephes' expf (range reduction to [-ln2/2, ln2/2], degree-5 polynomial, 2^n
// from the exponent bits), relative error ~1e-7 like libm's; x = -inf (a masked key) gives 0.
inline float exp_nonpositive(float x) {
  const float lo = -87.3f;
  const bool masked = !(x >= lo);  // also -inf and NaN
  const float xc = masked ? lo : x;
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return masked ? 0.f : p * scale;
}

#if defined(__AVX512F__)
// exp_nonpositive for 16 lanes at once, in 11 vector instructions against the scalar form's ~18
// once vectorized (the float32 prefill kernel's softmax, Intel AMX VM: 5.43 -> 5.14 ms a layer):
// exp(x) = 2^n * 2^f with n = round(x log2 e), |f| <= 1/2; 2^f by a degree-6 polynomial fitted
// for relative error on [-1/2, 1/2] (~1e-7 in float32, as the scalar form's), 2^n by scalef. Below
// 2^-126 (the scalar form's range), -inf (a masked key) and NaN give 0. The bf16 prefill kernel
// keeps its own cheaper 2^x (degree 5, no range mask; prefill_attention_bf16.cpp): this
// one in its place made that kernel 4% slower (Intel AMX VM: 1.78 -> 1.86 ms a layer), for
// precision its bf16 weights then round away.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __mmask16 in_range = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5337577497e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399859890e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6185198054e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503290147e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646248e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718246e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(in_range, p, n);
}

// silu(x) for 16 lanes, operation for operation fused_ops' silu_and_mul: x * (x >= 0 ? 1 : e) / (1 + e)
// with e = exp_nonpositive(-|x|) (Cephes' expf; every product and sum rounded on its own), so the
// bits agree with it. Written with intrinsics because GCC left that scalar loop unvectorized at 16
// iterations (~2 ns an element). FMA contraction is off for this function whatever the module's
// flags: blocked_linear.cpp is built with it on (for its GEMM), and a contracted a * b + c rounds
// once where fused_ops rounds twice.
__attribute__((optimize("fp-contract=off"))) inline __m512 silu16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f), lo = _mm512_set1_ps(-87.3f);
  const __m512 ax = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x));  // -|x|
  const __mmask16 live = _mm512_cmp_ps_mask(ax, lo, _CMP_GE_OQ);          // false for NaN, as !(x >= lo)
  const __m512 xc = _mm512_mask_blend_ps(live, lo, ax);
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                                      _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_add_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, r2), r), one);
  const __m512 scale = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  const __m512 e = _mm512_maskz_mul_ps(live, p, scale);
  const __mmask16 nonneg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  return _mm512_mul_ps(x, _mm512_div_ps(_mm512_mask_blend_ps(nonneg, e, one), _mm512_add_ps(one, e)));
}

// v rounded to bf16 (nearest even) and widened back.
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// silu(gate) * up in bf16 from a gate and an up float32 sum (bias added): what fused_ops'
// silu_and_mul does to a bf16 linear's rounded output -- gate and up rounded to bf16 first, silu of
// the gate rounded to bf16, times up, rounded once more -- so a fused call gives the same bits.
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) inline __m256bh silu_mul_bf16(__m512 gate,
                                                                                              __m512 up) {
  return _mm512_cvtneps_pbh(_mm512_mul_ps(round_bf16(silu16(round_bf16(gate))), round_bf16(up)));
}
#endif

}  // namespace hybridkv_cpu
