// Fused CPU ops for the decoder layers: what a decode step spends outside its weight stream.
//
// A decode step of a small model on the CPU is ~30 layers x ~60 small torch ops, each a few
// microseconds of dispatch and a fresh allocation, next to GEMVs that stream the weights. These
// kernels do in one pass what the torch code does in several:
//   skinny_linear  y = x W^T (+ b) for the rows of a decode step: each weight row is read from
//                  memory once for all rows of x; bfloat16 weights are widened in registers, so
//                  they stream half the bytes on CPUs without native bf16 compute (and need no
//                  float32 copy of the weight per call).
//   rms_norm       transformers' RMSNorm: float32 statistics, weight applied in the input dtype.
//   add_rms_norm   a residual add and the RMSNorm of its result (the decoder layer's
//                  `h = h + x; rms_norm(h)`), in one pass over the rows.
//   rotary         rotate-half RoPE of [T, heads, D] (rows may be strided, e.g. a view of qkv).
//   silu_and_mul   silu(gate) * up of a fused [T, 2I] gate_up projection.
//   hc_sinkhorn_   DeepSeek-V4's mHC Sinkhorn loop over [T, n, n] mixing matrices, in place.
//   argmax_rows    greedy sampling's argmax of each logits row (torch.max(dim).indices' answer).
// Each is held to the torch expression it replaces by tests/model_executor/test_fused_cpu_ops.py.
// exp_nonpositive and the vector helpers come from attention_backends/cpu_kernels/cpu_math.h,
// which the loader puts in front of this file. Built with -ffp-contract=off, so that a*b + c*d
// rounds as torch's separate ops do: rotary is then bit-identical to the torch expression, and
// the others differ only in summation order or in exp.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <type_traits>
#include <vector>

namespace {

using hybridkv_cpu::hsum;
using hybridkv_cpu::kLanes;
using hybridkv_cpu::vfloat;
using hybridkv_cpu::load_vec;
using hybridkv_cpu::to_float;
using hybridkv_cpu::round_vec;
using hybridkv_cpu::store_vec;

// ---- skinny_linear -------------------------------------------------------------------------

// Output columns [n0, n1) of y[M, N] = x[M, K] W[N, K]^T (+ b): R weight rows at a time, each
// loaded once and multiplied into all M rows of x (float32, widened once by the caller).
template <typename wt, int M, int R>
void linear_rows(const float* x, const wt* w, const float* b, float* y, int64_t n0, int64_t n1, int64_t K,
                 int64_t N) {
  const int64_t Kv = K / kLanes * kLanes;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    vfloat acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = vfloat{};
    for (int64_t k = 0; k < Kv; k += kLanes) {
      vfloat xv[M];
      for (int m = 0; m < M; ++m) xv[m] = load_vec(x + m * K + k);
      for (int r = 0; r < R; ++r) {
        const vfloat wv = load_vec(w + (n + r) * K + k);
        for (int m = 0; m < M; ++m) acc[r][m] += wv * xv[m];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        float s = hsum(acc[r][m]);
        for (int64_t k = Kv; k < K; ++k) s += x[m * K + k] * to_float(w[(n + r) * K + k]);
        y[m * N + n + r] = b ? s + b[n + r] : s;
      }
  }
  for (; n < n1; ++n)
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * to_float(w[n * K + k]);
      y[m * N + n] = b ? s + b[n] : s;
    }
}

// Rows per pass: enough independent weight streams to keep the loads in flight, few enough that
// R x M accumulators stay in registers.
template <typename wt, int M>
void linear_few(const float* x, const wt* w, const float* b, float* y, int64_t K, int64_t N) {
  constexpr int R = M == 1 ? 8 : (M == 2 ? 4 : 2);
  // Contiguous halves of the weight per thread (the hardware prefetcher follows each stream).
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { linear_rows<wt, M, R>(x, w, b, y, n0, n1, K, N); });
}

// More rows (a decode batch): per block of R weight rows, tiles of MB rows of x. The block is read
// from memory once; a bfloat16 block is first widened into a float32 buffer in L1, so that the
// widening is paid once per weight row, not once per tile.
template <typename wt>
void linear_many(const float* x, const wt* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
  constexpr int R = 2, MB = 4;
  at::parallel_for(0, (N + R - 1) / R, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> widened(std::is_same<wt, float>::value ? 0 : R * K);
    for (int64_t n = b0 * R; n < std::min(b1 * R, N); n += R) {  // weight rows outer: each read once
      const int64_t rows = std::min<int64_t>(R, N - n);
      const float* wr;
      if constexpr (std::is_same<wt, float>::value) {
        wr = w + n * K;
      } else {
        for (int64_t i = 0; i < rows * K; ++i) widened[i] = to_float(w[n * K + i]);
        wr = widened.data();
      }
      // rows n.. of y and b, addressed from 0 inside the call
      const float* bn = b ? b + n : nullptr;
      int64_t m = 0;
      for (; m + MB <= M; m += MB) linear_rows<float, MB, R>(x + m * K, wr, bn, y + m * N + n, 0, rows, K, N);
      for (; m < M; ++m) linear_rows<float, 1, R>(x + m * K, wr, bn, y + m * N + n, 0, rows, K, N);
    }
  });
}

template <typename wt>
void linear_dispatch(const float* x, const wt* w, const float* b, float* y, int64_t M, int64_t K, int64_t N) {
  switch (M) {
    case 1: return linear_few<wt, 1>(x, w, b, y, K, N);
    case 2: return linear_few<wt, 2>(x, w, b, y, K, N);
    case 3: return linear_few<wt, 3>(x, w, b, y, K, N);
    case 4: return linear_few<wt, 4>(x, w, b, y, K, N);
  }
  linear_many<wt>(x, w, b, y, M, K, N);
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear: x [M, K] and weight [N, K] must agree on K");
  TORCH_CHECK(weight.is_contiguous(), "skinny_linear: weight must be contiguous");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "skinny_linear: weight must be float32 or bfloat16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_linear: x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const auto xf = x.to(at::kFloat).contiguous();  // a no-op for float32 input
  c10::optional<torch::Tensor> bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "skinny_linear: bias must have N entries");
    bf = bias->to(at::kFloat).contiguous();
  }
  auto y = torch::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y.to(x.scalar_type());
  const float* b = bf.has_value() ? bf->data_ptr<float>() : nullptr;
  if (weight.scalar_type() == at::kBFloat16)
    linear_dispatch(xf.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), b, y.data_ptr<float>(), M, K, N);
  else
    linear_dispatch(xf.data_ptr<float>(), weight.data_ptr<float>(), b, y.data_ptr<float>(), M, K, N);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// ---- rms_norm --------------------------------------------------------------------------------

namespace {
// sum_d x[d]^2 in float32, in one fixed order (lane partial sums, then across the lanes), so that
// rms_norm and add_rms_norm give the same bits for the same row (an omp simd reduction's order
// could differ between the two loops' compilations).
template <typename scalar_t>
inline float sum_of_squares(const scalar_t* x, int64_t D) {
  vfloat acc = {};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    const vfloat v = load_vec(x + d);
    acc += v * v;
  }
  float ss = hsum(acc);
  for (; d < D; ++d) ss += to_float(x[d]) * to_float(x[d]);
  return ss;
}

// With `addend` (and `sum`), row r is first sum[r] = x[r] + addend[r], rounded to the dtype as
// torch's add rounds it, and the norm is taken of that rounded sum: bit-identical to the add
// followed by rms_norm, without writing the sum and reading it back in a second pass.
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t x_stride, const scalar_t* w, scalar_t* out, int64_t rows, int64_t D,
                   float eps, bool unit_offset, const scalar_t* addend = nullptr, scalar_t* sum = nullptr) {
  at::parallel_for(0, rows, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const scalar_t* xr = x + r * x_stride;
      scalar_t* o = out + r * D;
      if (addend != nullptr) {
        scalar_t* sr = sum + r * D;
        const scalar_t* ar = addend + r * D;
        int64_t d = 0;
        // Lane-parallel rounding (store_vec): c10::BFloat16's scalar conversion keeps the loop
        // from vectorizing (Intel AMX VM, 1,024 x 576 bf16 rows: ~500 us for the whole op, against
        // ~200 for torch's add and rms_norm).
        for (; d + kLanes <= D; d += kLanes) store_vec(sr + d, load_vec(xr + d) + load_vec(ar + d));
        for (; d < D; ++d) sr[d] = static_cast<scalar_t>(to_float(xr[d]) + to_float(ar[d]));
        xr = sr;
      }
      const float inv = 1.f / std::sqrt(sum_of_squares(xr, D) / static_cast<float>(D) + eps);
      if (unit_offset) {  // Gemma: (h * (1 + w)) in float32, then the input dtype
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(to_float(xr[d]) * inv * (1.f + to_float(w[d])));
      } else {  // weight * h.to(dtype): h rounded to the input dtype first, as transformers does
        for (int64_t d = 0; d < D; ++d) {
          const scalar_t h = static_cast<scalar_t>(to_float(xr[d]) * inv);
          o[d] = static_cast<scalar_t>(to_float(w[d]) * to_float(h));
        }
      }
    }
  });
}

// f(scalar_t{}) for the dtypes these ops take (float32, bfloat16): one dispatch for all of them.
template <typename F>
void for_fused_dtype(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat)
    f(float{});
  else if (dtype == at::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, op, " takes float32 or bfloat16, not ", dtype);
}
}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool unit_offset) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "rms_norm: weight must be [", D, "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
  TORCH_CHECK(x.stride(-1) == 1 && weight.is_contiguous(), "rms_norm: the last dim must be contiguous");
  // Rows of a 2-D view (a strided slice of a wider tensor is fine: one row stride).
  const auto x2 = x.dim() == 2 || x.is_contiguous() ? x.reshape({-1, D}) : x.contiguous().view({-1, D});
  auto out = torch::empty(x.sizes(), x.options());
  for_fused_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(x2.data_ptr<scalar_t>(), x2.stride(0), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x2.size(0), D, static_cast<float>(eps), unit_offset);
  });
  return out;
}

// x + residual and the RMSNorm of it: (sum, normed), both new tensors of x's shape.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps,
                                        bool unit_offset) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "add_rms_norm: weight must be [", D, "]");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x ", x.sizes(), " and residual ", residual.sizes(),
              " differ in shape");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x, residual and weight must share a dtype");
  TORCH_CHECK(weight.is_contiguous(), "add_rms_norm: weight must be contiguous");
  const auto x2 = x.contiguous().view({-1, D});
  const auto r2 = residual.contiguous().view({-1, D});
  auto sum = torch::empty(x.sizes(), x.options());
  auto out = torch::empty(x.sizes(), x.options());
  for_fused_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(x2.data_ptr<scalar_t>(), D, weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x2.size(0), D, static_cast<float>(eps), unit_offset, r2.data_ptr<scalar_t>(),
                            sum.data_ptr<scalar_t>());
  });
  return {sum, out};
}

// ---- rotary ----------------------------------------------------------------------------------

namespace {
// One rounding to the tensor's dtype, as each torch op does (a no-op in float32).
template <typename scalar_t>
inline float round_to(float v) { return static_cast<float>(static_cast<scalar_t>(v)); }

template <typename scalar_t>
void rotary_rows(const scalar_t* xp, int64_t xs, const scalar_t* cp, const scalar_t* sp, scalar_t* op, int64_t T,
                 int64_t H, int64_t D) {
  const int64_t half = D / 2;
  // Whole vectors per half when they fit (D 64 and 128 with 8 or 16 lanes): the two halves in
  // one pass, rounded lane-parallel (round_vec / store_vec). The scalar loop below, with its
  // c10::BFloat16 conversions, takes 209-226 us for 1,024 tokens x 12 heads x 64 in bf16 against
  // 172-178 (float32: 131-139 against 123-127; Intel AMX VM, alternating runs).
  const int64_t vec_half = half % kLanes == 0 ? half : 0;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* xr = xp + t * xs + h * D;
        const scalar_t* c = cp + t * D;
        const scalar_t* s = sp + t * D;
        scalar_t* o = op + (t * H + h) * D;
        for (int64_t d = 0; d < vec_half; d += kLanes) {
          const vfloat lo = load_vec(xr + d), hi = load_vec(xr + d + half);
          // o[d] = x[d] cos[d] - x[d + half] sin[d]; o[d + half] = x[d + half] cos[d + half] + x[d] sin[d + half]
          store_vec(o + d, round_vec<scalar_t>(lo * load_vec(c + d)) + round_vec<scalar_t>(-hi * load_vec(s + d)));
          store_vec(o + d + half, round_vec<scalar_t>(hi * load_vec(c + d + half)) +
                                      round_vec<scalar_t>(lo * load_vec(s + d + half)));
        }
        if (vec_half) continue;
        for (int64_t d = 0; d < D; ++d) {
          const float rotated = d < half ? -to_float(xr[d + half]) : to_float(xr[d - half]);
          const float a = round_to<scalar_t>(to_float(xr[d]) * to_float(c[d]));
          const float b = round_to<scalar_t>(rotated * to_float(s[d]));
          o[d] = static_cast<scalar_t>(a + b);
        }
      }
  });
}
}  // namespace

// out = x * cos + rotate_half(x) * sin for x [T, H, D] (row stride free, heads and D contiguous),
// cos/sin [T, 1, D] contiguous; each product rounded before the sum, as the torch expression does.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: x must be [T, H, D] with "
              "contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0, "rotary: odd head size");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rotary: cos and sin must be contiguous [T, 1, D]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos, sin and x must share a dtype");
  auto out = torch::empty({T, H, D}, x.options());
  AT_DISPATCH_SWITCH(x.scalar_type(), "rotary",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      rotary_rows<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(),
                         out.data_ptr<float>(), T, H, D);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rotary_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0), cos.data_ptr<c10::BFloat16>(),
                                 sin.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), T, H, D);
    }));
  return out;
}

// ---- silu_and_mul ----------------------------------------------------------------------------

namespace {
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* g, scalar_t* o, int64_t T, int64_t I) {
  // Tiles of kTile columns: widened to float with vector loads, the sigmoid in a float loop that
  // vectorizes, rounded and stored with vector stores (round_vec / store_vec, cpu_math.h): a
  // scalar c10::BFloat16 conversion in the loop kept it scalar, 7.7 ms for 1,024 x 1,536 on the
  // Intel VM against ~0.8 ms in float32.
  constexpr int64_t kTile = 16 * kLanes;
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    alignas(64) float gate[kTile], silu[kTile];
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* gr = g + t * 2 * I;
      const scalar_t* ur = gr + I;
      scalar_t* orow = o + t * I;
      for (int64_t i0 = 0; i0 < I; i0 += kTile) {
        const int64_t n = std::min(kTile, I - i0);
        const int64_t nv = n / kLanes * kLanes;
        for (int64_t i = 0; i < nv; i += kLanes) store_vec(gate + i, load_vec(gr + i0 + i));
        for (int64_t i = nv; i < n; ++i) gate[i] = to_float(gr[i0 + i]);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          // sigmoid from exp(-|x|) <= 1, so it never overflows: 1/(1+e) for x >= 0, e/(1+e) below
          const float x = gate[i];
          const float e = hybridkv_cpu::exp_nonpositive(-std::fabs(x));
          silu[i] = x * ((x >= 0.f ? 1.f : e) / (1.f + e));
        }
        // silu rounded to the dtype, then the product: torch's silu(gate) * up
        for (int64_t i = 0; i < nv; i += kLanes)
          store_vec(orow + i0 + i, round_vec<scalar_t>(load_vec(silu + i)) * load_vec(ur + i0 + i));
        for (int64_t i = nv; i < n; ++i)
          orow[i0 + i] = static_cast<scalar_t>(round_to<scalar_t>(silu[i]) * to_float(ur[i0 + i]));
      }
    }
  });
}
}  // namespace

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up must be a contiguous [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_and_mul",
    AT_DISPATCH_CASE(at::kFloat, [&] { silu_and_mul_rows<float>(gate_up.data_ptr<float>(), out.data_ptr<float>(), T, I); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      silu_and_mul_rows<c10::BFloat16>(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), T, I);
    }));
  return out;
}

// ---- hc_sinkhorn_ -----------------------------------------------------------------------------
// mHC's Sinkhorn normalisation of comb [T, n, n] (float32) in place, as mhc.py does it: divide
// every column by its sum + eps, then iters - 1 times every row and every column. In torch that is
// 3 x iters ops over the whole [T, n, n] per sublayer (~120 for V4's 20 iterations), each a pass
// over memory plus dispatch; here each token's matrix stays in L1 through all the iterations.
torch::Tensor hc_sinkhorn_(torch::Tensor comb, int64_t iters, double eps) {
  TORCH_CHECK(comb.dim() == 3 && comb.size(1) == comb.size(2) && comb.scalar_type() == torch::kFloat32 &&
                  comb.is_contiguous(), "hc_sinkhorn_: comb must be a contiguous float32 [T, n, n] tensor");
  const int64_t T = comb.size(0), n = comb.size(1);
  const float e = static_cast<float>(eps);
  float* p = comb.data_ptr<float>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    std::vector<float> col(n);
    for (int64_t t = t0; t < t1; ++t) {
      float* m = p + t * n * n;
      auto columns = [&] {  // sum over the first axis (torch's dim=-2), then + eps, then divide
        for (int64_t j = 0; j < n; ++j) col[j] = m[j];
        for (int64_t i = 1; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) col[j] += m[i * n + j];
        for (int64_t j = 0; j < n; ++j) col[j] += e;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) m[i * n + j] /= col[j];
      };
      columns();
      for (int64_t it = 1; it < iters; ++it) {
        for (int64_t i = 0; i < n; ++i) {
          float s = m[i * n];
          for (int64_t j = 1; j < n; ++j) s += m[i * n + j];
          s += e;
          for (int64_t j = 0; j < n; ++j) m[i * n + j] /= s;
        }
        columns();
      }
    }
  });
  return comb;
}

// ---- argmax_rows -------------------------------------------------------------------------------
// The index of each row's largest value, the first one on ties, and the first NaN in a row that
// has one: what torch.max(x, dim=-1).indices returns. On the CPU that op is a scalar loop (2-core
// Zen 4: 47 us for one 49,152-entry logits row, 1.1 ms for 32 rows, against amax's 5.7 / 44 us):
// greedy sampling paid more for it than for the sampled logits' own matrix in a b-sized batch.
// One pass over the row in blocks small enough to stay in L1: each block's maximum (and whether
// it holds a NaN), vectorised; the first block with a strictly larger maximum than all before it
// holds the first occurrence of the row's maximum, and only that block is scanned again (or the
// first block with a NaN, where the pass stops). Logits of a 32-row batch do not fit in L2, so a
// second pass over the whole row would read them from memory again.
namespace {
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  constexpr int64_t kBlock = 2048;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_block = 0;
  bool nan = false;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    float m = -std::numeric_limits<float>::infinity();
    int has_nan = 0;
#pragma omp simd reduction(max : m) reduction(| : has_nan)
    for (int64_t i = b; i < e; ++i) {
      const float v = to_float(x[i]);
      m = v > m ? v : m;
      has_nan |= v != v;
    }
    if (has_nan) {
      best_block = b;
      nan = true;
      break;
    }
    if (m > best) {  // strictly: on a tie the earlier block keeps the first occurrence
      best = m;
      best_block = b;
    }
  }
  const int64_t e = std::min(n, best_block + kBlock);
  for (int64_t i = best_block; i < e; ++i) {  // -0 == +0: a tie, as in torch
    const float v = to_float(x[i]);
    if (nan ? v != v : v == best) return i;
  }
  return best_block;  // a row of -inf only: its first entry (best stays -inf, block 0)
}
}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [rows, n] with n > 0");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for_fused_dtype(x.scalar_type(), "argmax_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* p = xc.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(p + r * n, n);
    });
  });
  return out;
}

// The fused ops' addresses by name, for decode_layers.cpp (see blocked_linear.cpp's).
std::unordered_map<std::string, int64_t> kernel_addresses() {
  return {{"rms_norm", reinterpret_cast<int64_t>(&rms_norm)},
          {"add_rms_norm", reinterpret_cast<int64_t>(&add_rms_norm)},
          {"rotary", reinterpret_cast<int64_t>(&rotary)},
          {"silu_and_mul", reinterpret_cast<int64_t>(&silu_and_mul)},
          {"argmax_rows", reinterpret_cast<int64_t>(&argmax_rows)}};
}
