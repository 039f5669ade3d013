// AttentionKind::kMlaDsa: MLA over the keys DeepSeek sparse attention's
// lightning indexer selects.
#include "gpu_worker/driver/attention_kinds.h"

namespace hmoe {

AttentionSpec MlaDsaSpec(const ModelConfig& config, const LayerSpec& layer) {
  AttentionSpec s = MlaSpec(config, layer);
  s.kind = AttentionKind::kMlaDsa;
  // The indexer's key follows MLA's row; attention reads the first dk floats.
  s.cache.k_row += config.dsa.head_dim;
  return s;
}

}  // namespace hmoe
