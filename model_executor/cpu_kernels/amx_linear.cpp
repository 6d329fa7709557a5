// y = x W^T (+ b) in bfloat16 on AMX tiles, from blocked_linear.cpp's bf16 weight layout.
//
// That layout, [ceil(N / 16), K / 2, 16, 2] (output columns in blocks of 16, k in pairs), is the
// tile unit's B operand as it stands: 16 consecutive k pairs of one block are one 16 x 64-byte
// tile, 1 KB contiguous. So the same packed copy serves vdpbf16ps for a few rows and this kernel
// for more, and oneDNN's packed copy is not needed for either.
//
// Micro-kernel: up to 2 x 2 float32 accumulator tiles (32 rows x 32 columns) over K in chunks of
// 32; per chunk, one A tile (16 rows x 32 k of x, read in place) per row tile and one B tile per
// column block. Work items are (chunk of up to kChunkRows rows, pair of column blocks), rows
// outer, so a thread's consecutive items reuse its rows of x from L2 while the weights stream,
// and each weight tile is read from memory once per row chunk. Rows past M are zero-padded in a
// copy of x (only when M is not a multiple of 16). Products of bf16 values are exact and the
// sums float32, as in blocked_linear_bf16 and oneDNN; the result is rounded to bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlockCols = 16;   // output columns per weight block (blocked_linear.cpp's)
constexpr int64_t kTileRows = 16;    // rows of x per A tile
constexpr int64_t kTileK = 32;       // k per tile (16 pairs)
constexpr int64_t kChunkRows = 256;  // rows of x per work item (its slice of x stays in L2)

// Tiles: 0-3 accumulators C[row tile][column block] = 0 + 2 r + c, 4-5 A (row tiles), 6-7 B.
// RT row tiles x CB column blocks (each 1 or 2) of y over all of K; the C tiles go to `c`
// ([RT * 2 + CB][16 x 16] floats).
template <int RT, int CB>
inline void micro(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t block_stride, int64_t kchunks, float* c) {
  _tile_zero(0);
  if constexpr (CB == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CB == 2) _tile_zero(3);
  const int64_t a_stride = lda * 2;  // bytes between rows of x
  for (int64_t kc = 0; kc < kchunks; ++kc) {
    _tile_loadd(4, a + kc * kTileK, a_stride);
    _tile_loadd(6, b + kc * kTileK * kBlockCols, 64);
    if constexpr (CB == 2) _tile_loadd(7, b + block_stride + kc * kTileK * kBlockCols, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, a + kTileRows * lda + kc * kTileK, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (CB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (RT == 2 && CB == 2) _tile_stored(3, c + 768, 64);
}

// Two column blocks' 16 x 16 float tiles (c, c + 256) of y (+ bias) as whole 64-byte rows of y:
// half-line writes of one tile at a time made the 1,024 x 3,072 gate/up projection ~10% slower.
inline void store_pair(const float* c, const float* bias, int64_t rows, uint16_t* y, int64_t ldy) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(c + 256 + r * 16), b1),
                                                   _mm512_add_ps(_mm512_load_ps(c + r * 16), b0));
    _mm512_storeu_si512(y + r * ldy, v);
  }
}

// One 16 x 16 float tile of y (+ bias) into rows [0, rows) and columns [0, cols) of y at `y`.
inline void store_tile(const float* c, const float* bias, int64_t rows, int64_t cols, uint16_t* y, int64_t ldy) {
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c + r * 16), bv));
    std::memcpy(y + r * ldy, &h, 2 * cols);
  }
}

}  // namespace

bool amx_available() { return hybridkv_amx::amx_ready(); }

// x [M, K] bfloat16 (K a multiple of 32) against a pack_blocked_linear_bf16 weight of N output
// columns; bias, when given, float32 with blocks * 16 entries (zero past N). Returns [M, N] bf16.
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(hybridkv_amx::amx_ready(), "amx_linear_bf16: this CPU or process cannot use AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear_bf16: x must be [M, K] bfloat16");
  TORCH_CHECK(x.size(1) % kTileK == 0, "amx_linear_bf16: K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlockCols && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              "amx_linear_bf16: packed must be a pack_blocked_linear_bf16 weight of x's K");
  const int64_t blocks = packed.size(0), K = x.size(1), M = x.size(0);
  TORCH_CHECK(N > (blocks - 1) * kBlockCols && N <= blocks * kBlockCols, "amx_linear_bf16: N does not match the blocks");
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks * kBlockCols,
                "amx_linear_bf16: bias must be float32 padded to whole blocks");
    bias_p = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  // Whole row tiles: a zero-padded copy of x when M is not a multiple of 16 (tile loads read 16 rows).
  const int64_t Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  torch::Tensor xc = x.contiguous();
  if (Mp != M) xc = torch::constant_pad_nd(xc, {0, 0, 0, Mp - M});
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t block_stride = K * kBlockCols, kchunks = K / kTileK;
  const int64_t pairs = (blocks + 1) / 2;
  // Row chunks of equal size in whole tiles (at most kChunkRows rows).
  const int64_t tiles = Mp / kTileRows, chunk_count = (Mp + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_tiles = (tiles + chunk_count - 1) / chunk_count;
  at::parallel_for(0, chunk_count * pairs, 1, [&](int64_t i0, int64_t i1) {
    hybridkv_amx::configure_tiles();
    alignas(64) float c[4 * 256];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t0 = i / pairs * chunk_tiles, t1 = std::min(tiles, t0 + chunk_tiles);
      const int64_t b0 = i % pairs * 2, cb = std::min<int64_t>(2, blocks - b0);
      const uint16_t* wb = w + b0 * block_stride;
      for (int64_t t = t0; t < t1; t += 2) {
        const int rt = t + 1 < t1 ? 2 : 1;
        const uint16_t* a = xp + t * kTileRows * K;
        if (rt == 2 && cb == 2) micro<2, 2>(a, K, wb, block_stride, kchunks, c);
        else if (rt == 2) micro<2, 1>(a, K, wb, block_stride, kchunks, c);
        else if (cb == 2) micro<1, 2>(a, K, wb, block_stride, kchunks, c);
        else micro<1, 1>(a, K, wb, block_stride, kchunks, c);
        for (int r = 0; r < rt; ++r) {
          const int64_t m0 = (t + r) * kTileRows, rows = std::min<int64_t>(kTileRows, M - m0);
          if (rows <= 0) continue;
          if (cb == 2 && N - b0 * kBlockCols >= 2 * kBlockCols) {
            const int64_t n0 = b0 * kBlockCols;
            store_pair(c + r * 512, bias_p ? bias_p + n0 : nullptr, rows, yp + m0 * N + n0, N);
            continue;
          }
          for (int64_t j = 0; j < cb; ++j) {
            const int64_t n0 = (b0 + j) * kBlockCols, cols = std::min<int64_t>(kBlockCols, N - n0);
            store_tile(c + (r * 2 + j) * 256, bias_p ? bias_p + n0 : nullptr, rows, cols, yp + m0 * N + n0, N);
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}
