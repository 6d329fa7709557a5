// Paged attention for short query groups on the CPU, reading K/V in place through the block table.
//
// A *group* is a run of query rows of one sequence at consecutive positions (a decode is a group
// of one; a short prefill chunk after a prefix is a group of a few). Work items are (group, KV
// head); each reads the keys and values of its KV head once for all the group's query rows and
// all the query heads folded under that KV head (GQA), straight from the cache pages named by the
// block-table row: no gather into a temporary, no per-key slot list from the host.
//
// Each query row reads positions [window_start(pos), pos] (window < 0: from 0); a key it may not
// see gets no weight. Keys are read only inside the group's own range [window_start(first row),
// last row's position], so unwritten slots after the query and pages released below the window
// are never touched.
//
// Per work item, blocks of kBlock keys: their scores (float32), an online-softmax update of the
// running maximum and sum, then the weighted sum of their values. Scratch per thread: rows x
// kBlock scores and rows x D accumulators (rows = the group's queries x query heads per KV head),
// independent of the context length. The block's key/value row addresses are looked up through
// the pages once; scores go eight keys at a time and the value sum keeps its accumulator row in
// registers (Zen 3, 32 decodes x 120 keys, 9/3 heads, D 64, cache-resident: 345 -> 212 us a layer;
// in the engine the step reads its KV from memory and the kernel is then bandwidth-bound). Each
// value row is widened once for all the query heads under its KV head, and bf16 keys are scored
// by vdpbf16ps where the CPU has AVX512-BF16 (Intel AMX VM, bf16, 32 decodes sharing a
// 1,020-token prefix, cache-resident: 1,104 -> 786 us a layer; 114 keys each 110 -> 95 us).
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <immintrin.h>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 256;  // keys per online-softmax block: the scratch is rows x kBlock floats

using hybridkv_cpu::exp_nonpositive;  // cpu_math.h, put in front of this file by the loader
using hybridkv_cpu::DeferredRead;  // cache reads with e4m3fn's 2^8 applied once, below
using hybridkv_cpu::to_float;

template <typename scalar_t>
inline float dot(const float* __restrict__ a, const scalar_t* __restrict__ b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * DeferredRead<scalar_t>::scalar(b[d]);
  return s;
}

template <typename scalar_t>
inline void axpy(float* __restrict__ acc, float p, const scalar_t* __restrict__ v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * DeferredRead<scalar_t>::scalar(v[d]);
}

// ---- vectorized block loops (head sizes that are a multiple of the vector width) ----------
using hybridkv_cpu::hsum;
using hybridkv_cpu::hsum_each;
using hybridkv_cpu::kLanes;
using hybridkv_cpu::load_vec;
using hybridkv_cpu::vfloat;

// scores[t] = q . key[t] for t in [lo, hi): kLanes keys at a time, one accumulator chain per key
// (one chain per dot would be D / kLanes dependent FMAs), their kLanes sums taken together by
// hsum_each's shuffle tree and stored as one vector. Summing each key's lanes one by one instead
// made a decode step of 32 sequences compute-bound on the horizontal sums: 0.69 ms (float32) and
// 0.81 ms (bfloat16) a layer for 190 keys each on the Intel VM.
template <int NC, typename scalar_t>
void block_scores(const float* q, const scalar_t* const* keys, float* scores, int64_t lo, int64_t hi) {
  vfloat qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = load_vec(q + c * kLanes);
  int64_t t = lo;
  for (; t + kLanes <= hi; t += kLanes) {
    vfloat acc[kLanes];
    for (int i = 0; i < kLanes; ++i) acc[i] = qv[0] * DeferredRead<scalar_t>::load(keys[t + i]);
    for (int c = 1; c < NC; ++c)
      for (int i = 0; i < kLanes; ++i) acc[i] += qv[c] * DeferredRead<scalar_t>::load(keys[t + i] + c * kLanes);
    const vfloat sums = hsum_each(acc);
    std::memcpy(scores + t, &sums, sizeof(sums));
  }
  for (; t < hi; ++t) {
    vfloat acc = qv[0] * DeferredRead<scalar_t>::load(keys[t]);
    for (int c = 1; c < NC; ++c) acc += qv[c] * DeferredRead<scalar_t>::load(keys[t] + c * kLanes);
    scores[t] = hsum(acc);
  }
}

// R accumulator rows += sum_t p[r][t] * value[t] over t in [0, bl), the rows held in registers:
// each value row is loaded (and widened from bf16) once for all R rows, the query heads under one
// KV head, instead of once per row. A key no row gives weight (masked, or underflowed) is skipped.
// Rows the next block reads, prefetched into L2 a key at a time while this block's values are summed.
template <typename scalar_t>
struct NextRows {
  const scalar_t* const* keys = nullptr;
  const scalar_t* const* values = nullptr;
  int64_t n = 0;          // keys in the next block (0: none)
  int64_t row_bytes = 0;
  void fetch(int64_t t) const {
    for (int64_t o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(keys[t]) + o, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(values[t]) + o, 0, 2);
    }
  }
  void fetch_from(int64_t t) const {
    for (; t < n; ++t) fetch(t);
  }
};

template <int NC, int R, typename scalar_t>
void block_values(float* acc, int64_t D, const float* p, int64_t ldp, const scalar_t* const* values, int64_t bl,
                  const NextRows<scalar_t>& next) {
  vfloat a[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = load_vec(acc + r * D + c * kLanes);
  for (int64_t t = 0; t < bl; ++t) {
    if (t < next.n) next.fetch(t);
    bool any = false;
    for (int r = 0; r < R; ++r) any |= p[r * ldp + t] > 0.f;
    if (!any) continue;
    vfloat v[NC];
    for (int c = 0; c < NC; ++c) v[c] = DeferredRead<scalar_t>::load(values[t] + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat pv = hybridkv_cpu::splat(p[r * ldp + t]);
      for (int c = 0; c < NC; ++c) a[r][c] += pv * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) std::memcpy(acc + r * D + c * kLanes, &a[r][c], sizeof(vfloat));
  next.fetch_from(bl);
}

// Accumulator registers the value loop may hold (of 32 vector registers with AVX-512, 16 with
// AVX2; the value row and the weight take the rest).
constexpr int kValueAccumulators = kLanes == 16 ? 16 : 8;

template <int NC, typename scalar_t>
void values_rows(float* acc, int64_t D, const float* p, int64_t ldp, const scalar_t* const* values, int64_t bl,
                 int64_t nr, const NextRows<scalar_t>& next) {
  const NextRows<scalar_t> none;  // the first pass over the keys prefetches, later ones need not
  constexpr int kR = kValueAccumulators / NC > 4 ? 4 : (kValueAccumulators / NC < 1 ? 1 : kValueAccumulators / NC);
  int64_t r = 0;
  for (; r + kR <= nr; r += kR) block_values<NC, kR>(acc + r * D, D, p + r * ldp, ldp, values, bl, r == 0 ? next : none);
  // The rest (fewer than kR rows; a decode's 3 query heads under a KV head when kR is 4) in one pass.
  switch (nr - r) {
    case 0: return;
    case 1: return block_values<NC, 1>(acc + r * D, D, p + r * ldp, ldp, values, bl, r == 0 ? next : none);
    case 2: if constexpr (kR > 2) return block_values<NC, 2>(acc + r * D, D, p + r * ldp, ldp, values, bl, r == 0 ? next : none);
            break;
    case 3: if constexpr (kR > 3) return block_values<NC, 3>(acc + r * D, D, p + r * ldp, ldp, values, bl, r == 0 ? next : none);
            break;
  }
  for (; r < nr; ++r) block_values<NC, 1>(acc + r * D, D, p + r * ldp, ldp, values, bl, r == 0 ? next : none);
}

// bf16 keys on a CPU with AVX512-BF16: q . k by vdpbf16ps on both rows as stored (bf16 pairs,
// float32 sums), no widening; q is the query row in bf16 as the model produced it, and the sums
// are scaled afterwards. Otherwise as block_scores. FP8 keys under a bf16 query take the same
// path: each 32-byte run of a key row becomes 32 bf16 lanes through Fp8Bf16Table (every FP8
// value is a bf16 value, so the products are those of the key as stored).
#if defined(__AVX512F__)
struct Bf16Rows {  // a bf16 cache row's 32-lane chunk c, as stored
  __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) static __m512bh chunk(
      const c10::BFloat16* row, int c, const __m512i*) {
    return (__m512bh)_mm512_loadu_si512(row + 32 * c);
  }
};

// FP8 bytes -> bf16 by table lookup: the bf16 bits of the 128 non-negative codes held in four
// vectors, two vpermt2w lookups (codes 0-63 and 64-127, 6 index bits each) and a blend on the
// code's bit 6, then the sign (bit 7) moved to bit 15. Exact for every code, subnormals included
// (they are normal bf16 numbers; vdpbf16ps would read bf16 subnormals as zero, which rules out
// rebiasing the bits in place). Measured on a 2-core AMD EPYC Zen 4, a bf16 decode of 32
// sequences (9 / 3 heads, D 64): fewer instructions a key than widening to float32 for FMAs.
template <typename fp8_t>
struct Fp8Bf16Table {
  __m512i tab[4];
  __attribute__((target("avx512bw,avx512f"))) Fp8Bf16Table() {
    alignas(64) uint16_t bits[128];
    for (int code = 0; code < 128; ++code) {
      const c10::BFloat16 b(static_cast<float>(fp8_t(static_cast<uint8_t>(code), fp8_t::from_bits())));
      bits[code] = b.x;
    }
    for (int i = 0; i < 4; ++i) tab[i] = _mm512_load_si512(bits + 32 * i);
  }
  __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) static __m512bh chunk(
      const fp8_t* row, int c, const __m512i* tab) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    const __m512i lo = _mm512_permutex2var_epi16(tab[0], w, tab[1]);
    const __m512i hi = _mm512_permutex2var_epi16(tab[2], w, tab[3]);
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    // mag | (w << 8 & 0x8000): the code's sign bit becomes bf16's.
    return (__m512bh)_mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(w, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
  }
};

template <int NB, typename Rows, typename cache_t>  // NB: 32-element chunks per row (D / 32)
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) void block_scores_dpbf16(
    const c10::BFloat16* q, float scale, const cache_t* const* keys, float* scores, int64_t lo, int64_t hi,
    const __m512i* tab) {
  __m512bh qv[NB];
  for (int c = 0; c < NB; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  const vfloat sc = hybridkv_cpu::splat(scale);
  int64_t t = lo;
  for (; t + kLanes <= hi; t += kLanes) {
    vfloat acc[kLanes];
    for (int i = 0; i < kLanes; ++i)
      acc[i] = (vfloat)_mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], Rows::chunk(keys[t + i], 0, tab));
    for (int c = 1; c < NB; ++c)
      for (int i = 0; i < kLanes; ++i)
        acc[i] = (vfloat)_mm512_dpbf16_ps((__m512)acc[i], qv[c], Rows::chunk(keys[t + i], c, tab));
    const vfloat sums = hsum_each(acc) * sc;
    std::memcpy(scores + t, &sums, sizeof(sums));
  }
  for (; t < hi; ++t) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], Rows::chunk(keys[t], 0, tab));
    for (int c = 1; c < NB; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], Rows::chunk(keys[t], c, tab));
    scores[t] = _mm512_reduce_add_ps(acc) * scale;
  }
}

// The dot-product path for D of 2, 4 or 8 chunks; false where it does not apply.
template <typename Rows, typename cache_t>
bool scores_row_dpbf16(const c10::BFloat16* q_raw, float scale, const cache_t* const* keys, float* s, int64_t lo,
                       int64_t hi, int64_t D, const __m512i* tab) {
  switch (D * (D % 32 == 0)) {
    case 64: return block_scores_dpbf16<2, Rows>(q_raw, scale, keys, s, lo, hi, tab), true;
    case 128: return block_scores_dpbf16<4, Rows>(q_raw, scale, keys, s, lo, hi, tab), true;
    case 256: return block_scores_dpbf16<8, Rows>(q_raw, scale, keys, s, lo, hi, tab), true;
  }
  return false;
}
#endif

// The tables an FP8 cache's bf16 dot products read (empty for other caches and CPUs).
template <typename scalar_t, typename cache_t>
struct ScoreTables {
#if defined(__AVX512F__)
  static constexpr bool kFp8Dpbf16 = std::is_same<scalar_t, c10::BFloat16>::value &&
      (std::is_same<cache_t, c10::Float8_e4m3fn>::value || std::is_same<cache_t, c10::Float8_e5m2>::value);
  std::conditional_t<kFp8Dpbf16, Fp8Bf16Table<cache_t>, char> table{};
  const __m512i* tab() const {
    if constexpr (kFp8Dpbf16) return table.tab; else return nullptr;
  }
#else
  const void* tab() const { return nullptr; }
#endif
};

// The two loops for any head size: the vectorized ones where D is 4, 8 or 16 vectors, else plain.
// q_raw: the query row as the model gave it (for the bf16 dot-product path); q: widened and scaled
// (by read_scale too: DeferredRead); scale: the softmax scale alone (the dot-product path reads
// its keys undivided); tab: ScoreTables::tab().
template <typename scalar_t, typename cache_t, typename Tab>
void scores_row(const float* q, const scalar_t* q_raw, float scale, const cache_t* const* keys, float* s, int64_t lo,
                int64_t hi, int64_t D, Tab tab) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<scalar_t, c10::BFloat16>::value && std::is_same<cache_t, c10::BFloat16>::value) {
    if (hybridkv_cpu::cpu_has_avx512_bf16() && scores_row_dpbf16<Bf16Rows>(q_raw, scale, keys, s, lo, hi, D, tab)) return;
  }
  if constexpr (ScoreTables<scalar_t, cache_t>::kFp8Dpbf16) {
    if (hybridkv_cpu::cpu_has_avx512_bf16() &&
        scores_row_dpbf16<Fp8Bf16Table<cache_t>>(q_raw, scale, keys, s, lo, hi, D, tab)) return;
  }
#endif
  switch (D / kLanes * (D % kLanes == 0)) {
    case 4: return block_scores<4>(q, keys, s, lo, hi);
    case 8: return block_scores<8>(q, keys, s, lo, hi);
    case 16: return block_scores<16>(q, keys, s, lo, hi);
  }
  for (int64_t t = lo; t < hi; ++t) s[t] = dot(q, keys[t], D);
}
// acc [nr x D] += P [nr x bl] (row stride ldp) . values.
template <typename scalar_t>
void values_all(float* acc, const float* p, int64_t ldp, const scalar_t* const* values, int64_t bl, int64_t nr,
                int64_t D, const NextRows<scalar_t>& next) {
  switch (D / kLanes * (D % kLanes == 0)) {
    case 4: return values_rows<4>(acc, D, p, ldp, values, bl, nr, next);
    case 8: return values_rows<8>(acc, D, p, ldp, values, bl, nr, next);
    case 16: return values_rows<16>(acc, D, p, ldp, values, bl, nr, next);
  }
  next.fetch_from(0);
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t t = 0; t < bl; ++t)
      if (p[r * ldp + t] > 0.f) axpy(acc + r * D, p[r * ldp + t], values[t], D);
}

template <typename scalar_t, typename cache_t>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_table, const torch::Tensor& group_start, const torch::Tensor& group_row,
         const torch::Tensor& positions, int64_t page_size, int64_t window, double scale) {
  const hybridkv_cpu::PagedGroups<scalar_t, cache_t> c(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                             positions, page_size, window, scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // The keys and values come back divided by read_scale (DeferredRead): the query is multiplied by
  // it and the output too, which gives the undivided reads' bits (power-of-two scalings are exact).
  constexpr float read_scale = DeferredRead<cache_t>::scale;
  const float q_scale = c.fscale * read_scale;
  const ScoreTables<scalar_t, cache_t> tables;  // built once a call (128 conversions) where used

  // Scratch, one slice per thread, allocated through torch (so allocation profilers see it):
  // queries, scores of one key block, accumulators, running max and sum, for the largest group.
  int64_t max_rows = 0;
  for (int64_t g = 0; g < c.G; ++g) max_rows = std::max<int64_t>(max_rows, (c.gs[g + 1] - c.gs[g]) * c.grp);
  const int64_t per_thread = max_rows * (kBlock + 2 * c.D + 2);
  auto scratch = torch::empty({at::get_num_threads(), per_thread}, q.options().dtype(torch::kFloat32));
  float* scratch_base = scratch.data_ptr<float>();
  // Per thread, two buffers: the addresses of one block's key and value rows, looked up through
  // the pages once for all the group's rows; the next block's are looked up (and prefetched)
  // while this one is computed.
  std::vector<const cache_t*> row_ptrs(static_cast<size_t>(at::get_num_threads()) * 4 * kBlock);

  const int64_t row_bytes = c.D * static_cast<int64_t>(sizeof(cache_t));
  // Keys an item reads: [window_start(first row), last row's position].
  auto item_first = [&](int64_t item) { return c.window_start(c.pos[c.gs[item / c.Hkv]]); };
  auto item_last = [&](int64_t item) { return static_cast<int64_t>(c.pos[c.gs[item / c.Hkv + 1] - 1]); };
  // The addresses of keys [b0, b0 + bl) of `item` (a page at a time) into keys/values; their lines
  // are prefetched by NextRows (all at once for a thread's first block, which has no earlier block
  // to hide behind).
  //
  // Why prefetch at all: the pages are scattered, so the hardware's stream prefetcher restarts at
  // every page. Into L2 (locality 2), not L1: a block's rows (256 keys x K and V x 128 bytes in
  // bf16 at D 64) are more than L1 holds, and prefetching them into it evicted what the scores
  // were reading (2-core AMD EPYC Zen 4, bf16, 32 decodes of 150-280 keys, 9/3 heads, D 64, 30
  // layers' caches on shuffled pages, a layer: 450-530 -> 340-355 us). Why a block ahead and a key
  // at a time: issued all at once before the block's arithmetic, the prefetches filled the core's
  // miss queue and the loads waited behind them, so the block's memory time and its arithmetic
  // ran one after the other. Spread over the previous block's value loop they overlap (same
  // machine and caches, a layer, before -> after: bf16 15 decodes of ~550 keys 379-401 -> 325-348
  // us, 32 of 150-280 397-416 -> 328-386, 8 of ~2,000 755-769 -> 548-569; float32 667-780 ->
  // 580-665, 604-662 -> 530-542, 1,298-1,405 -> 1,049-1,116; cache-resident unchanged).
  auto look_up = [&](int64_t item, int64_t b0, int64_t bl, const cache_t** keys, const cache_t** values) {
    const int64_t g = item / c.Hkv, h = item % c.Hkv;
    const int32_t* row_pages = c.bt + c.gr[g] * c.bt_stride;
    for (int64_t t = b0; t < b0 + bl;) {
      const int64_t pi = t / page_size, off = t - pi * page_size;
      TORCH_CHECK(pi < c.bt_width, "position ", t, " is past the block table's ", c.bt_width, " pages");
      const int64_t n = std::min<int64_t>(page_size - off, b0 + bl - t);
      const int64_t slot = static_cast<int64_t>(row_pages[pi]) * page_size + off;
      const cache_t* kr = c.kp + h * c.kh + slot * c.ks;
      const cache_t* vr = c.vp + h * c.vh + slot * c.vs;
      for (int64_t i = 0; i < n; ++i, ++t) {
        keys[t - b0] = kr + i * c.ks;
        values[t - b0] = vr + i * c.vs;
      }
    }
  };
  // `item`'s first block into keys/values; returns its number of keys.
  auto look_up_first = [&](int64_t item, const cache_t** keys, const cache_t** values) {
    const int64_t f = item_first(item), n = std::min<int64_t>(kBlock, item_last(item) - f + 1);
    look_up(item, f, n, keys, values);
    return n;
  };
  at::parallel_for(0, c.G * c.Hkv, 1, [&](int64_t begin, int64_t end) {
    float* mine = scratch_base + at::get_thread_num() * per_thread;
    float* qf = mine;
    float* scores = qf + max_rows * c.D;
    float* acc = scores + max_rows * kBlock;
    float* m = acc + max_rows * c.D;
    float* l = m + max_rows;
    const cache_t** buf = row_ptrs.data() + at::get_thread_num() * 4 * kBlock;
    int cur = 0;  // which half of buf holds the block about to be computed
    NextRows<cache_t>{buf, buf + kBlock, look_up_first(begin, buf, buf + kBlock), row_bytes}.fetch_from(0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / c.Hkv, h = item % c.Hkv;
      const int64_t r0 = c.gs[g], r1 = c.gs[g + 1];
      const int64_t nr = (r1 - r0) * c.grp;  // score rows: query rows x query heads of this KV head
      const int64_t first = item_first(item);
      const int64_t last = item_last(item);  // positions grow within a group
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < c.grp; ++j) {
          const scalar_t* src = c.query(r, h * c.grp + j);
          float* dst = qf + ((r - r0) * c.grp + j) * c.D;
          for (int64_t d = 0; d < c.D; ++d) dst[d] = to_float(src[d]) * q_scale;
        }
      // Keys in blocks of kBlock with an online softmax (running max m and sum l per row), so
      // the scratch is rows x kBlock whatever the context length.
      std::fill(m, m + nr, neg_inf);
      std::fill(l, l + nr, 0.f);
      std::fill(acc, acc + nr * c.D, 0.f);
      for (int64_t b0 = first; b0 <= last; b0 += kBlock) {
        const int64_t bl = std::min<int64_t>(kBlock, last - b0 + 1);
        const cache_t** keys = buf + cur * 2 * kBlock;
        const cache_t** values = keys + kBlock;
        // The next block's rows (the rest of this item's keys, or the next item's first block)
        // are looked up now and prefetched a key at a time while this block's values are summed
        // (NextRows), so they arrive during this block's arithmetic.
        cur ^= 1;
        const cache_t** next_keys = buf + cur * 2 * kBlock;
        const cache_t** next_values = next_keys + kBlock;
        NextRows<cache_t> next{next_keys, next_values, 0, row_bytes};
        if (b0 + kBlock <= last) {
          next.n = std::min<int64_t>(kBlock, last - b0 - kBlock + 1);
          look_up(item, b0 + kBlock, next.n, next_keys, next_values);
        } else if (item + 1 < end) {
          next.n = look_up_first(item + 1, next_keys, next_values);
        }
        // Each row's scores over the keys it may see (the others stay -inf).
        std::fill(scores, scores + nr * kBlock, neg_inf);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t p = c.pos[r];
          const int64_t lo = std::max<int64_t>(b0, window > 0 ? p - window + 1 : 0) - b0;
          const int64_t hi = std::min<int64_t>(b0 + bl, p + 1) - b0;
          if (lo >= hi) continue;
          for (int64_t j = 0; j < c.grp; ++j) {
            const int64_t row = (r - r0) * c.grp + j;
            scores_row(qf + row * c.D, c.query(r, h * c.grp + j), c.fscale, keys,
                       scores + row * kBlock, lo, hi, c.D, tables.tab());
          }
        }
        // Online softmax: rescale what the earlier blocks summed when the row's maximum grows.
        for (int64_t row = 0; row < nr; ++row) {
          float* s = scores + row * kBlock;
          float bm = neg_inf;  // a vector max: as a scalar chain it was 11% of the kernel (perf)
#pragma omp simd reduction(max : bm)
          for (int64_t i = 0; i < bl; ++i) bm = s[i] > bm ? s[i] : bm;
          if (bm == neg_inf) continue;  // no key of this block is visible to the row
          const float new_m = std::max(m[row], bm);
          const float alpha = exp_nonpositive(m[row] - new_m);  // 0 for the first block (m = -inf)
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < bl; ++i) {
            const float e = exp_nonpositive(s[i] - new_m);  // a masked key (-inf) weighs 0
            s[i] = e;
            sum += e;
          }
          l[row] = l[row] * alpha + sum;
          m[row] = new_m;
          if (alpha != 1.f) {
            float* a = acc + row * c.D;
            for (int64_t d = 0; d < c.D; ++d) a[d] *= alpha;
          }
        }
        // The weighted sum of the block's values (a key a row may not see has weight 0).
        values_all(acc, scores, kBlock, values, bl, nr, c.D, next);
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < c.grp; ++j) {
          const int64_t row = (r - r0) * c.grp + j;
          const float inv = read_scale / l[row];  // every row sees at least its own key
          scalar_t* dst = c.op + (r * c.H + h * c.grp + j) * c.D;
          const float* a = acc + row * c.D;
          for (int64_t d = 0; d < c.D; ++d) dst[d] = static_cast<scalar_t>(a[d] * inv);
        }
    }
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_table, torch::Tensor group_start, torch::Tensor group_row,
                              torch::Tensor positions, int64_t page_size, int64_t window, double scale) {
  hybridkv_cpu::check_paged_groups(q, k_cache, v_cache, block_table, group_start, group_row, positions);
  auto out = torch::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  if (group_row.size(0) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    // An FP8 cache (float32 / bfloat16 queries: check_paged_groups) is widened as it is loaded.
    if constexpr (std::is_same<scalar_t, float>::value || std::is_same<scalar_t, c10::BFloat16>::value) {
      if (k_cache.scalar_type() == at::kFloat8_e4m3fn)
        return run<scalar_t, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                                 positions, page_size, window, scale);
      if (k_cache.scalar_type() == at::kFloat8_e5m2)
        return run<scalar_t, c10::Float8_e5m2>(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                               positions, page_size, window, scale);
    }
    run<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_table, group_start, group_row, positions, page_size,
                            window, scale);
  });
  return out;
}

// Rows of k, v (float32 / bfloat16) into an FP8 cache at their slots, saturated and rounded as
// kv_cache_dtype.quantize_kv does (cpu_math.h saturate_to_fp8), slots already checked.
template <typename row_t, typename fp8_t>
void write_fp8(torch::Tensor& k_cache, torch::Tensor& v_cache, const int64_t* slot, const torch::Tensor& k,
               const torch::Tensor& v) {
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  auto* kc = static_cast<fp8_t*>(k_cache.data_ptr());
  auto* vc = static_cast<fp8_t*>(v_cache.data_ptr());
  const auto* kp = static_cast<const row_t*>(k.data_ptr());
  const auto* vp = static_cast<const row_t*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      fp8_t* kd = kc + h * k_cache.stride(0) + slot[t] * k_cache.stride(1);
      fp8_t* vd = vc + h * v_cache.stride(0) + slot[t] * v_cache.stride(1);
      const row_t* ks = kp + t * k.stride(0) + h * k.stride(1);
      const row_t* vs = vp + t * v.stride(0) + h * v.stride(1);
      for (int64_t d = 0; d < D; ++d) {
        kd[d] = hybridkv_cpu::saturate_to_fp8<fp8_t>(static_cast<float>(ks[d]));
        vd[d] = hybridkv_cpu::saturate_to_fp8<fp8_t>(static_cast<float>(vs[d]));
      }
    }
}

// A step's new K/V rows into their cache slots: k_cache[h, slots[t], :] = k[t, h, :], and the same
// for v; one memcpy per (row, KV head). It does what two index_copy_ calls do, which go through
// TensorIterator at ~100 us a call for a chunk of ~80 rows (Zen 3) and run twice in every layer of
// every step. Slots are checked against the cache before anything is written.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "caches must be [Hkv, slots, D] and k, v [T, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(k.size(0) == slots.size(0) && v.size(0) == slots.size(0), "one slot per row of k and v");
  TORCH_CHECK(k.size(1) == k_cache.size(0) && v.size(1) == k_cache.size(0) && k.size(2) == k_cache.size(2) &&
                  v.size(2) == k_cache.size(2),
              "k and v must be [T, Hkv, D] of the cache's Hkv and D");
  const auto dtype = k_cache.scalar_type();
  const bool quantize = hybridkv_cpu::is_fp8_cache(dtype) && k.scalar_type() != dtype;
  TORCH_CHECK(v_cache.scalar_type() == dtype && v.scalar_type() == k.scalar_type() &&
                  (k.scalar_type() == dtype ||
                   (quantize && (k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16))),
              "caches and rows must share a dtype (or the caches be FP8 and the rows float32 or bfloat16)");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "head rows must be contiguous");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.dim() == 1 && slots.is_contiguous(),
              "slots must be a contiguous int64 vector");
  const int64_t T = k.size(0), H = k.size(1), S = k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < S, "slot ", slot[t], " is outside the cache's ", S, " slots");
  if (quantize) {
    if (dtype == at::kFloat8_e4m3fn) {
      if (k.scalar_type() == torch::kFloat32) return write_fp8<float, c10::Float8_e4m3fn>(k_cache, v_cache, slot, k, v);
      return write_fp8<c10::BFloat16, c10::Float8_e4m3fn>(k_cache, v_cache, slot, k, v);
    }
    if (k.scalar_type() == torch::kFloat32) return write_fp8<float, c10::Float8_e5m2>(k_cache, v_cache, slot, k, v);
    return write_fp8<c10::BFloat16, c10::Float8_e5m2>(k_cache, v_cache, slot, k, v);
  }
  const int64_t esz = k.element_size(), row = k.size(2) * esz;
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t dst = (h * k_cache.stride(0) + slot[t] * k_cache.stride(1)) * esz;
      const int64_t dstv = (h * v_cache.stride(0) + slot[t] * v_cache.stride(1)) * esz;
      std::memcpy(kc + dst, kp + (t * k.stride(0) + h * k.stride(1)) * esz, row);
      std::memcpy(vc + dstv, vp + (t * v.stride(0) + h * v.stride(1)) * esz, row);
    }
}

// The kernels' addresses by name, for model_executor's decode_layers.cpp, which calls them from
// C++ between the layers of a decode step (no Python in between).
std::unordered_map<std::string, int64_t> kernel_addresses() {
  return {{"paged_attention", reinterpret_cast<int64_t>(&paged_attention)},
          {"write_kv", reinterpret_cast<int64_t>(&write_kv)}};
}
