// Prefill attention in bfloat16 on bf16 dot products: AMX tiles (Intel Sapphire Rapids and
// later) or AVX512-BF16 vectors (AMD Zen 4 and Zen 5).
//
// prefill_attention.cpp's call (query groups at consecutive positions, K/V read through the
// block table, causal, optionally windowed) for bfloat16 on a CPU with bf16 dot products: both
// products on them, the online softmax between them in AVX-512 float32. The loader builds this
// file twice, with the two products (score_block, accumulate_values) from bf16_products_amx.h
// or from bf16_products_avx512.h in front of it; everything below is shared.
//  - AMX, on the Intel AMX VM (1,024-token causal prompt, 9 / 3 heads, D 64): ~1.3-1.6 ms a layer
//    against SDPA's 2.8-3.3 (the float32-FMA kernel and SDPA's bf16 flash attention, which does
//    not use AMX at these shapes, both run at ~300 GFLOP/s on two cores there); the tile work
//    alone is ~0.6-1.1 ms and the softmax alone ~0.5 (each measured with the other removed).
//  - AVX512-BF16 vectors, on a 2-core AMD EPYC Zen 4 (family 25 model 17), the same prompt:
//    3.6-3.9 ms a layer against SDPA's 12.2 and the float32-FMA kernel's 7.0-7.6.
// Precision is that of SDPA's bf16 flash attention: scores and the softmax in float32, the
// weights rounded to bf16 for the second product, accumulation in float32.
//
// Two passes:
//  1. Pack. Each group's keys [window start of its first query, its last query] are copied,
//     per KV head and block of kKeyBlock keys, into the layout bf16 dot products read (AMX's B
//     operand, "VNNI": pairs along the reduction dimension side by side): K^T as [d pair][key][2]
//     for the scores, V as [key pair][d][2] for the values. Keys outside that range, and the
//     block's padding, are zeros (the mask removes them). Each key is packed once per step,
//     not once per query tile.
//  2. Attend. A work item is (group, KV head, 16 query rows); rows are the group's queries x
//     the query heads under the KV head (GQA folded in), so one Q block serves up to 16 rows.
//     Per key block: S [16 x 64] = Q . K^T (four 16 x 16 float blocks), masked where a key lies
//     after a row's query or before its window; the rows' block maxima, P = 2^(S log2 e - max)
//     in bf16 and its sums; O += P . V with O's float32 rows loaded into the accumulators (tiles
//     or vector registers) and stored back. A row's running maximum moves only when a block's
//     exceeds it by more than 8 (log2 units), so O and the sums are rescaled rarely. The next
//     block's scores are issued before this block's softmax. Blocks no row of the item may see
//     are skipped. Items run largest first from a shared counter, like the float32 kernel's.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kRows = 16;      // query rows per work item: one AMX tile of Q
using hybridkv_bf16::kKeyBlock;    // keys per online-softmax block (the products' packed block)
constexpr int64_t kMaxHead = 256;  // head sizes up to this (a multiple of 64) take this kernel
constexpr float kNoMax = -1e30f;   // the running maximum before any key (as in the float32 kernel)

using hybridkv_bf16::accumulate_values;  // O += P . V (the products' header)
using hybridkv_bf16::score_block;        // S = Q . K^T

// 2^x for x <= 0 (scores times log2(e) minus their running maximum): x = n + r with n an
// integer and |r| <= 1/2, 2^r by its degree-5 Taylor polynomial in r ln 2 (relative error below
// 2.5e-6, far under the bf16 rounding the weights then take), 2^n by scalef, which also takes
// the result to 0 for x far below the float range. Nine vector instructions; x must be finite.
// (cpu_math.h's exp_nonpositive16, float32-accurate, costs this kernel 4%: see there.)
inline __m512 exp2_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);                 // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108665e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650696e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718056e-1f));  // ln2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Where a group's packed keys start: the 64-aligned block holding its first visible key.
struct GroupKeys {
  int64_t key0;    // absolute position of the first packed key (a multiple of kKeyBlock)
  int64_t blocks;  // packed blocks
  int64_t offset;  // into the packed buffers (elements), for KV head 0; head h adds h * blocks * kKeyBlock * D
};

// One block of kKeyBlock keys of one KV head into the packed K^T and V layouts (see the header). key
// rows outside [lo, hi] are zeros.
void pack_block(const hybridkv_cpu::PagedGroups<c10::BFloat16>& c, const int32_t* row_pages, int64_t h,
                int64_t b0, int64_t lo, int64_t hi, uint16_t* kdst, uint16_t* vdst) {
  const int64_t D = c.D;
  uint32_t* k32 = reinterpret_cast<uint32_t*>(kdst);
  for (int64_t t = 0; t < kKeyBlock; ++t) {
    const int64_t kpos = b0 + t;
    const bool live = kpos >= lo && kpos <= hi;
    const uint16_t* krow = nullptr;
    const uint16_t* vrow = nullptr;
    if (live) {
      const int64_t slot = static_cast<int64_t>(row_pages[kpos / c.page_size]) * c.page_size + kpos % c.page_size;
      krow = reinterpret_cast<const uint16_t*>(c.kp + h * c.kh + slot * c.ks);
      vrow = reinterpret_cast<const uint16_t*>(c.vp + h * c.vh + slot * c.vs);
    }
    // K^T: 16-key sub-block s holds [D / 2 d pairs][16 keys] of 32-bit (bf16 pair) entries.
    const int64_t s = t / 16, tt = t % 16;
    uint32_t* ks = k32 + s * 8 * D + tt;
    if (live) {
      uint32_t pairs[kMaxHead / 2];
      std::memcpy(pairs, krow, D * 2);
      for (int64_t dp = 0; dp < D / 2; ++dp) ks[dp * 16] = pairs[dp];
    } else {
      for (int64_t dp = 0; dp < D / 2; ++dp) ks[dp * 16] = 0;
    }
    // V: 32-key half kk holds [D / 16 chunks][16 key pairs][16 d][2].
    const int64_t kk = t / 32, kp = (t % 32) / 2, e = t % 2;
    uint16_t* vs = vdst + kk * 32 * D + kp * 32 + e;
    for (int64_t d = 0; d < D; ++d) vs[(d / 16) * 512 + (d % 16) * 2] = live ? vrow[d] : 0;
  }
}

struct Item {
  int64_t group, head, r0;  // rows [r0, r0 + kRows) of the group (row = query * grp + head offset)
  int64_t cost;             // keys x rows, for the largest-first order
};

// Per-thread scratch, 64-byte aligned for the tile (and aligned vector) loads and stores.
struct alignas(64) Scratch {
  uint16_t q[kRows * kMaxHead];
  float s[2][kRows * kKeyBlock];     // scores of this block and the next (see attend)
  uint16_t p[2][kRows * kKeyBlock];  // weights, double-buffered the same way
  float o[kRows * kMaxHead];
  float l[kRows * 16];  // each row's softmax sum, as 16 lane-wise partial sums
  int64_t pos[kRows], first[kRows];  // each row's query position and first visible key
};

void attend(const hybridkv_cpu::PagedGroups<c10::BFloat16>& c, const std::vector<GroupKeys>& keys,
            const uint16_t* kpacked, const uint16_t* vpacked, const Item& it, Scratch& w) {
  const int64_t D = c.D, g = it.group, h = it.head;
  const int64_t q_first = c.gs[g], rows_total = (c.gs[g + 1] - q_first) * c.grp;
  const int64_t rows = std::min<int64_t>(kRows, rows_total - it.r0);
  // Q rows (zeros past the group's end), positions, visible ranges, softmax state.
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t rr = std::min<int64_t>(it.r0 + r, it.r0 + rows - 1);  // padding repeats the last row's range
    const int64_t qi = rr / c.grp, j = rr % c.grp;
    w.pos[r] = c.pos[q_first + qi];
    w.first[r] = c.window_start(w.pos[r]);
    uint16_t* dst = w.q + r * D;
    if (r < rows)
      std::memcpy(dst, c.query(q_first + qi, h * c.grp + j), D * 2);
    else
      std::memset(dst, 0, D * 2);
  }
  __m512 m = _mm512_set1_ps(kNoMax);  // running maxima, lane r for row r, in log2 units
  std::fill(w.l, w.l + kRows * 16, 0.f);
  std::fill(w.o, w.o + kRows * D, 0.f);
  const GroupKeys& gk = keys[g];
  const int64_t per_head = gk.blocks * kKeyBlock * D;
  const uint16_t* kh = kpacked + gk.offset + h * per_head;
  const uint16_t* vh = vpacked + gk.offset + h * per_head;
  const int64_t p_lo = w.pos[0], p_hi = w.pos[kRows - 1];
  const int64_t first_block = (w.first[0] - gk.key0) / kKeyBlock, last_block = (p_hi - gk.key0) / kKeyBlock;
  const __m512 log2_scale = _mm512_set1_ps(c.fscale * 1.44269504088896341f);
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // The next block's scores are issued before this block's softmax: on AMX the tile unit works on
  // them while the vector units run the exponentials (the tile stores would otherwise hold back the
  // softmax behind them).
  score_block(w.q, D, kh + first_block * kKeyBlock * D, w.s[first_block & 1]);
  for (int64_t b = first_block; b <= last_block; ++b) {
    const int64_t b0 = gk.key0 + b * kKeyBlock;
    if (b < last_block) score_block(w.q, D, kh + (b + 1) * kKeyBlock * D, w.s[(b + 1) & 1]);
    const float* s_block = w.s[b & 1];
    uint16_t* p_block = w.p[b & 1];
    // Which keys each row may see, where the block crosses a row's query or window start
    // (rows grow in position): lane masks, all ones elsewhere.
    const bool edge = b0 + kKeyBlock - 1 > p_lo || b0 < w.first[kRows - 1];
    __mmask16 live[kRows][4];
    hybridkv_cpu::vfloat row_max[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      const float* srow = s_block + r * kKeyBlock;
      __m512 mx = neg_inf;
      for (int i = 0; i < 4; ++i) {
        live[r][i] = 0xFFFF;
        if (edge) {
          const __m512 kpos = _mm512_add_ps(lane, _mm512_set1_ps(static_cast<float>(b0 + 16 * i)));
          live[r][i] = _mm512_cmp_ps_mask(kpos, _mm512_set1_ps(static_cast<float>(w.pos[r])), _CMP_LE_OQ) &
                       _mm512_cmp_ps_mask(kpos, _mm512_set1_ps(static_cast<float>(w.first[r])), _CMP_GE_OQ);
        }
        mx = _mm512_mask_max_ps(mx, live[r][i], mx, _mm512_load_ps(srow + 16 * i));
      }
      row_max[r] = mx;
    }
    // The block's maxima, all rows at once, in log2 units. A row's running maximum moves only
    // when the block's exceeds it by more than 8 (weights up to 2^8 are harmless in float32 and
    // bf16), so after the first blocks the rescale of O and l is rare; where it does move,
    // alpha = 2^(old - new) rescales what that row has summed so far.
    const __m512 block_max = _mm512_mul_ps(hybridkv_cpu::hmax_each(row_max), log2_scale);  // -inf: nothing visible
    const __mmask16 grow = _mm512_cmp_ps_mask(block_max, _mm512_add_ps(m, _mm512_set1_ps(8.f)), _CMP_GT_OQ);
    if (grow) {
      const __m512 new_m = _mm512_mask_mov_ps(m, grow, block_max);
      alignas(64) float alpha[kRows];
      _mm512_store_ps(alpha, exp2_nonpositive16(_mm512_max_ps(_mm512_sub_ps(m, new_m), _mm512_set1_ps(-1e30f))));
      m = new_m;
      for (int64_t r = 0; r < kRows; ++r) {
        if (!((grow >> r) & 1)) continue;
        const __m512 a = _mm512_set1_ps(alpha[r]);
        _mm512_store_ps(w.l + r * 16, _mm512_mul_ps(_mm512_load_ps(w.l + r * 16), a));
        float* orow = w.o + r * D;
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), a));
      }
    }
    // Weights P = 2^(S log2(e) scale - m) in bf16, and their sums.
    alignas(64) float m_rows[kRows];
    _mm512_store_ps(m_rows, m);
    for (int64_t r = 0; r < kRows; ++r) {
      const float* srow = s_block + r * kKeyBlock;
      const __m512 mr = _mm512_set1_ps(m_rows[r]);
      __m512 e[4];
      for (int i = 0; i < 4; ++i)
        e[i] = _mm512_maskz_mov_ps(live[r][i],
                                   exp2_nonpositive16(_mm512_fmsub_ps(_mm512_load_ps(srow + 16 * i), log2_scale, mr)));
      float* lrow = w.l + r * 16;
      _mm512_store_ps(lrow, _mm512_add_ps(_mm512_load_ps(lrow),
                                          _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3]))));
      uint16_t* prow = p_block + r * kKeyBlock;
      _mm512_store_si512(reinterpret_cast<__m512i*>(prow), (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      _mm512_store_si512(reinterpret_cast<__m512i*>(prow + 32), (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
    }
    accumulate_values(p_block, D, vh + b * kKeyBlock * D, w.o);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t rr = it.r0 + r, qi = rr / c.grp, j = rr % c.grp;
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(w.l + r * 16)));
    c10::BFloat16* dst = c.op + ((q_first + qi) * c.H + h * c.grp + j) * D;
    const float* orow = w.o + r * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(orow + d), inv));
      const __m256bh hi = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(orow + d + 16), inv));
      std::memcpy(dst + d, &lo, 32);
      std::memcpy(dst + d + 16, &hi, 32);
    }
  }
}

}  // namespace

bool products_available() { return hybridkv_bf16::products_ready(); }

torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_table, torch::Tensor group_start, torch::Tensor group_row,
                                    torch::Tensor positions, int64_t page_size, int64_t window, double scale) {
  hybridkv_cpu::check_paged_groups(q, k_cache, v_cache, block_table, group_start, group_row, positions);
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "prefill_attention_bf16 reads bfloat16 caches only "
              "(an FP8 cache goes to prefill_attention)");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "prefill_attention_bf16 takes bfloat16");
  TORCH_CHECK(q.size(2) % 64 == 0 && q.size(2) <= kMaxHead, "head size ", q.size(2),
              " is not a multiple of 64 up to ", kMaxHead);
  TORCH_CHECK(page_size > 0, "page_size must be positive");
  TORCH_CHECK(hybridkv_bf16::products_ready(), "this CPU or process cannot run this build's bf16 products");
  auto out = torch::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  if (group_row.size(0) == 0) return out;
  const hybridkv_cpu::PagedGroups<c10::BFloat16> c(out, q, k_cache, v_cache, block_table, group_start, group_row,
                                                  positions, page_size, window, scale);
  for (int64_t g = 0; g < c.G; ++g)
    if (c.gs[g + 1] > c.gs[g])
      TORCH_CHECK(c.pos[c.gs[g + 1] - 1] / page_size < c.bt_width, "position ", c.pos[c.gs[g + 1] - 1],
                  " is past the block table's ", c.bt_width, " pages");

  // Pass 1: every group's visible keys, per KV head, into the packed layouts.
  std::vector<GroupKeys> keys(c.G);
  struct PackJob { int64_t group, head, block; };
  std::vector<PackJob> jobs;
  int64_t total = 0;
  for (int64_t g = 0; g < c.G; ++g) {
    if (c.gs[g + 1] == c.gs[g]) { keys[g] = {0, 0, total}; continue; }
    const int64_t lo = c.window_start(c.pos[c.gs[g]]), hi = c.pos[c.gs[g + 1] - 1];
    const int64_t key0 = lo / kKeyBlock * kKeyBlock, blocks = (hi - key0) / kKeyBlock + 1;
    keys[g] = {key0, blocks, total};
    total += c.Hkv * blocks * kKeyBlock * c.D;
    for (int64_t h = 0; h < c.Hkv; ++h)
      for (int64_t b = 0; b < blocks; ++b) jobs.push_back({g, h, b});
  }
  std::unique_ptr<uint16_t[]> kpacked(new uint16_t[total]), vpacked(new uint16_t[total]);  // every entry is packed
  at::parallel_for(0, static_cast<int64_t>(jobs.size()), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PackJob& j = jobs[i];
      const GroupKeys& gk = keys[j.group];
      const int64_t at = gk.offset + j.head * gk.blocks * kKeyBlock * c.D + j.block * kKeyBlock * c.D;
      pack_block(c, c.bt + c.gr[j.group] * c.bt_stride, j.head, gk.key0 + j.block * kKeyBlock,
                 c.window_start(c.pos[c.gs[j.group]]), c.pos[c.gs[j.group + 1] - 1], kpacked.get() + at,
                 vpacked.get() + at);
    }
  });

  // Pass 2: work items, largest first.
  std::vector<Item> items;
  for (int64_t g = 0; g < c.G; ++g) {
    const int64_t rows = (c.gs[g + 1] - c.gs[g]) * c.grp;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t last_row = std::min(rows, r0 + kRows) - 1;
      const int64_t cost = c.pos[c.gs[g] + last_row / c.grp] - c.window_start(c.pos[c.gs[g] + r0 / c.grp]) + 1;
      for (int64_t h = 0; h < c.Hkv; ++h) items.push_back({g, h, r0, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int nthreads = at::get_num_threads();
  at::parallel_for(0, nthreads, 1, [&](int64_t t_begin, int64_t t_end) {
    if (t_begin >= t_end) return;
    std::unique_ptr<Scratch> w(new Scratch);
    const hybridkv_bf16::ThreadProducts products;  // AMX: this thread's tile configuration
    for (int64_t i = next++; i < num_items; i = next++) attend(c, keys, kpacked.get(), vpacked.get(), items[i], *w);
  });
  return out;
}
