// config.json parsing (ParseModelConfig) on arbitrary text, then the derived
// views of an accepted config.
#include <cstdint>
#include <string>

#include "common/model_config.h"
#include "common/weight_map.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto c = hmoe::ParseModelConfig(text, "fuzz/config.json");
  if (!c.ok()) return 0;
  (void)c->num_moe_layers();
  (void)c->moe_layer_indices();
  (void)c->is_mla();
  return 0;
}
