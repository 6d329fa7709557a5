// prefill_attention_bf16.cpp's two products on AMX tiles (Intel Sapphire Rapids and later):
// the loader puts this file, after amx_tiles.h, in front of that kernel for its AMX build
// (bf16_products_avx512.h is the other build's). Both read the same packed layouts (see the
// kernel's header) and keep S and O in the same float32 rows, so the kernel around them is one.
#include <immintrin.h>

#include <cstdint>

namespace hybridkv_bf16 {

constexpr int64_t kKeyBlock = 64;  // keys per packed block: four 16-key score tiles

// Whether this CPU and process can run these products.
inline bool products_ready() { return hybridkv_amx::amx_ready(); }

// Per thread, around its work items: the tile configuration is thread state (amx_tiles.h).
struct ThreadProducts {
  ThreadProducts() { hybridkv_amx::configure_tiles(); }
  ~ThreadProducts() { _tile_release(); }
  ThreadProducts(const ThreadProducts&) = delete;
  ThreadProducts& operator=(const ThreadProducts&) = delete;
};

// Tile registers (amx_tiles.h configures all 8 as 16 x 64 bytes): 0-3 accumulators (C), 4 the A
// operand, 5-6 B operands.

// S [16 x 64] (row stride 64 floats) = Q [16 x D] . K^T for one packed key block.
inline void score_block(const uint16_t* qbuf, int64_t D, const uint16_t* kblock, float* S) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(4, qbuf + c * 32, D * 2);
    const uint16_t* kc = kblock + c * 512;
    _tile_loadd(5, kc + 0 * 16 * D, 64);
    _tile_loadd(6, kc + 1 * 16 * D, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kc + 2 * 16 * D, 64);
    _tile_loadd(6, kc + 3 * 16 * D, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, S + 0, kKeyBlock * 4);
  _tile_stored(1, S + 16, kKeyBlock * 4);
  _tile_stored(2, S + 32, kKeyBlock * 4);
  _tile_stored(3, S + 48, kKeyBlock * 4);
}

// O [16 x D] (row stride D floats) += P [16 x 64] bf16 . V for one packed key block: the
// accumulators are loaded from O and stored back, four 16-wide d tiles at a time.
inline void accumulate_values(const uint16_t* pbuf, int64_t D, const uint16_t* vblock, float* O) {
  for (int64_t dc = 0; dc < D / 64; ++dc) {
    float* o = O + dc * 64;
    _tile_loadd(0, o + 0, D * 4);
    _tile_loadd(1, o + 16, D * 4);
    _tile_loadd(2, o + 32, D * 4);
    _tile_loadd(3, o + 48, D * 4);
    for (int64_t kk = 0; kk < 2; ++kk) {
      _tile_loadd(4, pbuf + kk * 32, kKeyBlock * 2);
      const uint16_t* vc = vblock + kk * 32 * D + dc * 4 * 512;
      _tile_loadd(5, vc + 0 * 512, 64);
      _tile_loadd(6, vc + 1 * 512, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vc + 2 * 512, 64);
      _tile_loadd(6, vc + 3 * 512, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, o + 0, D * 4);
    _tile_stored(1, o + 16, D * 4);
    _tile_stored(2, o + 32, D * 4);
    _tile_stored(3, o + 48, D * 4);
  }
}

}  // namespace hybridkv_bf16
