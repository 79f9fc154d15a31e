// AMX's tile products, where the build targets a CPU with them (amx_bf16 for bf16, amx_int8 for W8A8) and
// the kernel grants the process the tile state (arch_prctl, Linux 5.16+). A packed block of 16 columns is
// the B operand of one tile multiply (16 rows of 64 bytes: 32 bf16 pairs or 64 int8 quads of a column); a
// tile multiply sums 16 x 32 bf16 products a row where an AVX512-BF16 instruction sums 32. Row m of C is
// C[m] += A[m] . B block after block, the same instructions whatever rows share its tile, so a row's sums
// never depend on its batch. Included by products.cpp and quantized.cpp only.
#pragma once

#include "products.h"

#if TANDEM_X86
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tandem {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool HAS_TILE_PRODUCT = true;

struct TileConfig {              // LDTILECFG's 64-byte layout (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// Tiles 0..3: C (m rows x 16 sums); 4: A (m rows x 64 bytes of x); 5, 6: B blocks, alternating.
inline void tile_config(int64_t m) {
  TileConfig config;
  for (int t = 0; t <= 4; ++t) config.rows[t] = m, config.colsb[t] = 64;
  for (int t = 5; t <= 6; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}
inline void tile_release() { _tile_release(); }

// The two tile multiplies: what a row of A holds (K inputs in 64 bytes) and what C sums in.
struct Bf16Tiles {
  using In = c10::BFloat16;
  using Sum = float;
  static constexpr int64_t K = 32;
  static constexpr bool INT8 = false;
};
#if defined(__AMX_INT8__)
constexpr bool HAS_INT8_TILES = true;
struct Int8Tiles {
  using In = int8_t;
  using Sum = int32_t;
  static constexpr int64_t K = 64;
  static constexpr bool INT8 = true;
};
#else
constexpr bool HAS_INT8_TILES = false;
#endif

// C tile c += A (tile 4) . B tile b, in the multiply of Tiles (the intrinsics take literal tile numbers).
#define TILE_MULTIPLY(c, b)                                  \
  do {                                                       \
    if constexpr (Tiles::INT8) _tile_dpbssd(c, 4, b);        \
    else _tile_dpbf16ps(c, 4, b);                            \
  } while (0)

// The sums of m rows of x (width x_width, m set by tile_config) against NB blocks of 16 columns from
// block n_block: c [m][TILE_GROUP * 16].
template <class Tiles, int NB>
void tile_pass(const typename Tiles::In* x, int64_t x_width, const typename Tiles::In* w, int64_t n_block,
               typename Tiles::Sum* c) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  constexpr int64_t block = TILE_COLS * Tiles::K;
  const int64_t k_blocks = x_width / Tiles::K, column_stride = k_blocks * block;
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    _tile_loadd(4, x + kb * Tiles::K, x_width * sizeof(typename Tiles::In));
    const typename Tiles::In* b = w + n_block * column_stride + kb * block;
    _tile_loadd(5, b, 64);
    TILE_MULTIPLY(0, 5);
    if constexpr (NB > 1) { _tile_loadd(6, b + column_stride, 64); TILE_MULTIPLY(1, 6); }
    if constexpr (NB > 2) { _tile_loadd(5, b + 2 * column_stride, 64); TILE_MULTIPLY(2, 5); }
    if constexpr (NB > 3) { _tile_loadd(6, b + 3 * column_stride, 64); TILE_MULTIPLY(3, 6); }
  }
  constexpr int64_t ldc = GROUP_COLS * 4;
  _tile_stored(0, c, ldc);
  if constexpr (NB > 1) _tile_stored(1, c + TILE_COLS, ldc);
  if constexpr (NB > 2) _tile_stored(2, c + 2 * TILE_COLS, ldc);
  if constexpr (NB > 3) _tile_stored(3, c + 3 * TILE_COLS, ldc);
}
#else
constexpr bool HAS_TILE_PRODUCT = false, HAS_INT8_TILES = false;
inline bool tiles_granted() { return false; }
inline void tile_config(int64_t) {}
inline void tile_release() {}
#endif

}  // namespace tandem
