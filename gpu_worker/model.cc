#include "gpu_worker/model.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "gpu_worker/cpu/cpu_model.h"

namespace hmoe {

absl::StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir,
                                                   const ModelOptions& options,
                                                   RoutedExperts* experts) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  return Create(config, *ckpt, options, experts);
}

absl::StatusOr<std::unique_ptr<Model>> Model::Create(const ModelConfig& config,
                                                     const Checkpoint& ckpt,
                                                     const ModelOptions& options,
                                                     RoutedExperts* experts) {
  if (options.num_threads < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.num_threads must be >= 0, got ", options.num_threads));
  if (options.max_seq_len < 0)
    return absl::InvalidArgumentError(
        absl::StrCat("ModelOptions.max_seq_len must be >= 0, got ", options.max_seq_len));
  if (options.deferred_experts != 0 &&
      (options.deferred_experts < 0 || config.moe.experts_per_token <= 0 ||
       options.deferred_experts >= config.moe.experts_per_token))
    return absl::InvalidArgumentError(absl::StrCat(
        "ModelOptions.deferred_experts must be 0 or in [1, ", config.moe.experts_per_token - 1,
        "] (experts_per_token ", config.moe.experts_per_token, " of ", config.model_type, "), got ",
        options.deferred_experts));
  return cpu::CreateCpuModel(config, ckpt, options, experts);
}

absl::Status Model::Forward(Sequence& seq, absl::Span<const int32_t> tokens, LogitsMode mode,
                            std::vector<float>* logits) const {
  const ForwardStep step{&seq, tokens, mode, logits};
  return ForwardBatch(absl::MakeConstSpan(&step, 1));
}

absl::StatusOr<std::vector<float>> Model::Prefill(Sequence& seq, absl::Span<const int32_t> tokens,
                                                  LogitsMode mode) const {
  std::vector<float> logits;
  RETURN_IF_ERROR(Forward(seq, tokens, mode, &logits));
  return logits;
}

absl::StatusOr<std::vector<float>> Model::Decode(Sequence& seq, int32_t token) const {
  std::vector<float> logits;
  RETURN_IF_ERROR(Forward(seq, absl::MakeConstSpan(&token, 1), LogitsMode::kLast, &logits));
  return logits;
}

}  // namespace hmoe
