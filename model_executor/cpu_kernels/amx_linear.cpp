// y = x W^T (+ b) in bfloat16 on AMX tiles, from blocked_linear.cpp's bf16 weight layout.
//
// That layout, [ceil(N / 16), K / 2, 16, 2] (output columns in blocks of 16, k in pairs), is the
// tile unit's B operand as it stands: 16 consecutive k pairs of one block are one 16 x 64-byte
// tile, 1 KB contiguous. So on a CPU with AMX this kernel serves every row count from that one
// packed copy (layers.AmxLinearWeight), and oneDNN's packed copy is not made; CPUs with
// AVX512-BF16 but no AMX read the same layout with vdpbf16ps for a few rows.
//
// Micro-kernel: up to 2 x 2 float32 accumulator tiles (32 rows x 32 columns) over K in chunks of
// 32; per chunk, one A tile (16 rows x 32 k of x, read in place) per row tile and one B tile per
// column block. Work items are (chunk of up to kChunkRows rows, pair of column blocks), rows
// outer, so a thread's consecutive items reuse its rows of x from L2 while the weights stream,
// and each weight tile is read from memory once per row chunk. Rows past M are zero-padded in a
// copy of x (only when M is not a multiple of 16). Products of bf16 values are exact and the
// sums float32, as in blocked_linear_bf16 and oneDNN; the result is rounded to bf16 once.
// torch: torch_headers.h, put in front by the loader (attention_backends/cpu_kernels/build.py)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlockCols = 16;   // output columns per weight block (blocked_linear.cpp's)
constexpr int64_t kTileRows = 16;    // rows of x per A tile
constexpr int64_t kTileK = 32;       // k per tile (16 pairs)
constexpr int64_t kChunkRows = 256;  // rows of x per work item (its slice of x stays in L2)

// Tiles: 0-3 accumulators C[row tile][column block] = 0 + 2 r + c, 4-5 A (row tiles), 6-7 B.
// RT row tiles x CB column blocks (each 1 or 2) of y over all of K; the second column block's
// weights start `second` elements after the first's (the next block, or the up projection's
// block for the fused SiLU). The C tiles go to `c` ([RT * 2 + CB][16 x 16] floats).
//
// `pending(n)` runs up to n rows of the previous call's epilogue (rounding, bias, SiLU, the
// stores to y: vector work on the other C buffer); a few rows per k chunk, the rest before this
// call's tile stores. Run after the previous call instead, the epilogue waited for its tile
// stores and the tile unit waited for the epilogue: the fused gate/up projection of 1,024 rows
// (576 -> 2 x 1,536) took ~2.6 ms, ~1.4 with no epilogue at all, 1.45 overlapped like this.
template <int RT, int CB, class Pending>
inline void micro(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t second, int64_t kchunks, float* c,
                  Pending& pending, int64_t rows_per_chunk) {
  _tile_zero(0);
  if constexpr (CB == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CB == 2) _tile_zero(3);
  const int64_t a_stride = lda * 2;  // bytes between rows of x
  for (int64_t kc = 0; kc < kchunks; ++kc) {
    _tile_loadd(4, a + kc * kTileK, a_stride);
    _tile_loadd(6, b + kc * kTileK * kBlockCols, 64);
    if constexpr (CB == 2) _tile_loadd(7, b + second + kc * kTileK * kBlockCols, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, a + kTileRows * lda + kc * kTileK, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CB == 2) _tile_dpbf16ps(3, 5, 7);
    }
    pending(rows_per_chunk);
  }
  pending(2 * kTileRows);
  _tile_stored(0, c, 64);
  if constexpr (CB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (RT == 2) _tile_stored(2, c + 512, 64);
  if constexpr (RT == 2 && CB == 2) _tile_stored(3, c + 768, 64);
}

// The micro-kernel calls over row tiles [t0, t1) (two at a time) against one pair of column
// blocks, each call's epilogue deferred into the next (see micro): row(c, m) writes y's row m
// (below M) from its row of the call's C tiles (c: that row of the first column block's tile, the
// second block's 256 floats further).
template <int CB, class Row>
inline void row_tiles(const uint16_t* xp, int64_t K, int64_t M, int64_t t0, int64_t t1, const uint16_t* wb,
                      int64_t second, Row& row) {
  alignas(64) float c[2][4 * 256];
  const float* done = nullptr;  // the previous call's C tiles
  int64_t done_m = 0, done_rows = 0, next = 0;
  auto pending = [&](int64_t n) {
    for (; n > 0 && next < done_rows; --n, ++next)
      row(done + (next / kTileRows) * 512 + (next % kTileRows) * 16, done_m + next);
  };
  const int64_t kchunks = K / kTileK, rows_per_chunk = (2 * kTileRows + kchunks - 1) / kchunks;
  int buf = 0;
  for (int64_t t = t0; t < t1; t += 2, buf ^= 1) {
    const uint16_t* a = xp + t * kTileRows * K;
    const bool two = t + 1 < t1;
    if (two) micro<2, CB>(a, K, wb, second, kchunks, c[buf], pending, rows_per_chunk);
    else micro<1, CB>(a, K, wb, second, kchunks, c[buf], pending, rows_per_chunk);
    done = c[buf];
    done_m = t * kTileRows;
    done_rows = std::min<int64_t>((two ? 2 : 1) * kTileRows, M - done_m);
    next = 0;
  }
  pending(2 * kTileRows);
}

// One row of two column blocks' C tiles (c, c + 256) (+ bias) as a whole 64-byte row of y:
// half-line writes of one tile at a time made the 1,024 x 3,072 gate/up projection ~10% slower.
inline void store_pair_row(const float* c, const float* bias, uint16_t* y) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(c + 256), b1),
                                                      _mm512_add_ps(_mm512_load_ps(c), b0)));
}

// One row of one C tile (+ bias) into columns [0, cols) of y.
inline void store_row(const float* c, const float* bias, int64_t cols, uint16_t* y) {
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c), bv));
  std::memcpy(y, &h, 2 * cols);
}

using hybridkv_cpu::silu_mul_bf16;  // cpu_math.h: fused_ops' silu_and_mul in bf16, bit for bit

// silu(gate) * up for one row of a gate and an up C tile (+ their biases) into 16 outputs of y:
// what fused_ops' silu_and_mul does to this kernel's rounded output -- gate and up rounded to
// bf16 first, silu of the gate rounded to bf16, times up, rounded once more -- so the fused call
// gives the unfused pair's bits.
inline void store_silu_mul_row(const float* c_gate, const float* c_up, const float* bias_gate, const float* bias_up,
                               uint16_t* y) {
  const __m512 bg = bias_gate ? _mm512_loadu_ps(bias_gate) : _mm512_setzero_ps();
  const __m512 bu = bias_up ? _mm512_loadu_ps(bias_up) : _mm512_setzero_ps();
  const __m256bh h = silu_mul_bf16(_mm512_add_ps(_mm512_load_ps(c_gate), bg), _mm512_add_ps(_mm512_load_ps(c_up), bu));
  std::memcpy(y, &h, 32);
}

// The checks both entry points share; returns the bias pointer (or nullptr).
const float* check_call(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                        int64_t N, const char* name) {
  TORCH_CHECK(hybridkv_amx::amx_ready(), name, ": this CPU or process cannot use AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x must be [M, K] bfloat16");
  TORCH_CHECK(x.size(1) % kTileK == 0, name, ": K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kBlockCols && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1),
              name, ": packed must be a pack_blocked_linear_bf16 weight of x's K");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(N > (blocks - 1) * kBlockCols && N <= blocks * kBlockCols, name, ": N does not match the blocks");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks * kBlockCols,
              name, ": bias must be float32 padded to whole blocks");
  return bias->data_ptr<float>();
}

// x's rows as whole 16-row tiles: x itself when it already is (contiguous, M a multiple of 16),
// else a zero-padded copy in `scratch`. The copy is a memcpy per row into a buffer the calling
// thread keeps (it grows to the largest padded x seen): torch::constant_pad_nd here (an
// allocation, a fill, a narrow and a copy through the dispatcher) ran on every one-row decode
// projection, 121 times a step for the demo model, and cost ~1.5 us of a ~20 us 576 x 576 call.
const uint16_t* padded_rows(const torch::Tensor& x, std::vector<uint16_t>& scratch) {
  const int64_t M = x.size(0), K = x.size(1), Mp = (M + kTileRows - 1) / kTileRows * kTileRows;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (Mp == M && x.is_contiguous()) return src;
  scratch.resize(static_cast<size_t>(Mp * K));
  const int64_t row_stride = x.stride(0);
  if (x.stride(1) == 1) {
    for (int64_t m = 0; m < M; ++m) std::memcpy(scratch.data() + m * K, src + m * row_stride, K * 2);
  } else {
    const torch::Tensor xc = x.contiguous();
    std::memcpy(scratch.data(), xc.data_ptr<at::BFloat16>(), M * K * 2);
  }
  std::memset(scratch.data() + M * K, 0, (Mp - M) * K * 2);
  return scratch.data();
}

// The loop both entry points share: x padded to whole tiles and cut into equal row chunks of at
// most kChunkRows; work items (row chunk, column unit), rows outer, over torch's threads, each
// thread with the tiles configured. item(xp, t0, t1, unit) runs row tiles [t0, t1) of the padded
// x (xp) against one column unit (a pair of blocks, or a gate block and its up block).
template <class Item>
void for_each_item(const torch::Tensor& x, int64_t units, Item item) {
  thread_local std::vector<uint16_t> scratch;  // the caller's: it waits for the parallel loop below
  const uint16_t* xp = padded_rows(x, scratch);
  const int64_t padded = (x.size(0) + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t tiles = padded / kTileRows, chunk_count = (padded + kChunkRows - 1) / kChunkRows;
  const int64_t chunk_tiles = (tiles + chunk_count - 1) / chunk_count;
  at::parallel_for(0, chunk_count * units, 1, [&](int64_t i0, int64_t i1) {
    hybridkv_amx::configure_tiles();
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t0 = i / units * chunk_tiles;
      item(xp, t0, std::min(tiles, t0 + chunk_tiles), i % units);
    }
    _tile_release();
  });
}

inline const uint16_t* bf16_bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

}  // namespace

bool amx_available() { return hybridkv_amx::amx_ready(); }

// x [M, K] bfloat16 (K a multiple of 32) against a pack_blocked_linear_bf16 weight of N output
// columns; bias, when given, float32 with blocks * 16 entries (zero past N). Returns [M, N] bf16.
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  const float* bias_p = check_call(x, packed, bias, N, "amx_linear_bf16");
  const int64_t blocks = packed.size(0), K = x.size(1), M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint16_t* w = bf16_bits(packed);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t block_stride = K * kBlockCols;
  const int64_t pairs = (blocks + 1) / 2;
  for_each_item(x, pairs, [&](const uint16_t* xp, int64_t t0, int64_t t1, int64_t pair) {
    const int64_t b0 = pair * 2, cb = std::min<int64_t>(2, blocks - b0), n0 = b0 * kBlockCols;
    const float* bias0 = bias_p ? bias_p + n0 : nullptr;
    const uint16_t* wb = w + b0 * block_stride;
    if (cb == 2 && N - n0 >= 2 * kBlockCols) {
      auto row = [&](const float* c, int64_t m) { store_pair_row(c, bias0, yp + m * N + n0); };
      row_tiles<2>(xp, K, M, t0, t1, wb, block_stride, row);
    } else {  // the last pair: one block, or two of which the second ends inside
      auto row = [&](const float* c, int64_t m) {
        for (int64_t j = 0; j < cb; ++j)
          store_row(c + j * 256, bias0 ? bias0 + j * kBlockCols : nullptr,
                    std::min<int64_t>(kBlockCols, N - n0 - j * kBlockCols), yp + m * N + n0 + j * kBlockCols);
      };
      if (cb == 2) row_tiles<2>(xp, K, M, t0, t1, wb, block_stride, row);
      else row_tiles<1>(xp, K, M, t0, t1, wb, block_stride, row);
    }
  });
  return y;
}

// silu(gate) * up of a fused gate/up projection: packed holds the gate's N / 2 output columns then
// the up's (N / 2 a multiple of 16), bias likewise. Returns [M, N / 2] bf16, bit for bit
// fused_ops.silu_and_mul(amx_linear_bf16(x, packed, bias, N)), without writing the [M, N]
// projection to memory and reading it back. Work items are (row chunk, gate block j); each
// multiplies blocks j and j + N / 32 together (one 2-block micro-kernel call per row pair).
torch::Tensor amx_linear_silu_mul_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                       int64_t N) {
  const float* bias_p = check_call(x, packed, bias, N, "amx_linear_silu_mul_bf16");
  TORCH_CHECK(N % (2 * kBlockCols) == 0, "amx_linear_silu_mul_bf16: N / 2 must be a multiple of 16, got N = ", N);
  const int64_t K = x.size(1), M = x.size(0), I = N / 2, half = I / kBlockCols;
  auto y = torch::empty({M, I}, x.options());
  if (M == 0) return y;
  const uint16_t* w = bf16_bits(packed);
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t block_stride = K * kBlockCols;
  for_each_item(x, half, [&](const uint16_t* xp, int64_t t0, int64_t t1, int64_t j) {
    const float* bias_gate = bias_p ? bias_p + j * kBlockCols : nullptr;
    const float* bias_up = bias_p ? bias_p + I + j * kBlockCols : nullptr;
    auto row = [&](const float* c, int64_t m) {
      store_silu_mul_row(c, c + 256, bias_gate, bias_up, yp + m * I + j * kBlockCols);
    };
    row_tiles<2>(xp, K, M, t0, t1, w + j * block_stride, half * block_stride, row);
  });
  return y;
}
