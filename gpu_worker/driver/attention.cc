#include "gpu_worker/driver/attention.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/driver/attention_kinds.h"

namespace hmoe {
namespace {

// The attention table: one row per AttentionKind (attention_kinds.h).
constexpr AttentionKindOps kAttentionKinds[] = {
    {AttentionKind::kMla, &MlaSpec},
    {AttentionKind::kGqa, &GqaSpec},
    {AttentionKind::kMlaDsa, &MlaDsaSpec},
};

}  // namespace

absl::StatusOr<const AttentionKindOps*> AttentionKindOpsFor(AttentionKind kind) {
  for (const AttentionKindOps& k : kAttentionKinds)
    if (k.kind == kind) return &k;
  return absl::UnimplementedError(absl::StrCat("attention kind ", static_cast<int>(kind), " (",
                                               AttentionKindName(kind), ") has no implementation"));
}

absl::StatusOr<AttentionSpec> AttentionSpecFor(const ModelConfig& config, int layer) {
  if (layer < 0 || layer >= static_cast<int>(config.layers.size()))
    return absl::InvalidArgumentError(absl::StrCat("AttentionSpecFor: layer ", layer,
                                                   " outside [0, ", config.layers.size(), ")"));
  const LayerSpec& l = config.layers[static_cast<size_t>(layer)];
  absl::StatusOr<const AttentionKindOps*> k = AttentionKindOpsFor(l.attention);
  if (!k.ok()) return Annotate(k.status(), absl::StrCat("layer ", layer));
  return (*k)->spec(config, l);
}

AttentionGeometry AttentionGeometryFor(const ModelConfig& config) {
  // The first layer's kind (its architecture's before the layers are made);
  // the geometry does not depend on the layer's window.
  LayerSpec l;
  l.attention = config.layers.empty() ? KindsOf(config.arch).attention : config.layers[0].attention;
  absl::StatusOr<const AttentionKindOps*> k = AttentionKindOpsFor(l.attention);
  return k.ok() ? (*k)->spec(config, l).geometry : AttentionGeometry{};
}

}  // namespace hmoe
