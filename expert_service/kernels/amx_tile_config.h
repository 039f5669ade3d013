// The one AMX tile configuration our kernels (and bench/amx_microprobe.cc)
// use: palette 1, eight tiles of 16 rows x 64 bytes. It is a constant in
// read-only data on purpose: GCC 12 was seen dropping the colsb stores of a
// stack-built config before ldtilecfg, which then configures zero-width tiles
// and faults on the first tile load.
#pragma once

#include <cstdint>

namespace hmoe::kern {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr TileConfig MakeTileConfig() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}
alignas(64) inline constexpr TileConfig kTileConfig = MakeTileConfig();

}  // namespace hmoe::kern
