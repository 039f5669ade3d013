// What an approximation costs in accuracy: a model variant (Expert Deferral,
// or routed experts in one of the expert service's weight formats) scored
// against the exact model (the CPU reference with fp32 reference experts)
// over the same held-out tokens, as hmoe-bench-accuracy reports it.
//
// Scoring is tests/model/perplexity_test.cc's (and make_fixtures.py's): each
// doc is BOS + doc + EOS, prefilled in a fresh Sequence, every next token
// predicted. Metrics come from each row's log-softmax in double.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/experts/weight_format.h"
#include "common/text/tokenizer.h"
#include "expert_service/server/expert_shard.h"
#include "gpu_worker/model.h"
#include "gpu_worker/routed_experts.h"

namespace hmoe::accuracy {

// Docs of a corpus file: separated by "\n%\n"; blank (whitespace-only) docs dropped.
std::vector<std::string> SplitDocs(const std::string& text);

// The tokens to score: per doc BOS + doc + EOS.
struct EvalSet {
  std::vector<std::vector<int32_t>> docs;
  int64_t scored_tokens = 0;  // sum over docs of size - 1
};

// Reads and splits `path` (NOT_FOUND when unreadable), encodes each doc
// without special tokens; `max_docs` > 0 keeps only the first ones.
// INVALID_ARGUMENT when no doc is left.
absl::StatusOr<EvalSet> LoadEvalSet(const std::string& path, const Tokenizer& tok, int32_t bos,
                                    int32_t eos, int64_t max_docs = 0);

// The model's logits at every scored position, docs back to back:
// [set.scored_tokens][vocab_size].
absl::StatusOr<std::vector<float>> ScoreLogits(const Model& model, const EvalSet& set);

struct Metrics {
  int64_t tokens = 0;
  double ppl = 0;             // the variant's exp(mean NLL)
  double exact_ppl = 0;       // the exact model's, same tokens
  double ppl_change_pct = 0;  // 100 * (ppl / exact_ppl - 1)
  double mean_kl = 0;         // mean over tokens of KL(exact || variant), nats
  double top1_agreement = 0;  // share of tokens whose argmax (first on ties) agrees
};

// Compares two ScoreLogits results over `set`. INVALID_ARGUMENT when either
// is not [set.scored_tokens][vocab].
absl::StatusOr<Metrics> Compare(const EvalSet& set, absl::Span<const float> exact,
                                absl::Span<const float> variant, int64_t vocab);

// One way of running the model.
struct Variant {
  std::string name;                                  // e.g. "deferral 2", "int4 g64"
  int deferred_experts = 0;                          // ModelOptions::deferred_experts
  bool service_experts = false;                      // false: the fp32 reference experts
  WeightFormat format = WeightFormat::kBf16;         // service_experts: the shard's format
  int group = 0;                                     // kInt4: the group along K
  std::optional<double> max_ppl_change_pct;          // the target, when there is one
  DenseWeights dense_weights = DenseWeights::kAuto;  // ModelOptions::weights
  KvDtype kv_dtype = KvDtype::kF32;  // ModelOptions::kv_dtype (the exact model's: f32)
};

// Deferral 0..3 on the reference experts, then the service's experts in
// bf16, int8 and int4 groups 32 / 64 / 128, with issue 30's targets
// (deferral 2 and int8: +0.5%, int4: +3%), then the model's own dense
// weights (ModelOptions::weights) in fp8, int8 and int4 with issue 50's
// (fp8 and int8: +0.3%, int4: +2%), then the KV cache in bf16 and fp8
// (fp8: +0.5%).
std::vector<Variant> StandardVariants();

// A variant ready to score. Members are destroyed model first.
struct LoadedVariant {
  std::unique_ptr<ExpertShard> shard;      // service_experts only
  std::unique_ptr<RoutedExperts> experts;  // over `shard`; null: the reference
  std::unique_ptr<Model> model;
};

// The CPU reference model of `dir` on `threads` threads (0: all), with the
// variant's deferral and experts: the service's shard is loaded in-process
// from the same checkpoint (ExpertShard::Load, the service's quantization
// and kernels) behind HandlerRoutedExperts. The shard's error is passed on
// as is (a format the kernels do not take: INVALID_ARGUMENT / UNIMPLEMENTED).
absl::StatusOr<LoadedVariant> LoadVariant(const std::string& dir, const Variant& v, int threads);

}  // namespace hmoe::accuracy
