// Prefill attention on the CPU: long query groups, K/V read in place through the block table,
// blocked like a GEMM.
//
// Same call as paged_attention.cpp (groups of query rows at consecutive positions, one block-table
// row each, causal and optionally windowed), for the other regime: a prompt chunk of tens to
// thousands of queries. The decode kernel takes one query row at a time against kLanes keys and
// sums each key's lanes; here a *work item* is (group, KV head, tile of query positions) and every
// key block is a small matrix product against all the tile's rows at once:
//
//   rows   = the tile's query positions x the query heads under the KV head (GQA folded in),
//            at most kMaxRows, padded to whole vectors;
//   scores = S^T [keys x rows]: the rows lie along the vector lanes, so the query tile is
//            transposed once per item (Q^T [D x rows]) and each key element is one broadcast
//            feeding a register block of kScoreKeys keys x kScoreVecs row vectors;
//   softmax: online, per row (= per lane): the block maximum, the rescale and the sums are
//            vertical vector operations over the keys, no horizontal sums anywhere; the score
//            loop takes the block maximum from its accumulators unless a mask follows it;
//   values:  O [rows x D] += P [rows x keys] . V [keys x D], a register block of kValueRows rows x
//            kValueVecs vectors of D, each value row read from its page once per row block.
//
// Positions grow within a group, so a key block needs a mask only where it crosses the tile's
// causal diagonal or a window edge; blocks no row may see are skipped. The running maximum starts
// at -1e30, not -inf, so a row that has seen no key yet (a window that has not reached it) takes a
// block of -inf scores as weights exp(-inf) = 0, not NaN. Work items run largest first from a
// shared counter: with causal masking a tile's cost grows with its position, and a static split
// of the item range over two threads would leave one with three quarters of the work.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using hybridkv_cpu::exp_nonpositive;  // cpu_math.h, put in front of this file by the loader
using hybridkv_cpu::kLanes;
using hybridkv_cpu::load_vec;
using hybridkv_cpu::splat;
using hybridkv_cpu::store_vec;
using hybridkv_cpu::to_float;
using hybridkv_cpu::vfloat;

constexpr int64_t kKeyBlock = 64;  // keys per online-softmax block
constexpr int64_t kMaxRows = 96;   // query rows (positions x heads of a KV head) per work item
constexpr float kNoMax = -1e30f;   // the running maximum before any key (see the header)
// Register blocks: 32 vector registers with AVX-512, 16 with AVX2 (accumulators + operands).
constexpr int kScoreKeys = kLanes == 16 ? 8 : 3;
constexpr int kScoreVecs = 3;
constexpr int kValueRows = kLanes == 16 ? 6 : 2;
constexpr int kValueVecs = 4;

// st[t * ld + lanes] = sum_d k_t[d] * qt[d][lanes] for KT keys (rows at krow[t]) x C row
// vectors from column c0; with bmax, also bmax[lanes] = max(bmax, the largest of the KT scores).
template <int KT, int C>
inline void score_block(const float* __restrict__ qt, int64_t ld, const float* const* krow, int64_t D,
                        float* __restrict__ st, int64_t c0, float* __restrict__ bmax) {
  vfloat acc[KT][C] = {};
  const float* k[KT];
  for (int t = 0; t < KT; ++t) k[t] = krow[t];
  for (int64_t d = 0; d < D; ++d) {
    vfloat qv[C];
    for (int c = 0; c < C; ++c) qv[c] = load_vec(qt + d * ld + c0 + c * kLanes);
    for (int t = 0; t < KT; ++t) {
      const vfloat kb = splat(k[t][d]);
      for (int c = 0; c < C; ++c) acc[t][c] += kb * qv[c];
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int c = 0; c < C; ++c) store_vec(st + t * ld + c0 + c * kLanes, acc[t][c]);
  if (bmax != nullptr)
    for (int c = 0; c < C; ++c) {
      vfloat m = load_vec(bmax + c0 + c * kLanes);
      for (int t = 0; t < KT; ++t) m = acc[t][c] > m ? acc[t][c] : m;
      store_vec(bmax + c0 + c * kLanes, m);
    }
}

template <int KT>
inline void score_keys(const float* qt, int64_t ld, const float* const* krow, int64_t D, float* st, int64_t vecs,
                       float* bmax) {
  int64_t v = 0;
  for (; v + kScoreVecs <= vecs; v += kScoreVecs) score_block<KT, kScoreVecs>(qt, ld, krow, D, st, v * kLanes, bmax);
  switch (vecs - v) {
    case 1: score_block<KT, 1>(qt, ld, krow, D, st, v * kLanes, bmax); break;
    case 2: score_block<KT, 2>(qt, ld, krow, D, st, v * kLanes, bmax); break;
  }
  static_assert(kScoreVecs == 3, "the tail switch covers kScoreVecs - 1 vectors");
}

// S^T [bl x ld] = K [bl x D] . Q^T [D x ld] over the padded rows (vecs vectors of lanes).
void scores(const float* qt, int64_t ld, const float* const* krow, int64_t D, float* st, int64_t bl, int64_t vecs,
            float* bmax) {
  int64_t t = 0;
  for (; t + kScoreKeys <= bl; t += kScoreKeys) score_keys<kScoreKeys>(qt, ld, krow + t, D, st + t * ld, vecs, bmax);
  for (; t < bl; ++t) score_keys<1>(qt, ld, krow + t, D, st + t * ld, vecs, bmax);
}

// o[r][c0 ..] = o[r][c0 ..] * alpha[r] + sum_t p[t * ld + r] * value_t[c0 ..] for R rows from r0.
template <int R, int C, typename scalar_t>
inline void value_block(float* __restrict__ o, int64_t D, const float* __restrict__ alpha,
                        const float* __restrict__ p, int64_t ld, const scalar_t* const* values, int64_t bl,
                        int64_t r0, int64_t c0) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r) {
    const vfloat a = splat(alpha[r0 + r]);
    for (int c = 0; c < C; ++c) acc[r][c] = a * load_vec(o + (r0 + r) * D + c0 + c * kLanes);
  }
  for (int64_t t = 0; t < bl; ++t) {
    vfloat vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_vec(values[t] + c0 + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat pb = splat(p[t * ld + r0 + r]);
      for (int c = 0; c < C; ++c) acc[r][c] += pb * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store_vec(o + (r0 + r) * D + c0 + c * kLanes, acc[r][c]);
}

template <int R, typename scalar_t>
inline void value_rows(float* o, int64_t D, const float* alpha, const float* p, int64_t ld,
                       const scalar_t* const* values, int64_t bl, int64_t r0) {
  const int64_t vecs = D / kLanes;
  int64_t v = 0;
  for (; v + kValueVecs <= vecs; v += kValueVecs) value_block<R, kValueVecs>(o, D, alpha, p, ld, values, bl, r0, v * kLanes);
  for (; v < vecs; ++v) value_block<R, 1>(o, D, alpha, p, ld, values, bl, r0, v * kLanes);
}

// O [rows x D] = O * alpha + P . V for every row, P stored transposed (p[t * ld + row]).
template <typename scalar_t>
void values(float* o, int64_t D, const float* alpha, const float* p, int64_t ld, const scalar_t* const* vrows,
            int64_t bl, int64_t rows) {
  int64_t r = 0;
  for (; r + kValueRows <= rows; r += kValueRows) value_rows<kValueRows>(o, D, alpha, p, ld, vrows, bl, r);
  for (; r < rows; ++r) value_rows<1>(o, D, alpha, p, ld, vrows, bl, r);
}

// Online softmax for one key block of scores S^T [bl x ld], lane by lane: with bm holding the
// block's maxima, bm becomes the rescale factor of the earlier blocks (0 on the first block a
// row sees), m the running maxima, l the rescaled running sums, and S the block's weights.
inline void softmax_weights(float* st, int64_t ld, int64_t bl, float* bm, float* m, float* l) {
#if defined(__AVX512F__)
  for (int64_t r = 0; r < ld; r += 16) {
    const __m512 old_m = _mm512_loadu_ps(m + r);
    const __m512 new_m = _mm512_max_ps(_mm512_loadu_ps(bm + r), old_m);
    const __m512 alpha = hybridkv_cpu::exp_nonpositive16(_mm512_sub_ps(old_m, new_m));
    _mm512_storeu_ps(bm + r, alpha);
    _mm512_storeu_ps(m + r, new_m);
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l + r), alpha);
    for (int64_t t = 0; t < bl; ++t) {
      float* s = st + t * ld + r;
      // A masked key (-inf) weighs 0.
      const __m512 e = hybridkv_cpu::exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(s), new_m));
      _mm512_storeu_ps(s, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l + r, sum);
  }
#else
#pragma omp simd
  for (int64_t r = 0; r < ld; ++r) {
    const float new_m = bm[r] > m[r] ? bm[r] : m[r];
    bm[r] = exp_nonpositive(m[r] - new_m);  // 0 on the first block a row sees
    m[r] = new_m;
    l[r] *= bm[r];
  }
  for (int64_t t = 0; t < bl; ++t) {
    float* srow = st + t * ld;
#pragma omp simd
    for (int64_t r = 0; r < ld; ++r) {
      const float e = exp_nonpositive(srow[r] - m[r]);  // a masked key (-inf) weighs 0
      srow[r] = e;
      l[r] += e;
    }
  }
#endif
}

struct Item {
  int64_t group, head, q0, q1;  // query rows [q0, q1) of the group (absolute rows of q)
  int64_t cost;                 // keys x queries, for the largest-first order
};

template <typename scalar_t, typename cache_t>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& block_table, const torch::Tensor& group_start, const torch::Tensor& group_row,
         const torch::Tensor& positions, int64_t page_size, int64_t window, double scale) {
  const hybridkv_cpu::PagedGroups<scalar_t, cache_t> c(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                             positions, page_size, window, scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Every key a group's rows may read must lie on a page its block-table row names.
  for (int64_t g = 0; g < c.G; ++g)
    if (c.gs[g + 1] > c.gs[g])
      TORCH_CHECK(c.pos[c.gs[g + 1] - 1] / page_size < c.bt_width, "position ", c.pos[c.gs[g + 1] - 1],
                  " is past the block table's ", c.bt_width, " pages");

  const int64_t tile = std::max<int64_t>(1, kMaxRows / c.grp);  // query positions per item
  std::vector<Item> items;
  for (int64_t g = 0; g < c.G; ++g)
    for (int64_t a = c.gs[g]; a < c.gs[g + 1]; a += tile) {
      const int64_t b = std::min<int64_t>(c.gs[g + 1], a + tile);
      const int64_t keys = c.pos[b - 1] - c.window_start(c.pos[a]) + 1;
      for (int64_t h = 0; h < c.Hkv; ++h) items.push_back({g, h, a, b, keys * (b - a)});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  const int64_t max_rows = tile * c.grp;
  const int64_t ld = (max_rows + kLanes - 1) / kLanes * kLanes;  // rows padded to whole vectors
  // Per thread: Q^T [c.D x ld], the key block widened to float [kKeyBlock x c.D] (bf16 and FP8 caches;
  // float32 keys are read in place), S^T [kKeyBlock x ld], O [ld x c.D], running max, sum and
  // rescale [ld] each; plus the block's key and value row addresses.
  const int64_t per_thread = c.D * ld + kKeyBlock * c.D + kKeyBlock * ld + ld * c.D + 3 * ld;
  const int nthreads = at::get_num_threads();
  auto scratch = torch::empty({nthreads, per_thread}, q.options().dtype(torch::kFloat32));
  float* scratch_base = scratch.data_ptr<float>();
  std::vector<const cache_t*> row_ptrs(static_cast<size_t>(nthreads) * kKeyBlock);
  std::vector<const float*> key_ptrs(static_cast<size_t>(nthreads) * kKeyBlock);
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());

  at::parallel_for(0, nthreads, 1, [&](int64_t t_begin, int64_t t_end) {
    for (int64_t worker = t_begin; worker < t_end; ++worker) {  // one chunk per thread
      float* qt = scratch_base + at::get_thread_num() * per_thread;
      float* kbuf = qt + c.D * ld;
      float* st = kbuf + kKeyBlock * c.D;
      float* o = st + kKeyBlock * ld;
      float* m = o + ld * c.D;
      float* l = m + ld;
      float* alpha = l + ld;
      const cache_t** vrows = row_ptrs.data() + at::get_thread_num() * kKeyBlock;
      const float** krows = key_ptrs.data() + at::get_thread_num() * kKeyBlock;
      for (int64_t i = next++; i < num_items; i = next++) {
        const Item& it = items[i];
        const int64_t h = it.head, nq = it.q1 - it.q0, rows = nq * c.grp;
        const int64_t vecs = (rows + kLanes - 1) / kLanes;
        const int32_t* row_pages = c.bt + c.gr[it.group] * c.bt_stride;
        // Q^T, scaled; row (query i, head j) is column i * c.grp + j; padding columns are zero.
        std::fill(qt, qt + c.D * ld, 0.f);
        for (int64_t qi = 0; qi < nq; ++qi)
          for (int64_t j = 0; j < c.grp; ++j) {
            const scalar_t* src = c.query(it.q0 + qi, h * c.grp + j);
            for (int64_t d = 0; d < c.D; ++d) qt[d * ld + qi * c.grp + j] = to_float(src[d]) * c.fscale;
          }
        std::fill(m, m + ld, kNoMax);
        std::fill(l, l + ld, 0.f);
        std::fill(o, o + ld * c.D, 0.f);
        const int64_t p_first = c.pos[it.q0], p_last = c.pos[it.q1 - 1];
        const int64_t k_first = c.window_start(p_first);
        // Blocks start at multiples of kKeyBlock, not at the tile's first key: a row then sees
        // the same blocks, so the same rounding, whichever tile (chunk) it comes in (a window
        // moves k_first with the tile). Keys of the first block before k_first are masked, and
        // read the key at k_first in their place: their pages may be released, and a masked
        // key's weight is exactly 0 only against a finite value.
        for (int64_t b0 = k_first / kKeyBlock * kKeyBlock; b0 <= p_last; b0 += kKeyBlock) {
          const int64_t bl = std::min<int64_t>(kKeyBlock, p_last - b0 + 1);
          // The block's keys as float rows, and its value rows' addresses, through the pages.
          for (int64_t t = 0; t < bl; ++t) {
            const int64_t kpos = std::max(b0 + t, k_first);
            const int64_t slot = static_cast<int64_t>(row_pages[kpos / page_size]) * page_size + kpos % page_size;
            const cache_t* key = c.kp + h * c.kh + slot * c.ks;
            if constexpr (std::is_same_v<cache_t, float>) {
              krows[t] = key;  // float32 keys are read in place
            } else {
              float* dst = kbuf + t * c.D;
              for (int64_t d = 0; d < c.D; d += kLanes) store_vec(dst + d, load_vec(key + d));
              krows[t] = dst;
            }
            vrows[t] = c.vp + h * c.vh + slot * c.vs;
          }
          // Mask what some row may not see: keys after the first query (the causal diagonal), or
          // before the last query's window start (the window's edge).
          const bool masked = b0 + bl - 1 > p_first || (window > 0 && b0 < c.window_start(p_last));
          float* bm = alpha;  // the block maximum first, then the rescale factor in place
          if (!masked) std::fill(bm, bm + ld, kNoMax);
          scores(qt, ld, krows, c.D, st, bl, vecs, masked ? nullptr : bm);
          if (masked) {
            for (int64_t t = 0; t < bl; ++t) {
              const int64_t kpos = b0 + t;
              float* srow = st + t * ld;
              for (int64_t qi = 0; qi < nq; ++qi) {
                const int64_t p = c.pos[it.q0 + qi];
                if (kpos > p || kpos < c.window_start(p))
                  for (int64_t j = 0; j < c.grp; ++j) srow[qi * c.grp + j] = neg_inf;
              }
            }
          }
          // Online softmax, lane by lane: block max (taken by the score loop where no mask
          // followed it), rescale of the earlier blocks, weights.
          if (masked) {
            std::copy(st, st + ld, bm);
            for (int64_t t = 1; t < bl; ++t) {
              const float* srow = st + t * ld;
#pragma omp simd
              for (int64_t r = 0; r < ld; ++r) bm[r] = srow[r] > bm[r] ? srow[r] : bm[r];
            }
          }
          softmax_weights(st, ld, bl, bm, m, l);
          values(o, c.D, alpha, st, ld, vrows, bl, rows);
        }
        for (int64_t qi = 0; qi < nq; ++qi)
          for (int64_t j = 0; j < c.grp; ++j) {
            const int64_t r = qi * c.grp + j;
            const float inv = 1.f / l[r];  // every row sees at least its own key
            scalar_t* dst = c.op + ((it.q0 + qi) * c.H + h * c.grp + j) * c.D;
            const float* a = o + r * c.D;
            for (int64_t d = 0; d < c.D; d += kLanes) store_vec(dst + d, load_vec(a + d) * inv);
          }
      }
    }
  });
}

}  // namespace

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor block_table, torch::Tensor group_start, torch::Tensor group_row,
                                torch::Tensor positions, int64_t page_size, int64_t window, double scale) {
  hybridkv_cpu::check_paged_groups(q, k_cache, v_cache, block_table, group_start, group_row, positions);
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "prefill_attention takes float32 or bfloat16");
  TORCH_CHECK(q.size(2) % kLanes == 0, "head size ", q.size(2), " is not a multiple of ", kLanes, " lanes");
  TORCH_CHECK(page_size > 0, "page_size must be positive");
  auto out = torch::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  if (group_row.size(0) == 0) return out;
  // Query dtype x cache dtype (the query's, or an FP8 format widened as it is loaded).
  auto with_cache = [&](auto query_tag) {
    using scalar_t = decltype(query_tag);
    switch (k_cache.scalar_type()) {
      case at::kFloat8_e4m3fn:
        return run<scalar_t, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                                 positions, page_size, window, scale);
      case at::kFloat8_e5m2:
        return run<scalar_t, c10::Float8_e5m2>(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                               positions, page_size, window, scale);
      default:
        return run<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_table, group_start, group_row, positions,
                                       page_size, window, scale);
    }
  };
  if (q.scalar_type() == torch::kFloat32)
    with_cache(float{});
  else
    with_cache(c10::BFloat16{});
  return out;
}
