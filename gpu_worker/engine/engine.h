// Engine: runs generation requests on a Model — admission, KV block
// accounting, chunked prefill, decode of all running requests each step,
// sampling, stop conditions, streaming, cancellation and deadlines.
//
// One scheduler thread owns all model calls. Each step it (1) retires
// cancelled / expired requests, (2) admits waiting requests while KV blocks
// and batch slots allow, (3) runs one Model::ForwardBatch over at most
// `prefill_chunk` prompt tokens (chunks of the prefilling requests, oldest
// first, so a long prompt never stalls the running ones for long and short
// prompts that arrive together start together) and one token of every
// other running request (the token sampled after its last pass), and
// (4) samples each request's next token from that pass. A batch that fails
// for what may be one request's reason (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
// OUT_OF_RANGE, INTERNAL) is re-run step by step so only that request fails;
// any other failure (e.g. the expert service UNAVAILABLE) fails every request
// in it.
//
// KV accounting: the cache is counted in blocks of `kv_block_tokens`; a
// request reserves ceil((prompt + max_tokens) / kv_block_tokens) blocks when
// admitted (so it can never run out mid-way) and returns them the moment it
// finishes, fails, is cancelled or passes its deadline.  With a backend that has a
// paged KV pool (Model::kv_blocks_total(), cuda) the engine's budget is that
// pool: the blocks a request reserves are the ones its Sequence takes as it
// grows and returns when it ends.
//
// Every submitted request ends with exactly one final event (finish set),
// delivered on the scheduler thread: callbacks must not block.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/engine/sampling.h"
#include "gpu_worker/model.h"

namespace hmoe {

// The metrics an Engine with EngineOptions::metrics keeps:
//   hmoe_requests_finished_total{outcome}  counter: stop, length, stop_string,
//       cancelled (incl. shut out by a shutdown), deadline, error (final
//       events by FinishReasonName), rejected (queue full at Submit)
//   hmoe_prompt_tokens_total               counter: prompt tokens prefilled
//   hmoe_generation_tokens_total           counter: tokens generated (sum of
//       completion_tokens)
//   hmoe_requests_waiting, hmoe_requests_running, hmoe_kv_blocks_used,
//   hmoe_kv_blocks_capacity                gauges, as EngineStats (capacity:
//                                          kv_blocks_total)
//   hmoe_time_to_first_token_seconds       histogram: submit -> first token
//   hmoe_inter_token_latency_seconds       histogram: per token after the first
//   hmoe_request_duration_seconds          histogram: submit -> final event,
//       every final event
//   hmoe_request_queue_seconds             histogram: submit -> admission
//   hmoe_forward_pass_seconds{kind}        histogram: one ForwardBatch;
//       kind prefill (prompt chunks only), decode (decode tokens only), mixed
struct EngineOptions {
  int max_batch = 16;            // requests decoded per step
  int max_queue = 64;            // waiting requests; a full queue -> RESOURCE_EXHAUSTED
  int64_t kv_block_tokens = 16;  // tokens per KV block
  int64_t kv_blocks = 0;         // total blocks; 0: max_batch * ceil(max_seq_len / kv_block_tokens)
  int64_t prefill_chunk = 64;    // prompt tokens per scheduler step, all requests together
  uint64_t seed = 0x9e3779b97f4a7c15ull;  // base for requests without a seed
  // Borrowed; outlives the engine. Null: no metrics (nothing measured).
  // Create registers the metrics above in it (an error there fails
  // Create); one engine per registry (a second shares the same series).
  MetricsRegistry* metrics = nullptr;
};

enum class FinishReason { kNone, kLength, kStopToken, kStopString, kCancelled, kDeadline, kError };
const char* FinishReasonName(FinishReason r);

// Bounds on a request's stop conditions (each is checked after every token).
inline constexpr size_t kMaxStopTokenIds = 1024;
inline constexpr size_t kMaxStopStrings = 64;
inline constexpr size_t kMaxStopStringBytes = 1024;
// Alternatives a request may ask for with each token's logprob.
inline constexpr int32_t kMaxTopLogprobs = 20;

struct GenerateRequest {
  std::vector<int32_t> prompt;  // token ids, non-empty
  SamplingParams sampling;
  int32_t max_tokens = 16;  // >= 1
  // In addition to the model's eos (unless ignore_eos); <= kMaxStopTokenIds.
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // UTF-8, non-empty, <= kMaxStopStrings of <= kMaxStopStringBytes; needs a
  // tokenizer. Errors name them "stop" (the API's field).
  std::vector<std::string> stop_strings;
  absl::Time deadline = absl::InfiniteFuture();
  // -1: none; 0..kMaxTopLogprobs: each generated token's logprob and that
  // many most likely alternatives (LogprobOf, sampling.h).
  int32_t logprobs = -1;
};

// What Engine::Submit checks a request against.
struct RequestLimits {
  int64_t vocab_size = 0;
  int64_t max_context = 0;           // prompt + generated tokens (Engine::max_context)
  bool context_is_kv_bound = false;  // max_context is the KV cache's size, not the model's
  int64_t kv_blocks = 0, kv_block_tokens = 0;
  bool has_tokenizer = false;  // stop strings need one
};

// INVALID_ARGUMENT naming the field for a request Submit refuses; on success
// clamps req->max_tokens to what the context has room for and returns the
// KV blocks the request will hold and its stop strings' longest length.
struct RequestFootprint {
  int64_t kv_blocks = 0;
  size_t longest_stop = 0;
};
absl::StatusOr<RequestFootprint> CheckGenerateRequest(const RequestLimits& limits,
                                                      GenerateRequest* req);

struct GenerateEvent {
  uint64_t request_id = 0;
  std::vector<int32_t> token_ids;      // new tokens in this event
  std::vector<TokenLogprob> logprobs;  // one per token_ids entry, when the request asked
  std::string text;                    // new text (valid UTF-8; empty without a tokenizer)
  FinishReason finish = FinishReason::kNone;
  absl::Status status;  // non-OK with kError / kDeadline / kCancelled
  // Set on the final event.
  std::string stop_string;  // kStopString: the stop string that matched (first in the text)
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // prefill_ms / decode_ms: wall time of the forward passes that carried
  // this request's prompt chunks / generated tokens. A pass is shared by all
  // running requests, so these include the others' work and sum to more
  // than the wall time across requests.
  double queue_ms = 0, prefill_ms = 0, decode_ms = 0, time_to_first_token_ms = 0;
};

struct EngineStats {
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_used = 0;
  int64_t running = 0;
  int64_t waiting = 0;
  int64_t completed = 0;  // ended for any reason
  int64_t rejected = 0;   // RESOURCE_EXHAUSTED at submit
  int64_t tokens_generated = 0;
};

class Engine {
 public:
  using Callback = std::function<void(const GenerateEvent&)>;

  // `model` and `tokenizer` (may be null: no text, no stop strings) are borrowed.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Model* model,
                                                        const Tokenizer* tokenizer,
                                                        const EngineOptions& options);
  ~Engine();  // Shutdown(0) if still running

  // Validates the request (INVALID_ARGUMENT naming the field), then queues it
  // (RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE after Shutdown
  // began). Returns the request id.
  absl::StatusOr<uint64_t> Submit(GenerateRequest request, Callback callback);
  // Ends the request with kCancelled at the next step; unknown ids are ignored.
  void Cancel(uint64_t request_id);
  EngineStats stats() const;
  const EngineOptions& options() const { return options_; }
  // Tokens one request may hold (prompt + generated): the model's
  // max_seq_len, or less when the whole KV cache (kv_blocks) is smaller.
  int64_t max_context() const { return max_seq_len_; }

  // Refuses new requests, lets running and queued ones finish until `drain`
  // has passed, then ends the rest UNAVAILABLE ("worker shutting down") and
  // stops the scheduler thread.
  void Shutdown(absl::Duration drain);

 private:
  struct Request;
  struct Metrics;
  Engine(const Model* model, const Tokenizer* tokenizer, const EngineOptions& options);
  void Loop();
  void Finish(Request& r, FinishReason reason, absl::Status status);
  // Returns an admitted request's KV blocks and batch slot to the budget
  // (once; mu_ held).
  void ReleaseBlocks(Request& r);
  void EmitToken(Request& r, int32_t token);
  void Step();
  void SampleNext(Request& r);
  // Sets the gauges from stats_ (mu_ held; metrics_ set).
  void PublishGauges();

  const Model* model_;
  const Tokenizer* tokenizer_;
  EngineOptions options_;
  int64_t max_seq_len_ = 0;
  std::vector<int32_t> eos_ids_;
  std::unique_ptr<Metrics> metrics_;  // null without EngineOptions::metrics

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> waiting_;        // guarded by mu_
  std::vector<std::unique_ptr<Request>> running_;       // scheduler thread only
  std::vector<uint64_t> cancels_;                       // guarded by mu_
  bool shutting_down_ = false;                          // guarded by mu_
  absl::Time drain_deadline_ = absl::InfiniteFuture();  // guarded by mu_
  uint64_t next_id_ = 1;                                // guarded by mu_
  EngineStats stats_;                                   // guarded by mu_
  std::thread thread_;
};

}  // namespace hmoe
