// Sampling: turns one step's logits into a token, per request.
//
// Order of operations (as vLLM / transformers apply them):
//   1. repetition_penalty over tokens in prompt + output (logit > 0 ? l / p : l * p);
//   2. presence_penalty (once per distinct output token) and
//      frequency_penalty (per occurrence in the output), subtracted;
//   3. temperature == 0: greedy (argmax, lowest id on ties) — done;
//   4. divide by temperature; keep top_k (and every token tied with the
//      k-th); keep the smallest set whose probability reaches top_p; drop
//      tokens below min_p * max probability;
//   5. draw from the renormalized distribution with the request's own RNG
//      (seeded: same seed, same logits -> same tokens).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace hmoe {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // (0, 1]
  float min_p = 0.0f;        // [0, 1]
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  bool has_seed = false;
  uint64_t seed = 0;
};

// INVALID_ARGUMENT naming the field for NaN/inf, temperature < 0, top_k < 0,
// top_p outside (0, 1], min_p outside [0, 1], repetition_penalty <= 0,
// penalties outside [-2, 2].
absl::Status ValidateSamplingParams(const SamplingParams& p);

class Sampler {
 public:
  // `fallback_seed` is used when the request carries none.
  Sampler(const SamplingParams& params, uint64_t fallback_seed);

  // `prompt` and `output` are the request's tokens so far (for penalties).
  // Logits are copied; the input is not modified. -inf masks a token; a NaN
  // or +inf logit, or no finite one, is INTERNAL naming the token (a broken
  // forward pass: no token would be a sample of anything).
  absl::StatusOr<int32_t> Sample(absl::Span<const float> logits, absl::Span<const int32_t> prompt,
                                 absl::Span<const int32_t> output);

  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  struct Candidate {
    float logit;
    int32_t id;
    double weight;  // exp((logit - max) / T), set once the candidates are known
  };
  std::vector<float> work_;
  std::vector<Candidate> cands_;
  // Per-token marks of the current pass over the request's tokens
  // (== mark_gen_) and output counts, reused across calls.
  std::vector<uint32_t> mark_;
  std::vector<int32_t> count_;
  uint32_t mark_gen_ = 0;
};

// Greedy argmax (lowest id wins ties).
int32_t Argmax(absl::Span<const float> logits);

// A token's log-probability under the model's distribution: the
// log-softmax of the raw logits (before penalties, temperature and
// truncation, as vLLM reports them), and the `top` most likely tokens'
// (most likely first, lowest id first on ties; masked tokens never).
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;
};
// `logits` finite or -inf (masked), token in range; top_n >= 0.
TokenLogprob LogprobOf(absl::Span<const float> logits, int32_t token, int top_n);

}  // namespace hmoe
