#include "gpu_worker/cpu/attention.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace hmoe::cpu {
namespace {

// The table: one op per AttentionKind.
struct AttentionOpRow {
  AttentionKind kind;
  std::unique_ptr<AttentionOp> (*make)(const ModelConfig& config, const AttentionSpec& spec);
};
constexpr AttentionOpRow kAttentionOps[] = {
    {AttentionKind::kMla, &MakeMlaAttention},
    {AttentionKind::kGqa, &MakeGqaAttention},
    {AttentionKind::kMlaDsa, &MakeMlaDsaAttention},
};

}  // namespace

absl::Status LoadLin(const Checkpoint& ckpt, const std::string& prefix, const WeightLoad& load,
                     Lin* out) {
  ASSIGN_OR_RETURN(out->w, LoadDenseAsMatrix(ckpt, prefix + ".weight", load));
  ASSIGN_OR_RETURN(out->b, LoadOptionalVector(ckpt, prefix + ".bias", out->w.rows));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<AttentionOp>> MakeAttentionOp(const ModelConfig& config,
                                                             const AttentionSpec& spec) {
  for (const AttentionOpRow& r : kAttentionOps)
    if (r.kind == spec.kind) return r.make(config, spec);
  return absl::UnimplementedError(absl::StrCat(
      "cpu backend: attention kind ", AttentionKindName(spec.kind), " has no implementation"));
}

}  // namespace hmoe::cpu
