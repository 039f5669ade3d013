#include "gpu_worker/server/local_experts.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status.h"

namespace hmoe {

absl::StatusOr<std::unique_ptr<HandlerRoutedExperts>> HandlerRoutedExperts::Create(
    const ModelConfig& c, MoeHandler* handler) {
  const ShardInfo& m = handler->info();
  if (m.num_shards != 1)
    return absl::FailedPreconditionError(
        absl::StrCat("expert handler is shard ", m.shard_index, " of ", m.num_shards,
                     ": an in-process handler must serve every routed expert whole"));
  RETURN_IF_ERROR(CheckServesModel(m, c, "expert handler"));
  return std::unique_ptr<HandlerRoutedExperts>(new HandlerRoutedExperts(c, handler));
}

absl::Status HandlerRoutedExperts::Forward(const ExpertBatch& b, float* out) {
  RETURN_IF_ERROR(ValidateExpertBatch(config_, b));
  std::vector<uint16_t> hidden(static_cast<size_t>(b.num_tokens * b.hidden_size));
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = F32ToBf16(b.hidden[i]);
  const int64_t piece = std::max<int64_t>(1, handler_->info().max_tokens);
  for (int64_t t0 = 0; t0 < b.num_tokens; t0 += piece) {
    const int64_t n = std::min(piece, b.num_tokens - t0);
    const MoeCall call = MoeCall::Make(b.layer, static_cast<int32_t>(n), b.top_k, b.hidden_size,
                                       hidden.data() + t0 * b.hidden_size,
                                       b.expert_ids + t0 * b.top_k, b.weights + t0 * b.top_k);
    RETURN_IF_ERROR(handler_->Handle(call, out + t0 * b.hidden_size, nullptr));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
