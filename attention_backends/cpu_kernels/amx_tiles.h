// AMX tile setup shared by the kernels that run on the tile unit (bf16_products_amx.h, for
// prefill_attention_bf16.cpp, and model_executor/cpu_kernels/amx_linear.cpp); their loaders put
// it in front of the source and build them with -mamx-tile -mamx-bf16 only where torch sees AMX.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace hybridkv_amx {

// Palette 1, every one of the 8 tiles 16 rows of 64 bytes (16 floats, or 32 bf16, or 16 bf16
// pairs): the callers' tiles are all full-size (partial rows are zero-padded in memory).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Per thread: the tile configuration is thread state; pair it with _tile_release().
inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// AMX-BF16 on this CPU, and the process's permission to use the tile state (Linux gives it on
// request, once per process).
inline bool amx_ready() {
  static const bool ready = [] {
    unsigned int a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return ready;
}

}  // namespace hybridkv_amx
