// DeepSeek-V4's joint softmax attention on the CPU, fused. For query row r and head h, one
// softmax over the columns j the row may read in every key set, plus the head's sink logit:
//
//     l[j] = scale * q[r, h, :] . key_j,      m = max(sink[h], max_j l[j])
//     out[r, h, :] = sum_j exp(l[j] - m) * key_j / (exp(sink[h] - m) + sum_j exp(l[j] - m))
//
// (values = keys; the sink's value is zero). A key set is a slot list -- shared by every row (a
// prefill block) or one per row (decode, the indexer's top-k) -- with either an explicit mask
// [n, L] (the sliding window) or a causal count visible[n] (compressed entries: row r reads
// columns [0, visible[r])). This is hybrid_v4.joint_softmax_attention's math; it replaces the
// gathers of every key, the [rows, heads, keys] logits, masks, concatenation and softmax
// passes, which at these shapes cost several times the two matmuls.
//
// Per row: the logits of the row's readable column range of each key set are computed on key
// panels [D][kLanes] (kLanes keys transposed, as the indexer kernel does: a vector load covers
// kLanes keys, the query element is a broadcast, no horizontal sums); a shared set is packed
// once per call, a per-row set per row and only over its readable range. The softmax runs over
// the computed columns, and the weighted sum reads the keys row-major in place through their
// slots, two heads per pass over the keys (their accumulators stay in registers). Columns a row
// may not read never reach its output: their logits are -inf and their weights exactly 0,
// skipped in the weighted sum; a per-row set does not even read them (a shared set's columns
// are all written keys).
//
// The caches are float32 or one FP8 format (kv_cache_dtype, scale 1.0), every cache of a call
// the same. FP8 keys are widened as they are loaded -- when a panel is packed, and vector by vector
// in the weighted sum -- to exactly the float32 values, so an FP8 cache gives the bits its
// float32 widening (cache.float()) gives; the kernel reads a quarter of the bytes.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using hybridkv_cpu::exp_nonpositive;
using hybridkv_cpu::float_row;
using hybridkv_cpu::kLanes;
using hybridkv_cpu::load_vec;
using hybridkv_cpu::to_float;
using hybridkv_cpu::vfloat;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One key set as the kernel reads it. The cache's element type (cache_t: float or an FP8 type) is
// the call's, given to key().
struct KeySource {
  const void* cache = nullptr;  // [cache slots, D]
  const int64_t* slots = nullptr;  // [L] (shared) or [n, L]
  bool shared = true;
  const bool* mask = nullptr;  // [n, L], or null when `visible` is given
  const int64_t* visible = nullptr;  // [n]
  int64_t length = 0;  // L
  int64_t offset = 0;  // first column of this set in a row's logits (sets padded to kLanes)
  std::vector<float> panel;  // shared sets: every column, [ceil(L / kLanes)][D][kLanes]

  template <typename cache_t>
  inline const cache_t* key(int64_t r, int64_t j, int64_t D) const {
    return static_cast<const cache_t*>(cache) + (shared ? slots[j] : slots[r * length + j]) * D;
  }
  inline bool readable(int64_t r, int64_t j) const {
    return visible ? j < visible[r] : mask[r * length + j];
  }
  // Row r's readable columns lie in [lo, hi); nothing outside is read.
  void range(int64_t r, int64_t& lo, int64_t& hi) const {
    if (visible) {
      lo = 0;
      hi = std::min(length, std::max<int64_t>(0, visible[r]));
      return;
    }
    const bool* m = mask + r * length;
    lo = 0;
    while (lo < length && !m[lo]) ++lo;
    hi = length;
    while (hi > lo && !m[hi - 1]) --hi;
  }
};

// Columns [v0 * kLanes, v1 * kLanes) of row r as panels, zeros where the row may not read. A
// shared set is packed once for every row (r = 0, lo = 0, hi = L): then it must read all columns.
// FP8 keys are widened on the way (`key_row`: one key in float32, D floats).
template <typename cache_t>
void pack(const KeySource& s, int64_t r, int64_t lo, int64_t hi, int64_t D, int64_t v0, int64_t v1, float* panel,
          float* key_row) {
  for (int64_t v = v0; v < v1; ++v) {
    float* p = panel + v * D * kLanes;
    for (int64_t i = 0; i < kLanes; ++i) {
      const int64_t j = v * kLanes + i;
      if (j < lo || j >= hi || (!s.shared && !s.readable(r, j))) {
        for (int64_t d = 0; d < D; ++d) p[d * kLanes + i] = 0.f;
        continue;
      }
      const float* k = float_row(s.key<cache_t>(r, j, D), D, key_row);
      for (int64_t d = 0; d < D; ++d) p[d * kLanes + i] = k[d];
    }
  }
}

// Scaled logits of HT heads (queries q, rows D apart) for the kLanes keys of one panel, stored
// at out (head rows ld apart).
template <int HT>
inline void panel_logits(const float* q, int64_t D, const float* pv, float scale, float* out, int64_t ld) {
  vfloat acc[HT];
  for (int i = 0; i < HT; ++i) acc[i] = vfloat{};
  for (int64_t d = 0; d < D; ++d) {
    const vfloat kv = load_vec(pv + d * kLanes);
    for (int i = 0; i < HT; ++i) acc[i] += kv * q[i * D + d];
  }
  for (int i = 0; i < HT; ++i) {
    const vfloat a = acc[i] * scale;
    std::memcpy(out + i * ld, &a, sizeof(vfloat));
  }
}

// out[d0, d0 + NV * kLanes) of HG heads (weights p, rows ld apart; outputs D apart): sum_j p[j] *
// key_j over each set's range, times the head's inv. A key's vectors are loaded once for the HG
// heads (HG x NV accumulators: 2 x 4 with 4 key vectors and a broadcast fit AVX2's 16 registers).
// FP8 key vectors are widened as they are loaded (load_vec).
template <int NV, int HG, typename cache_t>
inline void weighted_keys(const std::vector<KeySource>& sets, const int64_t* lo, const int64_t* hi, int64_t r,
                          const float* p, int64_t ld, int64_t D, int64_t d0, const float* inv, float* out) {
  vfloat acc[HG][NV];
  for (int g = 0; g < HG; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = vfloat{};
  for (size_t s = 0; s < sets.size(); ++s) {
    const KeySource& ks = sets[s];
    const float* ps = p + ks.offset;
    for (int64_t j = lo[s]; j < hi[s]; ++j) {
      float w[HG];
      bool any = false;
      for (int g = 0; g < HG; ++g) {
        w[g] = ps[g * ld + j];
        any |= w[g] != 0.f;
      }
      if (!any) continue;  // masked (or underflowed) for every head: never read
      const cache_t* k = ks.key<cache_t>(r, j, D) + d0;
      for (int i = 0; i < NV; ++i) {
        const vfloat kv = load_vec(k + i * kLanes);
        for (int g = 0; g < HG; ++g) acc[g][i] += kv * w[g];
      }
    }
  }
  for (int g = 0; g < HG; ++g)
    for (int i = 0; i < NV; ++i) {
      const vfloat a = acc[g][i] * inv[g];
      std::memcpy(out + g * D + d0 + i * kLanes, &a, sizeof(vfloat));
    }
}

template <int HG, typename cache_t>
inline void weighted_heads(const std::vector<KeySource>& sets, const int64_t* lo, const int64_t* hi, int64_t r,
                           const float* p, int64_t ld, int64_t D, const float* inv, float* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) weighted_keys<4, HG, cache_t>(sets, lo, hi, r, p, ld, D, d0, inv, out);
  for (; d0 + kLanes <= D; d0 += kLanes) weighted_keys<1, HG, cache_t>(sets, lo, hi, r, p, ld, D, d0, inv, out);
  for (; d0 < D; ++d0)  // a head size that is not a multiple of the vector width
    for (int g = 0; g < HG; ++g) {
      float acc = 0.f;
      for (size_t s = 0; s < sets.size(); ++s)
        for (int64_t j = lo[s]; j < hi[s]; ++j) {
          const float w = p[g * ld + sets[s].offset + j];
          if (w != 0.f) acc += w * to_float(sets[s].key<cache_t>(r, j, D)[d0]);
        }
      out[g * D + d0] = acc * inv[g];
    }
}

// Sum of x[0, n) in an order fixed by n alone: kLanes partial sums over whole vectors from x[0],
// then the tail, then the lanes in order. A row's softmax denominator then does not depend on
// where its columns sit in a block's key list (a sliding window falls at another offset when the
// prefill chunks split elsewhere), so a prompt's rows round alike however it was chunked.
inline float ordered_sum(const float* x, int64_t n) {
  vfloat acc = vfloat{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) acc += load_vec(x + j);
  float tail = 0.f;
  for (; j < n; ++j) tail += x[j];
  return hybridkv_cpu::hsum(acc) + tail;
}

template <typename cache_t>
void attend_row(const std::vector<KeySource>& sets, int64_t r, const float* q, const float* sinks, int64_t H,
                int64_t D, float scale, int64_t ld, float* lg, std::vector<float>& row_panel, float* key_row,
                int64_t* lo, int64_t* hi, int64_t* c0, int64_t* c1, float* inv, float* out) {
  // Per set: the readable range [lo, hi) and the computed columns [c0, c1), whole panels around it.
  const size_t S = sets.size();
  for (size_t s = 0; s < S; ++s) {
    const KeySource& ks = sets[s];
    ks.range(r, lo[s], hi[s]);
    if (hi[s] <= lo[s]) {
      lo[s] = hi[s] = c0[s] = c1[s] = 0;
      continue;
    }
    const int64_t v0 = lo[s] / kLanes, v1 = (hi[s] + kLanes - 1) / kLanes;
    c0[s] = v0 * kLanes;
    c1[s] = v1 * kLanes;
    const float* panel = ks.panel.data();
    if (!ks.shared) {
      pack<cache_t>(ks, r, lo[s], hi[s], D, v0, v1, row_panel.data(), key_row);
      panel = row_panel.data();
    }
    for (int64_t v = v0; v < v1; ++v) {
      const float* pv = panel + v * D * kLanes;
      float* o = lg + ks.offset + v * kLanes;
      int64_t h = 0;
      for (; h + 4 <= H; h += 4) panel_logits<4>(q + h * D, D, pv, scale, o + h * ld, ld);
      switch (H - h) {
        case 3: panel_logits<3>(q + h * D, D, pv, scale, o + h * ld, ld); break;
        case 2: panel_logits<2>(q + h * D, D, pv, scale, o + h * ld, ld); break;
        case 1: panel_logits<1>(q + h * D, D, pv, scale, o + h * ld, ld); break;
      }
    }
    for (int64_t j = c0[s]; j < c1[s]; ++j)  // columns the row may not read weigh exactly 0
      if (j < lo[s] || j >= hi[s] || !ks.readable(r, j))
        for (int64_t h = 0; h < H; ++h) lg[h * ld + ks.offset + j] = kNegInf;
  }
  for (int64_t h = 0; h < H; ++h) {
    float* l = lg + h * ld;
    float m = sinks[h];
    for (size_t s = 0; s < S; ++s)
      for (int64_t j = c0[s]; j < c1[s]; ++j) m = std::max(m, l[sets[s].offset + j]);
    float sum = exp_nonpositive(sinks[h] - m);
    for (size_t s = 0; s < S; ++s) {
      float* ls = l + sets[s].offset;
#pragma omp simd
      for (int64_t j = c0[s]; j < c1[s]; ++j) ls[j] = exp_nonpositive(ls[j] - m);  // -inf (unreadable) gives 0
      sum += ordered_sum(ls + lo[s], hi[s] - lo[s]);
    }
    inv[h] = 1.f / sum;
  }
  int64_t h = 0;
  for (; h + 2 <= H; h += 2) weighted_heads<2, cache_t>(sets, lo, hi, r, lg + h * ld, ld, D, inv + h, out + h * D);
  if (h < H) weighted_heads<1, cache_t>(sets, lo, hi, r, lg + h * ld, ld, D, inv + h, out + h * D);
}

// Every row's output (out [n, H, D]) over the checked key sets, their caches of cache_t.
template <typename cache_t>
void attend_rows(std::vector<KeySource>& sets, const float* q, const float* sinks, int64_t n, int64_t H, int64_t D,
                 float scale, int64_t ld, float* out) {
  std::vector<float> widened(D);  // pack's scratch
  for (auto& ks : sets)
    if (ks.shared && ks.length) {
      const int64_t vectors = (ks.length + kLanes - 1) / kLanes;
      ks.panel.assign(vectors * D * kLanes, 0.f);
      pack<cache_t>(ks, 0, 0, ks.length, D, 0, vectors, ks.panel.data(), widened.data());
    }
  int64_t panel_cols = 0;  // the widest per-row set, for the row panel
  for (const auto& ks : sets)
    if (!ks.shared) panel_cols = std::max(panel_cols, (ks.length + kLanes - 1) / kLanes * kLanes);
  const size_t S = sets.size();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> lg(std::max<int64_t>(1, H * ld));
    std::vector<float> row_panel(std::max<int64_t>(1, panel_cols * D)), key_row(D);
    std::vector<int64_t> lo(S), hi(S), c0(S), c1(S);
    std::vector<float> inv(H);
    for (int64_t r = begin; r < end; ++r)
      attend_row<cache_t>(sets, r, q + r * H * D, sinks, H, D, scale, ld, lg.data(), row_panel, key_row.data(),
                          lo.data(), hi.data(), c0.data(), c1.data(), inv.data(), out + r * H * D);
  });
}

}  // namespace

// q [n, H, D] float32; sinks [H] float32; for each key set s: caches[s] [slots, D] float32,
// float8_e4m3fn or float8_e5m2 (one dtype for every set), slots[s] [L] (shared) or [n, L] int64,
// and either masks[s] [n, L] bool (visibles[s] empty) or visibles[s] [n] int64 (masks[s] empty).
// Returns out [n, H, D] float32.
torch::Tensor joint_attention(torch::Tensor q, torch::Tensor sinks, double scale, std::vector<torch::Tensor> caches,
                              std::vector<torch::Tensor> slots, std::vector<torch::Tensor> masks,
                              std::vector<torch::Tensor> visibles) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [n, heads, dim] tensor");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(sinks.dim() == 1 && sinks.size(0) == H && sinks.scalar_type() == torch::kFloat32 &&
                  sinks.is_contiguous(), "sinks must be a contiguous float32 [heads] tensor");
  const size_t S = caches.size();
  TORCH_CHECK(slots.size() == S && masks.size() == S && visibles.size() == S,
              "caches, slots, masks and visibles must have one entry per key set");
  const auto dtype = S ? caches[0].scalar_type() : torch::kFloat32;
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
              "the caches must be float32, float8_e4m3fn or float8_e5m2, got ", dtype);
  std::vector<KeySource> sets(S);
  int64_t ld = 0;
  for (size_t s = 0; s < S; ++s) {
    const auto& c = caches[s];
    const auto& sl = slots[s];
    TORCH_CHECK(c.scalar_type() == dtype, "key set ", s, ": the cache is ", c.scalar_type(), " but key set 0's is ",
                dtype, "; every cache of a call must have one dtype");
    TORCH_CHECK(c.dim() == 2 && c.size(1) == D && c.is_contiguous(), "key set ", s,
                ": the cache must be a contiguous [slots, ", D, "] tensor");
    TORCH_CHECK(sl.scalar_type() == torch::kInt64 && sl.is_contiguous() &&
                    (sl.dim() == 1 || (sl.dim() == 2 && sl.size(0) == n)),
                "key set ", s, ": slots must be a contiguous int64 [L] or [n, L] tensor");
    KeySource& ks = sets[s];
    ks.cache = c.data_ptr();
    ks.slots = sl.data_ptr<int64_t>();
    ks.shared = sl.dim() == 1;
    ks.length = sl.size(-1);
    if (masks[s].numel()) {
      TORCH_CHECK(masks[s].scalar_type() == torch::kBool && masks[s].is_contiguous() &&
                      masks[s].sizes() == torch::IntArrayRef({n, ks.length}),
                  "key set ", s, ": the mask must be a contiguous bool [n, L] tensor");
      ks.mask = masks[s].data_ptr<bool>();
    } else {
      TORCH_CHECK(visibles[s].scalar_type() == torch::kInt64 && visibles[s].is_contiguous() &&
                      visibles[s].dim() == 1 && visibles[s].size(0) == n,
                  "key set ", s, ": give a bool mask [n, L] or an int64 visible count [n]");
      ks.visible = visibles[s].data_ptr<int64_t>();
    }
    // Every slot a row may read must lie in the cache (a bad slot would read out of bounds).
    const int64_t cache_slots = c.size(0);
    const int64_t* sp = ks.slots;
    const int64_t count = sl.numel();
    for (int64_t i = 0; i < count; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < cache_slots, "key set ", s, ": slot ", sp[i], " is outside the cache (",
                  cache_slots, " slots)");
    ks.offset = ld;
    ld += (ks.length + kLanes - 1) / kLanes * kLanes;
  }
  auto out = torch::empty({n, H, D}, torch::kFloat32);
  const float* qp = q.data_ptr<float>();
  const float* sp = sinks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  if (dtype == at::kFloat8_e4m3fn)
    attend_rows<c10::Float8_e4m3fn>(sets, qp, sp, n, H, D, sc, ld, op);
  else if (dtype == at::kFloat8_e5m2)
    attend_rows<c10::Float8_e5m2>(sets, qp, sp, n, H, D, sc, ld, op);
  else
    attend_rows<float>(sets, qp, sp, n, H, D, sc, ld, op);
  return out;
}
