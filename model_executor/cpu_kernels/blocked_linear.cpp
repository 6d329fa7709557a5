// y = x W^T (+ b) in float32 on the CPU from a weight laid out in column blocks, for any row count.
//
// Layout: W [N, K] becomes [ceil(N / 16), K, 16]: block j holds output columns 16j .. 16j + 15,
// k-major, zero-padded past N. A register block of MR rows of x by CB column blocks keeps MR x CB
// vectors of accumulators; each step of k loads CB vectors of weights (consecutive in memory, one
// stream per block) and broadcasts MR elements of x, then does MR x CB FMAs. No horizontal sums,
// and every weight element is read once per tile of up to kRowBlock rows. Work items are (row
// tile, group of CB column blocks), row tile outer, so a thread's consecutive items reuse the same
// rows of x from its cache while the weights stream.
//
// Why not oneDNN's packed linear (what PackedLinearWeight calls): on the Intel AMX VM (AVX-512,
// 2 threads), the demo model's four projections x 30 layers with weights from memory took, per
// step of M rows, oneDNN / this kernel: M=1 28 / 18 ms, 4: 30 / 20, 8: 36 / 22, 16: 40 / 31,
// 32: 54 / 41, 64: 89 / 64, 128: 132 / 111, 1,024: 840 / 862. Decode steps are where oneDNN was
// far from both limits (32 rows: 127 GFLOP/s, weights at 5 GB/s).
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>

namespace {

using hybridkv_cpu::kLanes;  // cpu_math.h, put in front of this file by the loader
using hybridkv_cpu::load_vec;
using hybridkv_cpu::splat;
using hybridkv_cpu::store_vec;
using hybridkv_cpu::vfloat;

constexpr int64_t kBlockCols = 16;              // output columns per weight block
constexpr int kBlockVecs = kBlockCols / kLanes;  // vectors per block row (1 with AVX-512, 2 with AVX2)
constexpr int kMR = kLanes == 16 ? 8 : 6;        // rows of x per register block
constexpr int kCB = kLanes == 16 ? 3 : 1;        // column blocks per register block
constexpr int64_t kRowBlock = 256;               // rows of x per work item (its slice of x stays in L2)

// y[0 .. MR) [n0 .. n0 + CB * 16) for rows x[0 .. MR): cols (<= CB * 16) of them are real columns;
// a partial last block goes through a stack buffer so nothing past column N is written.
template <int MR, int CB>
inline void tile(const float* __restrict__ x, int64_t K, const float* __restrict__ w, int64_t block_stride,
                 const float* __restrict__ bias, float* __restrict__ y, int64_t ldy, int64_t n0, int64_t cols) {
  constexpr int V = CB * kBlockVecs;
  vfloat acc[MR][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    vfloat wv[V];
    for (int c = 0; c < CB; ++c)
      for (int v = 0; v < kBlockVecs; ++v) wv[c * kBlockVecs + v] = load_vec(w + c * block_stride + k * kBlockCols + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const vfloat xb = splat(x[m * K + k]);
      for (int j = 0; j < V; ++j) acc[m][j] += xb * wv[j];
    }
  }
  if (bias)  // bias is padded to whole blocks by the caller
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < V; ++j) acc[m][j] += load_vec(bias + n0 + j * kLanes);
  for (int m = 0; m < MR; ++m) {
    if (cols == CB * kBlockCols) {
      for (int j = 0; j < V; ++j) store_vec(y + m * ldy + n0 + j * kLanes, acc[m][j]);
    } else {
      float row[CB * kBlockCols];
      for (int j = 0; j < V; ++j) store_vec(row + j * kLanes, acc[m][j]);
      std::memcpy(y + m * ldy + n0, row, sizeof(float) * cols);
    }
  }
}

// Rows [0, M) of x against one register group of column blocks: kMR rows at a time, then the
// remainder. Tile::run<MR>(x, ...) multiplies MR rows: FloatTile<CB> here, Bf16Tile<CB> below.
template <class Tile, typename T>
void rows(const T* x, int64_t M, int64_t K, const T* w, int64_t block_stride, const float* bias, T* y, int64_t ldy,
          int64_t n0, int64_t cols) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR)
    Tile::template run<kMR>(x + m * K, K, w, block_stride, bias, y + m * ldy, ldy, n0, cols);
  const T* xm = x + m * K;
  T* ym = y + m * ldy;
  switch (M - m) {
    case 1: return Tile::template run<1>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
    case 2: return Tile::template run<2>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
    case 3: return Tile::template run<3>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
    case 4: return Tile::template run<4>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
    case 5: return Tile::template run<5>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
    case 6: return Tile::template run<6>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
    case 7: return Tile::template run<7>(xm, K, w, block_stride, bias, ym, ldy, n0, cols);
  }
  static_assert(kMR <= 8, "the remainder switch covers kMR - 1 rows");
}

template <int CB>
struct FloatTile {
  template <int MR>
  static void run(const float* x, int64_t K, const float* w, int64_t block_stride, const float* bias, float* y,
                  int64_t ldy, int64_t n0, int64_t cols) {
    tile<MR, CB>(x, K, w, block_stride, bias, y, ldy, n0, cols);
  }
};

// Every kernel's work items: (row tile, column item) for `items` column items, row tile outer, so a
// thread's consecutive items reuse the same rows of x from its cache while the weights stream.
// Row tiles are of equal size (at most kRowBlock): 300 rows are two tiles of 150, not 256 + 44.
// fn(m0, rows, item) runs one.
template <typename Fn>
void for_each_tile(int64_t M, int64_t items, Fn fn) {
  const int64_t row_tiles = (M + kRowBlock - 1) / kRowBlock;
  const int64_t tile_rows = (M + row_tiles - 1) / row_tiles;
  at::parallel_for(0, row_tiles * items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m0 = i / items * tile_rows;
      fn(m0, std::min<int64_t>(tile_rows, M - m0), i % items);
    }
  });
}

// The work items of either dtype's linear: (row tile, group of kCB column blocks); full(x, rows,
// w, y, n0, cols) takes a whole group, one(...) the last, narrower group's blocks one at a time.
// A block is K * kBlockCols elements in either layout.
template <typename T, typename Full, typename One>
void for_each_item(const T* xp, int64_t M, int64_t K, const T* w, int64_t blocks, T* yp, int64_t N, Full full,
                   One one) {
  const int64_t stride = K * kBlockCols;
  for_each_tile(M, (blocks + kCB - 1) / kCB, [&](int64_t m0, int64_t mr, int64_t group) {
    const int64_t c0 = group * kCB, cb = std::min<int64_t>(kCB, blocks - c0);
    if (cb == kCB) {
      full(xp + m0 * K, mr, w + c0 * stride, yp + m0 * N, c0 * kBlockCols,
           std::min<int64_t>(kCB * kBlockCols, N - c0 * kBlockCols));
    } else {
      for (int64_t c = c0; c < c0 + cb; ++c)
        one(xp + m0 * K, mr, w + c * stride, yp + m0 * N, c * kBlockCols,
            std::min<int64_t>(kBlockCols, N - c * kBlockCols));
    }
  });
}

// The bias of a fused gate/up call (float32 with N entries, the gate's then the up's), or nullptr.
const float* gate_up_bias(const c10::optional<torch::Tensor>& bias, int64_t N, const char* name) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, name,
              ": bias must be float32 with N entries");
  return bias->data_ptr<float>();
}

// A linear call's checked operands: x made contiguous (held here so the pointers stay valid), its
// M and K, the packed weight's block count, and the raw pointers the tiles read (T is float, or
// uint16_t for bfloat16).
template <typename T>
struct Operands {
  torch::Tensor x;
  int64_t M, K, blocks;
  const T* xp;
  const T* w;
};

// x [M, K] float32 and a pack_blocked_linear weight [blocks, K, 16] of the same K.
Operands<float> float_operands(const torch::Tensor& x, const torch::Tensor& packed, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(2) == kBlockCols && packed.size(1) == x.size(1),
              name, ": packed must be a pack_blocked_linear weight of x's K");
  auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  return {xc, x.size(0), x.size(1), packed.size(0), xp, packed.data_ptr<float>()};
}

// x [M, K] bfloat16 and a pack_interleaved_linear_bf16 weight [blocks, K * 16] of the same K.
Operands<uint16_t> bf16_operands(const torch::Tensor& x, const torch::Tensor& packed, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) * kBlockCols,
              name, ": packed must be a pack_interleaved_linear_bf16 weight of x's K");
  auto xc = x.contiguous();
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  return {xc, x.size(0), x.size(1), packed.size(0), xp,
          reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>())};
}

// The bias of a plain linear of N outputs over `blocks` column blocks (float32 padded to whole
// blocks, zero past N), or nullptr; also checks that N fills the last block at least in part.
const float* block_bias(const c10::optional<torch::Tensor>& bias, int64_t N, int64_t blocks, const char* name) {
  TORCH_CHECK(N > (blocks - 1) * kBlockCols && N <= blocks * kBlockCols, name, ": N does not match the blocks");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks * kBlockCols,
              name, ": bias must be float32 padded to whole blocks");
  return bias->data_ptr<float>();
}

}  // namespace

// W [N, K] float32 -> [ceil(N / 16), K, 16], zero-padded past N.
torch::Tensor pack_blocked_linear(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack_blocked_linear: weight must be [N, K] float32");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlockCols - 1) / kBlockCols;
  auto packed = torch::zeros({blocks, K, kBlockCols}, weight.options());
  const auto w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < std::min<int64_t>(kBlockCols, N - b * kBlockCols); ++c)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * kBlockCols + c] = src[(b * kBlockCols + c) * K + k];
  });
  return packed;
}

// x [M, K] float32 against a pack_blocked_linear weight of N output columns; bias, when given,
// float32 with blocks * 16 entries (zero past N). Returns [M, N].
torch::Tensor blocked_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  const auto op = float_operands(x, packed, "blocked_linear");
  const int64_t K = op.K, M = op.M;
  const float* b = block_bias(bias, N, op.blocks, "blocked_linear");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  float* yp = y.data_ptr<float>();
  const int64_t stride = K * kBlockCols;  // floats per block
  for_each_item(
      op.xp, M, K, op.w, op.blocks, yp, N,
      [&](const float* x, int64_t mr, const float* wb, float* yr, int64_t n0, int64_t cols) {
        rows<FloatTile<kCB>>(x, mr, K, wb, stride, b, yr, N, n0, cols);
      },
      [&](const float* x, int64_t mr, const float* wb, float* yr, int64_t n0, int64_t cols) {
        rows<FloatTile<1>>(x, mr, K, wb, stride, b, yr, N, n0, cols);
      });
  return y;
}

// ---- silu(gate) * up of a float32 gate/up projection, from the same column blocks -------------
//
// A gate/up projection [gate; up] of 2I outputs (I a whole number of blocks: the gate is blocks
// [0, I / 16), the up half the blocks after) followed by SiLU x mul, in one pass: a register block
// of kSiluRows rows x (two gate blocks + the two up blocks I / 16 further on) is multiplied as
// above and its 32 outputs silu(gate) * up go straight to y [M, I]. The [M, 2I] projection is never
// written and re-read. Each sum is the same FMA chain over k as blocked_linear's and silu16 is
// fused_ops' silu_and_mul operation for operation, so the result is bit for bit
// silu_and_mul(blocked_linear(x)). 2-core Zen 4, the demo model's 576 -> 2 x 1,536, ms, unfused /
// fused: 1,024 rows 19.0-19.2 / 17.4-17.6, 180 rows 3.0-3.5 / 2.9-3.2 (the tile's prototype, before
// the remainder switch; full-row blocks are the same code).
namespace {
#if defined(__AVX512F__)
constexpr int kSiluRows = 6;  // 6 rows x 4 blocks = 24 accumulators, as tile<8, 3>

// y[0 .. MR) [n0 .. n0 + NB * 16) = silu(x wg^T + bias_g) * (x wu^T + bias_u) for NB (1 or 2) gate
// blocks at wg and their up blocks at wu; cols (<= NB * 16) of them are real outputs.
template <int MR, int NB>
inline void silu_tile(const float* __restrict__ x, int64_t K, const float* __restrict__ wg,
                      const float* __restrict__ wu, int64_t block_stride, const float* bias_g, const float* bias_u,
                      float* __restrict__ y, int64_t ldy, int64_t n0, int64_t cols) {
  vfloat acc[MR][2 * NB] = {};
  for (int64_t k = 0; k < K; ++k) {
    vfloat wv[2 * NB];
    for (int c = 0; c < NB; ++c) {
      wv[c] = load_vec(wg + c * block_stride + k * kBlockCols);
      wv[NB + c] = load_vec(wu + c * block_stride + k * kBlockCols);
    }
    for (int m = 0; m < MR; ++m) {
      const vfloat xb = splat(x[m * K + k]);
      for (int j = 0; j < 2 * NB; ++j) acc[m][j] += xb * wv[j];
    }
  }
  for (int m = 0; m < MR; ++m) {
    float row[NB * kBlockCols];
    for (int c = 0; c < NB; ++c) {
      vfloat g = acc[m][c], u = acc[m][NB + c];
      if (bias_g) {
        g += load_vec(bias_g + n0 + c * kBlockCols);
        u += load_vec(bias_u + n0 + c * kBlockCols);
      }
      store_vec(row + c * kBlockCols, _mm512_mul_ps(hybridkv_cpu::silu16(g), u));
    }
    std::memcpy(y + m * ldy + n0, row, sizeof(float) * cols);
  }
}

// Rows [0, M) against NB gate blocks: kSiluRows at a time, then the remainder.
template <int NB>
void silu_rows(const float* x, int64_t M, int64_t K, const float* wg, const float* wu, int64_t block_stride,
               const float* bias_g, const float* bias_u, float* y, int64_t ldy, int64_t n0, int64_t cols) {
  int64_t m = 0;
  for (; m + kSiluRows <= M; m += kSiluRows)
    silu_tile<kSiluRows, NB>(x + m * K, K, wg, wu, block_stride, bias_g, bias_u, y + m * ldy, ldy, n0, cols);
  const float* xm = x + m * K;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 1: return silu_tile<1, NB>(xm, K, wg, wu, block_stride, bias_g, bias_u, ym, ldy, n0, cols);
    case 2: return silu_tile<2, NB>(xm, K, wg, wu, block_stride, bias_g, bias_u, ym, ldy, n0, cols);
    case 3: return silu_tile<3, NB>(xm, K, wg, wu, block_stride, bias_g, bias_u, ym, ldy, n0, cols);
    case 4: return silu_tile<4, NB>(xm, K, wg, wu, block_stride, bias_g, bias_u, ym, ldy, n0, cols);
    case 5: return silu_tile<5, NB>(xm, K, wg, wu, block_stride, bias_g, bias_u, ym, ldy, n0, cols);
  }
  static_assert(kSiluRows == 6, "the remainder switch covers kSiluRows - 1 rows");
}
#endif
}  // namespace

// Whether this build has blocked_linear_silu_mul (AVX-512: silu16 is written for 16 lanes).
bool blocked_silu_mul_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// silu(gate) * up of x [M, K] float32 against a pack_blocked_linear weight of a [gate; up]
// projection of N = 2I outputs, I a multiple of 16; bias as blocked_linear's. Returns [M, I].
torch::Tensor blocked_linear_silu_mul(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                      int64_t N) {
  TORCH_CHECK(blocked_silu_mul_available(), "blocked_linear_silu_mul needs an AVX-512 build");
  const auto op = float_operands(x, packed, "blocked_linear_silu_mul");
  const int64_t blocks = op.blocks, K = op.K, M = op.M, I = N / 2;
  TORCH_CHECK(N % (2 * kBlockCols) == 0 && blocks * kBlockCols == N,
              "blocked_linear_silu_mul: N must be twice a multiple of 16 and match the blocks");
  const float* b = gate_up_bias(bias, N, "blocked_linear_silu_mul");
  auto y = torch::empty({M, I}, x.options());
#if defined(__AVX512F__)
  if (M == 0) return y;
  const float* xp = op.xp;
  const float* w = op.w;
  float* yp = y.data_ptr<float>();
  const int64_t stride = K * kBlockCols, half = blocks / 2;
  const float* bias_up = b == nullptr ? nullptr : b + I;
  // Work items (row tile, pair of gate blocks); the last pair has one block when the half is odd.
  for_each_tile(M, (half + 1) / 2, [&](int64_t m0, int64_t mr, int64_t pair) {
    const int64_t c = pair * 2, n0 = c * kBlockCols;
    const float* wg = w + c * stride;
    const float* wu = wg + half * stride;
    if (c + 2 <= half)
      silu_rows<2>(xp + m0 * K, mr, K, wg, wu, stride, b, bias_up, yp + m0 * I, I, n0, 2 * kBlockCols);
    else
      silu_rows<1>(xp + m0 * K, mr, K, wg, wu, stride, b, bias_up, yp + m0 * I, I, n0, kBlockCols);
  });
#endif
  return y;
}

// ---- bfloat16 on AVX512-BF16 (vdpbf16ps) ---------------------------------------------------------
//
// The same column blocks for a bf16 weight, with k taken in pairs: [ceil(N / 16), K / 2, 16, 2]
// (pack_blocked_linear_bf16; the layout amx_linear.cpp reads). One 64-byte row of a block holds 16
// columns x 2 consecutive k, the operand vdpbf16ps multiplies against a broadcast pair of x
// (x[m][k], x[m][k + 1]) and adds into 16 float32 column sums. The products of bf16 values are
// exact and the sums are float32, as in oneDNN's bf16 linear; the result is rounded to bf16 once.
// For decode-sized row counts, where oneDNN's bf16 linear streams the weights at ~14 GB/s of this
// VM's ~25 (see layers.BLOCKED_MAX_ROWS_BF16).
//
// This kernel reads the blocks interleaved (pack_interleaved_linear_bf16): each group of kCB
// blocks that one work item multiplies is stored k-pair-major, [K / 2, kCB, 16, 2], so the item
// streams one contiguous run instead of kCB runs K * 32 bytes apart; the last, narrower group is
// interleaved among its own blocks. The products and their order are unchanged, so are the bits.
// 2-core Zen 4, the demo model's projections x 30 layers at one row, weights on huge pages, GB/s
// read, eight alternating runs in one process: kCB runs 26.8-32.3, one run 35.6-38.9 (a read probe
// beside them: 48-58).
namespace {

#if defined(__AVX512F__)
template <int MR, int CB, int G = CB>  // CB blocks of a run of G interleaved ones (CB < G: the first CB)
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) inline void tile_bf16(
    const uint16_t* __restrict__ x, int64_t K, const uint16_t* __restrict__ w, int64_t block_stride,
    const float* __restrict__ bias, uint16_t* __restrict__ y, int64_t ldy, int64_t n0, int64_t cols) {
  // w: a run of G interleaved blocks; block c's k-pair kp at (kp * G + c) * 32 (block_stride unused)
  (void)block_stride;
  __m512 acc[MR][CB];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh wv[CB];
    for (int c = 0; c < CB; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + (kp * G + c) * 32);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < CB; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], xb, wv[c]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < CB; ++c) {
      __m512 v = acc[m][c];
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + c * 16));
      const __m256bh h = _mm512_cvtneps_pbh(v);
      const int64_t n = std::min<int64_t>(16, cols - c * 16);
      if (n == 16)
        std::memcpy(y + m * ldy + n0 + c * 16, &h, 32);
      else if (n > 0)
        std::memcpy(y + m * ldy + n0 + c * 16, &h, 2 * n);
    }
}

template <int CB>
struct Bf16Tile {
  template <int MR>
  static void run(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block_stride, const float* bias,
                  uint16_t* y, int64_t ldy, int64_t n0, int64_t cols) {
    tile_bf16<MR, CB>(x, K, w, block_stride, bias, y, ldy, n0, cols);
  }
};

// One block of a run of G interleaved blocks (w points at that block's first pair).
template <int G>
struct Bf16LastTile {
  template <int MR>
  static void run(const uint16_t* x, int64_t K, const uint16_t* w, int64_t block_stride, const float* bias,
                  uint16_t* y, int64_t ldy, int64_t n0, int64_t cols) {
    tile_bf16<MR, 1, G>(x, K, w, block_stride, bias, y, ldy, n0, cols);
  }
};

// silu(gate) * up for MR rows from a run of kCB interleaved gate blocks at wg and the run of their
// up blocks at wu (the same layout, I / 16 blocks further on): 2 x kCB accumulators a row, the
// epilogue silu_mul_bf16 (cpu_math.h) -- fused_ops' silu_and_mul of tile_bf16's rounded outputs.
constexpr int kSiluRowsBf16 = 4;  // 4 rows x 6 blocks = 24 accumulators, as tile_bf16<8, 3>

template <int MR>
__attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f"))) inline void silu_tile_bf16(
    const uint16_t* __restrict__ x, int64_t K, const uint16_t* __restrict__ wg, const uint16_t* __restrict__ wu,
    const float* bias_g, const float* bias_u, uint16_t* __restrict__ y, int64_t ldy, int64_t n0) {
  __m512 acc[MR][2 * kCB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 2 * kCB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh wv[2 * kCB];
    for (int c = 0; c < kCB; ++c) {
      wv[c] = (__m512bh)_mm512_loadu_si512(wg + (kp * kCB + c) * 32);
      wv[kCB + c] = (__m512bh)_mm512_loadu_si512(wu + (kp * kCB + c) * 32);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 2 * kCB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < kCB; ++c) {
      __m512 g = acc[m][c], u = acc[m][kCB + c];
      if (bias_g) {
        g = _mm512_add_ps(g, _mm512_loadu_ps(bias_g + n0 + c * 16));
        u = _mm512_add_ps(u, _mm512_loadu_ps(bias_u + n0 + c * 16));
      }
      const __m256bh h = hybridkv_cpu::silu_mul_bf16(g, u);
      std::memcpy(y + m * ldy + n0 + c * 16, &h, 32);
    }
}

void silu_rows_bf16(const uint16_t* x, int64_t M, int64_t K, const uint16_t* wg, const uint16_t* wu,
                    const float* bias_g, const float* bias_u, uint16_t* y, int64_t ldy, int64_t n0) {
  int64_t m = 0;
  for (; m + kSiluRowsBf16 <= M; m += kSiluRowsBf16)
    silu_tile_bf16<kSiluRowsBf16>(x + m * K, K, wg, wu, bias_g, bias_u, y + m * ldy, ldy, n0);
  const uint16_t* xm = x + m * K;
  uint16_t* ym = y + m * ldy;
  switch (M - m) {
    case 1: return silu_tile_bf16<1>(xm, K, wg, wu, bias_g, bias_u, ym, ldy, n0);
    case 2: return silu_tile_bf16<2>(xm, K, wg, wu, bias_g, bias_u, ym, ldy, n0);
    case 3: return silu_tile_bf16<3>(xm, K, wg, wu, bias_g, bias_u, ym, ldy, n0);
  }
  static_assert(kSiluRowsBf16 == 4, "the remainder switch covers kSiluRowsBf16 - 1 rows");
}
#endif

}  // namespace

bool blocked_bf16_available() { return hybridkv_cpu::cpu_has_avx512_bf16(); }

// W [N, K] bfloat16 (K even) -> [ceil(N / 16), K / 2, 16, 2], zero-padded past N.
torch::Tensor pack_blocked_linear_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "pack_blocked_linear_bf16: weight must be [N, K] bfloat16");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_blocked_linear_bf16: K must be even, got ", weight.size(1));
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlockCols - 1) / kBlockCols;
  auto packed = torch::zeros({blocks, K / 2, kBlockCols, 2}, weight.options());
  const auto w = weight.contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < std::min<int64_t>(kBlockCols, N - b * kBlockCols); ++c)
        for (int64_t k = 0; k < K; ++k)
          dst[((b * (K / 2) + k / 2) * kBlockCols + c) * 2 + k % 2] = src[(b * kBlockCols + c) * K + k];
  });
  return packed;
}

// W [N, K] bfloat16 (K even) -> blocked_linear_bf16's layout: pack_blocked_linear_bf16's blocks,
// each group of kCB of them (the last: what is left) interleaved k-pair-major, [K / 2, cb, 16, 2];
// stored flat, [ceil(N / 16), K * 16], so that the other layout's 4-d tensor is refused.
torch::Tensor pack_interleaved_linear_bf16(torch::Tensor weight) {
  const auto blocks4 = pack_blocked_linear_bf16(weight);
  const int64_t blocks = blocks4.size(0), K2 = blocks4.size(1);
  auto packed = torch::empty({blocks, K2 * 32}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(blocks4.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  for (int64_t c0 = 0; c0 < blocks; c0 += kCB) {
    const int64_t cb = std::min<int64_t>(kCB, blocks - c0);
    for (int64_t c = 0; c < cb; ++c)
      for (int64_t kp = 0; kp < K2; ++kp)
        std::memcpy(dst + c0 * K2 * 32 + (kp * cb + c) * 32, src + ((c0 + c) * K2 + kp) * 32, 64);
  }
  return packed;
}

// x [M, K] bfloat16 against a pack_interleaved_linear_bf16 weight of N output columns; bias, when
// given, float32 with blocks * 16 entries (zero past N). Returns [M, N] bfloat16. Needs AVX512-BF16.
torch::Tensor blocked_linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(hybridkv_cpu::cpu_has_avx512_bf16(), "blocked_linear_bf16: this CPU has no AVX512-BF16");
  const auto op = bf16_operands(x, packed, "blocked_linear_bf16");
  const int64_t blocks = op.blocks, K = op.K, M = op.M;
  const float* b = block_bias(bias, N, blocks, "blocked_linear_bf16");
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512F__)
  if (M == 0) return y;
  const uint16_t* xp = op.xp;
  const uint16_t* w = op.w;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t stride = K * kBlockCols;  // elements per block
  for_each_item(
      xp, M, K, w, blocks, yp, N,
      [&](const uint16_t* x, int64_t mr, const uint16_t* wb, uint16_t* yr, int64_t n0, int64_t cols) {
        rows<Bf16Tile<kCB>>(x, mr, K, wb, stride, b, yr, N, n0, cols);
      },
      [&](const uint16_t* x, int64_t mr, const uint16_t* wb, uint16_t* yr, int64_t n0, int64_t cols) {
        // A block c of the last, narrower group (cb = blocks - c_last blocks, interleaved among
        // themselves): for_each_item hands it over as w + c * stride, where the group's run starts
        // at w + c_last * stride; the block sits 32 elements further per block before it.
        const int64_t c = n0 / kBlockCols, c_last = blocks - blocks % kCB, cb = blocks - c_last;
        const uint16_t* group = w + c_last * stride;
        switch (cb) {
          case 1: return rows<Bf16Tile<1>>(x, mr, K, group, stride, b, yr, N, n0, cols);
          case 2: return rows<Bf16LastTile<2>>(x, mr, K, group + (c - c_last) * 32, stride, b, yr, N, n0, cols);
        }
        static_assert(kCB == 3, "the last group has 1 or 2 blocks");
      });
#endif
  return y;
}

// silu(gate) * up of x [M, K] bfloat16 against a pack_interleaved_linear_bf16 weight of a [gate; up]
// projection of N = 2I outputs, where each half is a whole number of kCB-block groups (I a
// multiple of 48), so gate group g and up group g + I / 48 interleave their blocks alike; bias as
// blocked_linear_bf16's. Returns [M, I] bfloat16, bit for bit fused_ops' silu_and_mul of
// blocked_linear_bf16's output. Needs AVX512-BF16.
torch::Tensor blocked_linear_silu_mul_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                           int64_t N) {
  TORCH_CHECK(hybridkv_cpu::cpu_has_avx512_bf16(), "blocked_linear_silu_mul_bf16: this CPU has no AVX512-BF16");
  const auto op = bf16_operands(x, packed, "blocked_linear_silu_mul_bf16");
  const int64_t blocks = op.blocks, K = op.K, M = op.M, I = N / 2;
  TORCH_CHECK(N % (2 * kCB * kBlockCols) == 0 && blocks * kBlockCols == N,
              "blocked_linear_silu_mul_bf16: N must be twice a multiple of 48 and match the blocks");
  const float* b = gate_up_bias(bias, N, "blocked_linear_silu_mul_bf16");
  auto y = torch::empty({M, I}, x.options());
#if defined(__AVX512F__)
  if (M == 0) return y;
  const uint16_t* xp = op.xp;
  const uint16_t* w = op.w;
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t stride = K * kBlockCols;  // elements per block
  const int64_t half = blocks / 2;
  const float* bias_up = b == nullptr ? nullptr : b + I;
  // Work items (row tile, group of kCB gate blocks); every group is whole (checked above).
  for_each_tile(M, half / kCB, [&](int64_t m0, int64_t mr, int64_t group) {
    const int64_t c = group * kCB;
    silu_rows_bf16(xp + m0 * K, mr, K, w + c * stride, w + (c + half) * stride, b, bias_up, yp + m0 * I, I,
                   c * kBlockCols);
  });
#endif
  return y;
}

// The linears' addresses by name, for decode_layers.cpp, which calls them from C++ between the
// layers of a decode step (no Python in between). They are only called through a pointer of
// exactly their type (decode_layers.cpp's Linear).
std::unordered_map<std::string, int64_t> kernel_addresses() {
  return {{"blocked_linear", reinterpret_cast<int64_t>(&blocked_linear)},
          {"blocked_linear_bf16", reinterpret_cast<int64_t>(&blocked_linear_bf16)}};
}
