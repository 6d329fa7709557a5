// The call shared by the paged kernels (paged_attention.cpp, prefill_attention.cpp): query rows in
// groups at consecutive positions of one sequence each, K/V read in place through the group's
// block-table row. The loader puts this file in front of those kernels (after cpu_math.h).
#pragma once
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)

#include <algorithm>
#include <cstdint>

namespace hybridkv_cpu {

// Whether a cache of this dtype holds FP8 bytes the kernels widen as they read them
// (kv_cache_dtype "fp8" / "fp8_e5m2"; attention_backends/kv_cache_dtype.py).
inline bool is_fp8_cache(c10::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// The arguments' shapes, dtypes and layouts, checked once for either kernel. The caches hold q's
// dtype, or both one FP8 format (then q must be float32 or bfloat16).
inline void check_paged_groups(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& block_table, const torch::Tensor& group_start,
                               const torch::Tensor& group_row, const torch::Tensor& positions) {
  // q may be a view with gaps between rows or heads (e.g. the query part of a fused QKV output), so
  // callers need not copy it; only each head's D values must be contiguous.
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be a [T, H, D] tensor with contiguous head rows");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3, "caches must be [Hkv, slots, D]");
  TORCH_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "cache rows must be contiguous");
  const bool fp8 = is_fp8_cache(k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "q, k_cache and v_cache must share a dtype (or the caches one FP8 format)");
  TORCH_CHECK(!fp8 || q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "an FP8 cache is read with float32 or bfloat16 queries");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(2) == v_cache.size(2), "head sizes differ");
  for (const auto* t : {&block_table, &group_start, &group_row, &positions})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous(), "index tensors must be contiguous int32");
  TORCH_CHECK(group_start.size(0) == group_row.size(0) + 1, "group_start must have one entry more than group_row");
  TORCH_CHECK(positions.size(0) == q.size(0), "one position per query row");
  // The groups must cover q's rows exactly and name rows of the block table: the kernels index
  // q, out and the table with them unchecked (a caller's slip would write past the output).
  const int32_t* gs = group_start.data_ptr<int32_t>();
  const int32_t* gr = group_row.data_ptr<int32_t>();
  const int64_t G = group_row.size(0);
  TORCH_CHECK(gs[0] == 0 && gs[G] == q.size(0), "group_start must run from 0 to q's ", q.size(0), " rows");
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(gs[g] <= gs[g + 1], "group_start must not decrease");
    TORCH_CHECK(gr[g] >= 0 && gr[g] < block_table.size(0), "group_row ", gr[g], " is not a row of the block table");
  }
}

// The same arguments as raw pointers, strides and sizes, for the kernels' loops. cache_t: the
// caches' element type (scalar_t, or an FP8 type the kernels widen to float as they load it).
template <typename scalar_t, typename cache_t = scalar_t>
struct PagedGroups {
  int64_t H, D, Hkv, grp, G;           // query heads, head size, KV heads, query heads per KV head, groups
  const scalar_t* qp;
  int64_t q_row, q_head;               // q strides: per query row, per head (out is contiguous)
  scalar_t* op;
  const cache_t *kp, *vp;
  int64_t kh, ks, vh, vs;              // cache strides: per KV head, per slot
  const int32_t* bt;
  int64_t bt_stride, bt_width;
  const int32_t *gs, *gr, *pos;        // group_start, group_row, positions
  int64_t page_size, window;
  float fscale;

  PagedGroups(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const torch::Tensor& block_table, const torch::Tensor& group_start, const torch::Tensor& group_row,
              const torch::Tensor& positions, int64_t page_size_, int64_t window_, double scale)
      : H(q.size(1)), D(q.size(2)), Hkv(k_cache.size(0)), grp(q.size(1) / k_cache.size(0)), G(group_row.size(0)),
        qp(q.data_ptr<scalar_t>()), q_row(q.stride(0)), q_head(q.stride(1)), op(out.data_ptr<scalar_t>()),
        kp(static_cast<const cache_t*>(k_cache.data_ptr())),
        vp(static_cast<const cache_t*>(v_cache.data_ptr())), kh(k_cache.stride(0)), ks(k_cache.stride(1)),
        vh(v_cache.stride(0)),
        vs(v_cache.stride(1)), bt(block_table.data_ptr<int32_t>()), bt_stride(block_table.stride(0)),
        bt_width(block_table.size(1)), gs(group_start.data_ptr<int32_t>()), gr(group_row.data_ptr<int32_t>()),
        pos(positions.data_ptr<int32_t>()), page_size(page_size_), window(window_), fscale(static_cast<float>(scale)) {}

  // Query row r's head `head`.
  const scalar_t* query(int64_t r, int64_t head) const { return qp + r * q_row + head * q_head; }

  // First position a query at position p sees (window < 0: no window).
  int64_t window_start(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
};

}  // namespace hybridkv_cpu
