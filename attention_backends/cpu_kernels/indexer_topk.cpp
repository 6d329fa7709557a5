// DeepSeek-V4's lightning indexer on the CPU, fused: scoring, ReLU, head-weighted sum and a
// running top-k in one pass over the keys, read in place through their slots.
//
// For query row r and causal entry e < visible[r]:
//     score[r, e] = scale * sum_h w[r, h] * ReLU(q[r, h, :] . key[e, :])
// and the result is the k entries with the highest scores, ties broken towards the lower entry
// index, returned in ascending index order -- hybrid_v4.select_topk's rule. When fewer than k
// entries are visible, the lowest-index invisible ones fill the row (select_topk puts masked
// -inf columns last, lowest index first); the caller masks them.
//
// Why a kernel: the torch path materialises [rows, heads, entries] scores, then passes over them
// for the ReLU, the head sum and the top-k; at long context those passes and the top-k cost as
// much as the scoring matmul. Here the scores of a few entries live in registers and are dropped
// at once unless they beat the row's running k-th score.
//
// Two layouts of the arithmetic, by how the keys are addressed:
//   * shared slot list (a prefill block: every row reads one causal list): each thread packs a
//     key block transposed, in panels of [c][tile entries], once for all its rows; a vector load
//     then covers kLanes entries, the query's elements are broadcast, and the head sum is a
//     vertical sum of vectors (run_packed). Rows are split over threads.
//   * page form (decode: each row its own pages): the keys are read in place through the page
//     table; the row's query is packed transposed, [c][heads padded to vectors], so one key
//     element broadcast against one vector multiplies it into kLanes heads at once (run). Few
//     rows are also split by entry segments across threads, and the segments' top-k sets are
//     merged at the end by the same total order.
//
// The key cache is float32, bfloat16 or an FP8 format (kv_cache_dtype, scale 1.0), widened to
// float32 as it is read -- exactly its values, so a key cache and its float32 widening give the
// same scores to the bit, and the same selection.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // lanes_above's compare
#endif

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using hybridkv_cpu::float_row;
using hybridkv_cpu::hsum;
using hybridkv_cpu::kLanes;
using hybridkv_cpu::load_vec;
using hybridkv_cpu::to_float;
using hybridkv_cpu::vfloat;

// Bit i set where lane i of v is above the same lane of t (false for NaN).
inline uint32_t lanes_above(vfloat v, vfloat t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(reinterpret_cast<__m512>(v), reinterpret_cast<__m512>(t), _CMP_GT_OQ);
#elif defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps(reinterpret_cast<__m256>(v), reinterpret_cast<__m256>(t), _CMP_GT_OQ));
#else
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= static_cast<uint32_t>(v[i] > t[i]) << i;
  return bits;
#endif
}

// Page form (run): rows per work item, entries per pass over an item's rows, and the unit that
// sizes entry segments (a lone decode row is split only past 4 key blocks). Rows have their own
// keys, yet passing them in key blocks measured 10-18% faster than one pass per segment (one row,
// 32k entries, Zen 3, alternating A/B; the cause is not pinned down), so the blocks stay.
constexpr int64_t kRowChunk = 16;
constexpr int64_t kKeyBlock = 256;
constexpr int kMaxHeadVectors = 8;  // heads <= 8 * kLanes (the caller checks <= 64)

// A candidate: its score and entry index. better(a, b): a ranks above b.
struct Cand {
  float s;
  int64_t e;
};
inline bool better(const Cand& a, const Cand& b) { return a.s > b.s || (a.s == b.s && a.e < b.e); }

// The running top-k of one row over entries seen in ascending index order. An entry enters the
// buffer only if it beats the k-th best kept at the last prune: a later entry with an equal
// score loses to it (higher index), so "strictly above" is exact, and the threshold only rises.
class RunningTopK {
 public:
  void reset(int64_t k) {
    k_ = k;
    buf_.clear();
    buf_.reserve(2 * k + 256);
    threshold_ = -std::numeric_limits<float>::infinity();
    full_ = false;
  }
  inline void offer(float s, int64_t e) {
    if (full_ && !(s > threshold_)) return;
    buf_.push_back({s, e});
    if (static_cast<int64_t>(buf_.size()) >= 2 * k_ + 256) prune();
  }
  // offer(s[i], e0 + i) for i < m. Once the buffer is full most entries lose to the threshold, and
  // a vector compare finds the few that may not (offer() checks each again, so a threshold that
  // rises within the block only means a redundant check). Testing every score one by one made
  // a prefill block's scoring 1.2-1.34x slower at 8 heads x 64 dims (Zen 3, benchmarks/README).
  inline void offer_block(const float* s, int64_t m, int64_t e0) {
    int64_t i = 0;
    if (full_) {
      const vfloat bar = vfloat{} + threshold_;
      for (; i + kLanes <= m; i += kLanes)
        for (uint32_t bits = lanes_above(load_vec(s + i), bar); bits; bits &= bits - 1) {
          const int j = __builtin_ctz(bits);
          offer(s[i + j], e0 + i + j);
        }
    }
    for (; i < m; ++i) offer(s[i], e0 + i);
  }
  // Keeps the k best; afterwards only entries strictly above the k-th can enter.
  void prune() {
    if (static_cast<int64_t>(buf_.size()) <= k_) return;
    std::nth_element(buf_.begin(), buf_.begin() + (k_ - 1), buf_.end(), better);
    threshold_ = buf_[k_ - 1].s;
    buf_.resize(k_);
    full_ = true;
  }
  std::vector<Cand>& candidates() { return buf_; }

 private:
  int64_t k_ = 0;
  std::vector<Cand> buf_;
  float threshold_ = 0.f;
  bool full_ = false;
};

// Where entry e of row r lives: a shared slot list, or the row's pages (slot = page * spp + e % spp).
struct KeyAddress {
  const int64_t* slots = nullptr;  // [L], shared by every row
  const int64_t* pages = nullptr;  // [n, page_cols]
  int64_t page_cols = 0;
  int64_t spp = 1;
  inline int64_t slot(int64_t r, int64_t e) const {
    if (slots) return slots[e];
    return pages[r * page_cols + e / spp] * spp + e % spp;
  }
};

// Key rows per tile of the page form (score_range): E x HV = 8 accumulators, enough independent
// FMAs to fill both pipes, and few enough key rows per tile that the DRAM streams keep up
// (measured 12 -> 8: 0.62 -> 0.51 ms over 32k entries from DRAM, 0.92 -> 0.66 ms over scattered
// pages; 6 was slower again).
template <int HV>
constexpr int kTileEntries = HV >= 8 ? 1 : 8 / HV;

// A key row as the page form scores it, element by element: float32 and bfloat16 rows in place (a
// bfloat16 element widens with one shift; widening its rows first was no faster at 64 heads), FP8
// rows widened whole into `scratch` (c floats) by vector loads first: c10's scalar e4m3fn
// conversion costs more than the element's FMAs (scoring through it was 1.5x slower at 64 heads
// and 7x at 16; 2-core Zen 4).
inline const float* scored_row(const float* key, int64_t, float*) { return key; }
inline const c10::BFloat16* scored_row(const c10::BFloat16* key, int64_t, float*) { return key; }
template <typename fp8_t>
inline const float* scored_row(const fp8_t* key, int64_t c, float* scratch) {
  hybridkv_cpu::widen(key, c, scratch);
  return scratch;
}

// Scores of E consecutive entries of one row: keys[i] point at their rows, qt is the row's
// transposed query [c][HV * kLanes], wv its head weights; out[i] = scale * sum_h w_h ReLU(dot_h).
template <int HV, int E, typename rt>
inline void score_entries(const rt* const* keys, const float* qt, const vfloat* wv, int64_t c, float scale,
                          float* out) {
  vfloat acc[E][HV];
  for (int i = 0; i < E; ++i)
    for (int j = 0; j < HV; ++j) acc[i][j] = vfloat{};
  for (int64_t d = 0; d < c; ++d) {
    vfloat qv[HV];
    for (int j = 0; j < HV; ++j) qv[j] = load_vec(qt + (d * HV + j) * kLanes);
    for (int i = 0; i < E; ++i) {
      const float kv = to_float(keys[i][d]);
      for (int j = 0; j < HV; ++j) acc[i][j] += qv[j] * kv;
    }
  }
  for (int i = 0; i < E; ++i) {
    vfloat t = vfloat{};
    for (int j = 0; j < HV; ++j) {
      const vfloat a = acc[i][j];
      t += (a > 0.f ? a : vfloat{}) * wv[j];
    }
    out[i] = hsum(t) * scale;
  }
}

// Entries [e0, e1) of row r into its running top-k. widened: kTileEntries<HV> * c floats, the
// scratch of scored_row.
template <typename kt, int HV>
void score_range(const kt* key_base, int64_t c, const KeyAddress& addr, int64_t r, int64_t e0, int64_t e1,
                 const float* qt, const vfloat* wv, float scale, float* widened, RunningTopK& top) {
  constexpr int E = kTileEntries<HV>;
  const kt* keys[E];
  decltype(scored_row(key_base, c, widened)) rows[E];  // what score_entries reads
  float s[E];
  int64_t e = e0;
  constexpr int64_t kAhead = 2 * E;  // entries prefetched ahead: decode reads keys from DRAM once
  for (; e + E <= e1; e += E) {
    if (e + kAhead + E <= e1) {  // the tile after next (approximate across a page boundary)
      const char* p = reinterpret_cast<const char*>(key_base + addr.slot(r, e + kAhead) * c);
      for (int64_t b = 0; b < static_cast<int64_t>(E * c * sizeof(kt)); b += 64) __builtin_prefetch(p + b);
    }
    if (addr.pages && e % addr.spp + E <= addr.spp) {  // within one page: one page-table lookup
      const kt* first = key_base + addr.slot(r, e) * c;
      for (int i = 0; i < E; ++i) keys[i] = first + i * c;
    } else {
      for (int i = 0; i < E; ++i) keys[i] = key_base + addr.slot(r, e + i) * c;
    }
    for (int i = 0; i < E; ++i) rows[i] = scored_row(keys[i], c, widened + i * c);
    score_entries<HV, E>(rows, qt, wv, c, scale, s);
    top.offer_block(s, E, e);
  }
  for (; e < e1; ++e) {
    rows[0] = scored_row(key_base + addr.slot(r, e) * c, c, widened);
    score_entries<HV, 1>(rows, qt, wv, c, scale, s);
    top.offer(s[0], e);
  }
}

template <typename kt, int HV>
void run(const float* q, const float* w, const kt* key_base, const KeyAddress& addr, const int64_t* visible,
         int64_t n, int64_t h, int64_t c, int64_t k, float scale, int64_t segments, int64_t seg_len,
         std::vector<RunningTopK>& tops) {
  constexpr int64_t Hp = HV * kLanes;
  // Transposed, head-padded queries and weights (zeros in the padding: ReLU(0) * 0 adds 0).
  std::vector<float> qt(n * c * Hp, 0.f), wp(n * Hp, 0.f);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t hh = 0; hh < h; ++hh) {
      wp[r * Hp + hh] = w[r * h + hh];
      for (int64_t d = 0; d < c; ++d) qt[(r * c + d) * Hp + hh] = q[(r * h + hh) * c + d];
    }
  const int64_t chunks = (n + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, chunks * segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(kTileEntries<HV> * c);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r0 = item / segments * kRowChunk, r1 = std::min(n, r0 + kRowChunk);
      const int64_t seg = item % segments, s0 = seg * seg_len;
      int64_t s1 = s0;
      for (int64_t r = r0; r < r1; ++r) s1 = std::max(s1, std::min(visible[r], s0 + seg_len));
      for (int64_t r = r0; r < r1; ++r) tops[seg * n + r].reset(k);
      for (int64_t b0 = s0; b0 < s1; b0 += kKeyBlock) {
        const int64_t b1 = std::min(s1, b0 + kKeyBlock);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t hi = std::min(b1, visible[r]);
          if (hi <= b0) continue;
          vfloat wv[HV];
          for (int j = 0; j < HV; ++j) wv[j] = load_vec(wp.data() + r * Hp + j * kLanes);
          score_range<kt, HV>(key_base, c, addr, r, b0, hi, qt.data() + r * c * Hp, wv, scale, widened.data(),
                              tops[seg * n + r]);
        }
      }
    }
  });
}

// ---- shared slot lists (prefill): keys packed transposed per key block ------------------------
//
// A prefill block's rows all read one slot list, so a key block is packed once per thread as
// panels of [c][tile entries] floats and every row of the thread reads it from cache: one vector load then
// covers kLanes entries, the query's elements are the broadcasts, and the head sum is vertical
// (no horizontal reductions). A tile is HT heads x EV entry vectors of accumulators.
constexpr int kTileVectors = 3;  // entry vectors per tile: 4 heads x 3 vectors = 12 accumulators

template <int HT, int EV>
inline void head_group(const float* q, const float* w, int64_t c, const float* kt, int64_t ldk, vfloat* tv) {
  vfloat acc[HT][EV];
  for (int hh = 0; hh < HT; ++hh)
    for (int v = 0; v < EV; ++v) acc[hh][v] = vfloat{};
  for (int64_t d = 0; d < c; ++d) {
    vfloat kv[EV];
    for (int v = 0; v < EV; ++v) kv[v] = load_vec(kt + d * ldk + v * kLanes);
    for (int hh = 0; hh < HT; ++hh) {
      const float qs = q[hh * c + d];
      for (int v = 0; v < EV; ++v) acc[hh][v] += kv[v] * qs;
    }
  }
  for (int hh = 0; hh < HT; ++hh)
    for (int v = 0; v < EV; ++v) {
      const vfloat a = acc[hh][v];
      tv[v] += (a > 0.f ? a : vfloat{}) * w[hh];
    }
}

// Scores of the EV * kLanes packed entries starting at kt (columns of a [c][ldk] block).
template <int EV>
inline void score_tile(const float* q, const float* w, int64_t h, int64_t c, const float* kt, int64_t ldk,
                       float scale, float* out) {
  vfloat tv[EV];
  for (int v = 0; v < EV; ++v) tv[v] = vfloat{};
  int64_t h0 = 0;
  for (; h0 + 4 <= h; h0 += 4) head_group<4, EV>(q + h0 * c, w + h0, c, kt, ldk, tv);
  switch (h - h0) {
    case 3: head_group<3, EV>(q + h0 * c, w + h0, c, kt, ldk, tv); break;
    case 2: head_group<2, EV>(q + h0 * c, w + h0, c, kt, ldk, tv); break;
    case 1: head_group<1, EV>(q + h0 * c, w + h0, c, kt, ldk, tv); break;
  }
  for (int v = 0; v < EV; ++v) {
    const vfloat sv = tv[v] * scale;
    std::memcpy(out + v * kLanes, &sv, sizeof(vfloat));
  }
}

template <typename kt>
void run_packed(const float* q, const float* w, const kt* key_base, const int64_t* slots, const int64_t* visible,
                int64_t n, int64_t h, int64_t c, int64_t k, float scale, std::vector<RunningTopK>& tops) {
  constexpr int64_t tile = kTileVectors * kLanes;
  // ~128 KB of packed keys per block (stays in L2 while the thread's rows pass over it).
  const int64_t block = std::max<int64_t>(tile, (32768 / c) / tile * tile);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = (n + threads - 1) / threads;
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> packed(c * block), s(tile), widened(c);  // block is a multiple of tile
    int64_t s1 = 0;
    for (int64_t r = r0; r < r1; ++r) {
      tops[r].reset(k);
      s1 = std::max(s1, visible[r]);
    }
    for (int64_t b0 = 0; b0 < s1; b0 += block) {
      const int64_t b1 = std::min(s1, b0 + block);
      // Panels of `tile` entries, each [c][tile]: a tile's loads walk one contiguous panel.
      const int64_t width = (b1 - b0 + tile - 1) / tile * tile;
      for (int64_t e = b0; e < b0 + width; ++e) {
        float* col = packed.data() + (e - b0) / tile * c * tile + (e - b0) % tile;
        if (e < b1) {  // a key widened by vector loads, then transposed into its column
          const float* src = float_row(key_base + slots[e] * c, c, widened.data());
          for (int64_t d = 0; d < c; ++d) col[d * tile] = src[d];
        } else {
          for (int64_t d = 0; d < c; ++d) col[d * tile] = 0.f;
        }
      }
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t hi = std::min(b1, visible[r]);
        const float* qr = q + r * h * c;
        const float* wr = w + r * h;
        RunningTopK& top = tops[r];
        int64_t e = b0;
        for (; e < hi; e += tile) {
          const int64_t m = std::min(tile, hi - e);
          const float* panel = packed.data() + (e - b0) / tile * c * tile;
          if (m > 2 * kLanes) score_tile<3>(qr, wr, h, c, panel, tile, scale, s.data());
          else if (m > kLanes) score_tile<2>(qr, wr, h, c, panel, tile, scale, s.data());
          else score_tile<1>(qr, wr, h, c, panel, tile, scale, s.data());
          top.offer_block(s.data(), m, e);
        }
      }
    }
  });
}

template <typename kt>
void dispatch(int hv, const float* q, const float* w, const kt* key_base, const KeyAddress& addr,
              const int64_t* visible, int64_t n, int64_t h, int64_t c, int64_t k, float scale, int64_t segments,
              int64_t seg_len, std::vector<RunningTopK>& tops) {
  switch (hv) {
#define HYBRIDKV_HV(N) \
  case N:              \
    return run<kt, N>(q, w, key_base, addr, visible, n, h, c, k, scale, segments, seg_len, tops);
    HYBRIDKV_HV(1) HYBRIDKV_HV(2) HYBRIDKV_HV(3) HYBRIDKV_HV(4)
    HYBRIDKV_HV(5) HYBRIDKV_HV(6) HYBRIDKV_HV(7) HYBRIDKV_HV(8)
#undef HYBRIDKV_HV
  }
  TORCH_CHECK(false, "indexer heads need ", hv, " vectors; at most ", kMaxHeadVectors, " are supported");
}

// f(kt{}) with kt the key cache's element type.
template <typename F>
void with_key_type(c10::ScalarType type, F&& f) {
  switch (type) {
    case torch::kFloat32: return f(float{});
    case torch::kBFloat16: return f(c10::BFloat16{});
    case at::kFloat8_e4m3fn: return f(c10::Float8_e4m3fn{});
    case at::kFloat8_e5m2: return f(c10::Float8_e5m2{});
    default:
      TORCH_CHECK(false, "key_cache must be float32, bfloat16, float8_e4m3fn or float8_e5m2, got ", type);
  }
}

}  // namespace

// q [n, h, c] float32, w [n, h] float32 (the per-head weights), key_cache [slots, c] float32,
// bfloat16, float8_e4m3fn or float8_e5m2; the entries' slots either shared (`slots` [L] int64,
// `pages` empty) or per row in page form (`pages` [n, page_cols] int64, slots_per_page); visible
// [n] int64 (row r reads entries [0, visible[r])); 1 <= k <= L. Returns [n, k] int64 entry
// indices, ascending per row.
torch::Tensor indexer_topk(torch::Tensor q, torch::Tensor w, torch::Tensor key_cache, torch::Tensor slots,
                           torch::Tensor pages, int64_t slots_per_page, torch::Tensor visible, int64_t length,
                           int64_t k, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [n, heads, dim] tensor");
  const int64_t n = q.size(0), h = q.size(1), c = q.size(2);
  TORCH_CHECK(w.sizes() == torch::IntArrayRef({n, h}) && w.scalar_type() == torch::kFloat32 && w.is_contiguous(),
              "w must be a contiguous float32 [n, heads] tensor");
  TORCH_CHECK(key_cache.dim() == 2 && key_cache.size(1) == c && key_cache.is_contiguous(),
              "key_cache must be a contiguous [slots, dim] tensor with q's dim");
  TORCH_CHECK(visible.dim() == 1 && visible.size(0) == n && visible.scalar_type() == torch::kInt64 &&
                  visible.is_contiguous(), "visible must be a contiguous int64 [n] tensor");
  TORCH_CHECK(1 <= k && k <= length, "k must be in [1, length]: k=", k, " length=", length);
  KeyAddress addr;
  if (pages.numel()) {
    TORCH_CHECK(pages.dim() == 2 && pages.size(0) == n && pages.scalar_type() == torch::kInt64 &&
                    pages.is_contiguous() && slots_per_page >= 1,
                "pages must be a contiguous int64 [n, pages] tensor with slots_per_page >= 1");
    addr.pages = pages.data_ptr<int64_t>();
    addr.page_cols = pages.size(1);
    addr.spp = slots_per_page;
  } else {
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == length && slots.scalar_type() == torch::kInt64 &&
                    slots.is_contiguous(), "slots must be a contiguous int64 [length] tensor");
    addr.slots = slots.data_ptr<int64_t>();
  }
  const int64_t* vis = visible.data_ptr<int64_t>();
  int64_t max_visible = 0;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(vis[r] >= 0 && vis[r] <= length, "visible[", r, "] = ", vis[r], " is outside [0, ", length, "]");
    if (addr.pages) TORCH_CHECK(vis[r] <= addr.page_cols * addr.spp, "row ", r, " sees past its pages");
    max_visible = std::max(max_visible, vis[r]);
  }
  // Few page-form rows (decode): split the entries too, so that every thread has work.
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = (n + kRowChunk - 1) / kRowChunk;
  int64_t segments = 1;
  if (addr.pages && chunks < threads && max_visible >= 4 * kKeyBlock)
    segments = std::min((threads + chunks - 1) / chunks, max_visible / (2 * kKeyBlock));
  const int64_t seg_len = std::max<int64_t>(1, (max_visible + segments - 1) / segments);
  std::vector<RunningTopK> tops(segments * n);
  const int hv = static_cast<int>((h + kLanes - 1) / kLanes);
  const float sc = static_cast<float>(scale);
  with_key_type(key_cache.scalar_type(), [&](auto type) {
    using kt = decltype(type);
    const kt* keys = key_cache.data_ptr<kt>();
    if (n && addr.slots)  // shared slot list: packed key blocks, rows split over threads
      run_packed<kt>(q.data_ptr<float>(), w.data_ptr<float>(), keys, addr.slots, vis, n, h, c, k, sc, tops);
    else if (n)
      dispatch<kt>(hv, q.data_ptr<float>(), w.data_ptr<float>(), keys, addr, vis, n, h, c, k, sc, segments, seg_len,
                   tops);
  });
  auto out = torch::empty({n, k}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<Cand> all;
    for (int64_t r = begin; r < end; ++r) {
      all.clear();
      for (int64_t s = 0; s < segments; ++s) {
        auto& cand = tops[s * n + r].candidates();
        all.insert(all.end(), cand.begin(), cand.end());
      }
      const int64_t kept = std::min<int64_t>(k, all.size());
      if (static_cast<int64_t>(all.size()) > k) std::nth_element(all.begin(), all.begin() + (k - 1), all.end(), better);
      int64_t* row = o + r * k;
      for (int64_t i = 0; i < kept; ++i) row[i] = all[i].e;
      std::sort(row, row + kept);
      for (int64_t i = kept; i < k; ++i) row[i] = vis[r] + (i - kept);  // invisible fill, lowest index first
    }
  });
  return out;
}
