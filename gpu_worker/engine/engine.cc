#include "gpu_worker/engine/engine.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace hmoe {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return "none";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kStopToken:
      return "stop";
    case FinishReason::kStopString:
      return "stop_string";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kDeadline:
      return "deadline";
    case FinishReason::kError:
      return "error";
  }
  return "?";
}

struct Engine::Request {
  uint64_t id = 0;
  GenerateRequest req;
  Callback cb;
  int64_t blocks = 0;
  std::unique_ptr<Sequence> seq;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StreamDecoder> decoder;
  std::vector<int32_t> output;
  std::vector<int32_t> unsent_ids;
  std::vector<TokenLogprob> unsent_logprobs;  // with req.logprobs >= 0
  int64_t prefilled = 0;
  std::vector<float> logits;  // logits of the last forward pass
  int32_t pending = -1;       // sampled, emitted, not yet in the cache (next step's token)
  std::string text;
  size_t text_sent = 0;
  size_t stop_holdback = 0;   // longest stop string - 1
  std::string stop_matched;   // the stop string that ended it
  bool cancelled = false;     // by the client
  bool shut_out = false;      // still unfinished when the shutdown drain ran out
  bool holds_blocks = false;  // admitted: `blocks` counted in stats_.kv_blocks_used
  bool done = false;
  absl::Time submitted, admitted, first_token;
  absl::Time last_token;  // with metrics only
  double prefill_ms = 0, decode_ms = 0;
};

namespace {
enum PassKind { kPrefillPass, kDecodePass, kMixedPass };
}  // namespace

// Child pointers, looked up once at Create.
struct Engine::Metrics {
  static absl::StatusOr<std::unique_ptr<Metrics>> Register(MetricsRegistry& reg);

  Counter* finished[static_cast<int>(FinishReason::kError) + 1] = {};  // by FinishReason
  Counter* rejected = nullptr;
  Counter* prompt_tokens = nullptr;
  Counter* generation_tokens = nullptr;
  Gauge* waiting = nullptr;
  Gauge* running = nullptr;
  Gauge* kv_used = nullptr;
  Gauge* kv_total = nullptr;
  Histogram* ttft = nullptr;
  Histogram* itl = nullptr;
  Histogram* e2e = nullptr;
  Histogram* queue = nullptr;
  Histogram* pass[3] = {};  // PassKind
};

namespace {
double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }
// Failures a batch may owe to one request: the steps are re-run one by one
// to find whose it was. INTERNAL is the worker's own failure on some input
// (one request's NaN hidden states reaching the router, an expert call the
// service refused as malformed): re-run too, so it stays with the request
// it came from. Anything else (the expert service gone, ...) is every step's
// failure. (RESOURCE_EXHAUSTED here is the model's own capacity check:
// PoolRoutedExperts reports transport failures as UNAVAILABLE.)
bool StepSpecific(const absl::Status& s) {
  return absl::IsInvalidArgument(s) || absl::IsResourceExhausted(s) || absl::IsOutOfRange(s) ||
         absl::IsInternal(s);
}

// api.proto: a worker shutting down answers UNAVAILABLE (the client may retry
// elsewhere); CANCELLED is only for what the client cancelled itself.
absl::Status ShutOutStatus() {
  return absl::UnavailableError(
      "worker shutting down: the drain time ran out before this request finished");
}
}  // namespace

absl::StatusOr<std::unique_ptr<Engine::Metrics>> Engine::Metrics::Register(MetricsRegistry& reg) {
  auto m = std::make_unique<Metrics>();
  ASSIGN_OR_RETURN(
      CounterFamily finished,
      reg.AddCounterFamily("hmoe_requests_finished_total",
                           "Generation requests ended, by outcome: the final event's finish "
                           "reason, or rejected (the queue was full at submit).",
                           {"outcome"}));
  for (FinishReason r : {FinishReason::kStopToken, FinishReason::kLength, FinishReason::kStopString,
                         FinishReason::kCancelled, FinishReason::kDeadline, FinishReason::kError}) {
    ASSIGN_OR_RETURN(m->finished[static_cast<int>(r)], finished.WithLabels({FinishReasonName(r)}));
  }
  ASSIGN_OR_RETURN(m->finished[static_cast<int>(FinishReason::kNone)],
                   finished.WithLabels({"error"}));  // not reached: every end has a reason
  ASSIGN_OR_RETURN(m->rejected, finished.WithLabels({"rejected"}));
  ASSIGN_OR_RETURN(m->prompt_tokens,
                   reg.AddCounter("hmoe_prompt_tokens_total", "Prompt tokens prefilled."));
  ASSIGN_OR_RETURN(m->generation_tokens,
                   reg.AddCounter("hmoe_generation_tokens_total", "Tokens generated."));
  ASSIGN_OR_RETURN(m->waiting,
                   reg.AddGauge("hmoe_requests_waiting", "Requests queued, not yet admitted."));
  ASSIGN_OR_RETURN(m->running, reg.AddGauge("hmoe_requests_running",
                                            "Requests admitted (prefilling or decoding)."));
  ASSIGN_OR_RETURN(m->kv_used, reg.AddGauge("hmoe_kv_blocks_used",
                                            "KV cache blocks reserved by running requests."));
  ASSIGN_OR_RETURN(m->kv_total, reg.AddGauge("hmoe_kv_blocks_capacity",
                                             "KV cache blocks in all (the engine's budget)."));
  // Buckets for LLM serving: first tokens from milliseconds (a short prompt)
  // to a minute (a long prefill behind a queue); tokens from 1 ms to 5 s.
  ASSIGN_OR_RETURN(m->ttft, reg.AddHistogram("hmoe_time_to_first_token_seconds",
                                             "From submit to the first generated token.",
                                             {0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                              0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 60}));
  ASSIGN_OR_RETURN(m->itl, reg.AddHistogram("hmoe_inter_token_latency_seconds",
                                            "Between consecutive generated tokens of a request.",
                                            {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15,
                                             0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5}));
  ASSIGN_OR_RETURN(
      m->e2e, reg.AddHistogram(
                  "hmoe_request_duration_seconds", "From submit to the final event, any outcome.",
                  {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600}));
  ASSIGN_OR_RETURN(m->queue, reg.AddHistogram("hmoe_request_queue_seconds",
                                              "From submit to admission (KV blocks and a batch "
                                              "slot free).",
                                              {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                               10, 30, 60}));
  ASSIGN_OR_RETURN(
      HistogramFamily pass,
      reg.AddHistogramFamily(
          "hmoe_forward_pass_seconds",
          "One forward pass (Model::ForwardBatch) by kind: prefill (prompt "
          "chunks only), decode (decode tokens only) or mixed.",
          {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}, {"kind"}));
  ASSIGN_OR_RETURN(m->pass[kPrefillPass], pass.WithLabels({"prefill"}));
  ASSIGN_OR_RETURN(m->pass[kDecodePass], pass.WithLabels({"decode"}));
  ASSIGN_OR_RETURN(m->pass[kMixedPass], pass.WithLabels({"mixed"}));
  return m;
}

Engine::Engine(const Model* model, const Tokenizer* tokenizer, const EngineOptions& options)
    : model_(model), tokenizer_(tokenizer), options_(options) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Model* model,
                                                       const Tokenizer* tokenizer,
                                                       const EngineOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("engine needs a model");
  EngineOptions o = options;
  if (o.max_batch < 1)
    return absl::InvalidArgumentError(absl::StrCat("max_batch must be >= 1, got ", o.max_batch));
  // Every request waits in the queue at least until the next scheduler step.
  if (o.max_queue < 1)
    return absl::InvalidArgumentError(absl::StrCat("max_queue must be >= 1, got ", o.max_queue));
  if (o.kv_block_tokens < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("kv_block_tokens must be >= 1, got ", o.kv_block_tokens));
  if (o.prefill_chunk < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk must be >= 1, got ", o.prefill_chunk));
  const int64_t max_seq = model->options().max_seq_len;
  if (max_seq < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("the model's max_seq_len must be >= 1, got ", max_seq));
  if (model->kv_blocks_total() > 0) {
    // The backend's paged cache is the budget: the engine's accounting
    // reserves exactly the blocks the Sequences will take from it.
    if (o.kv_block_tokens != model->kv_block_tokens())
      return absl::InvalidArgumentError(absl::StrCat("kv_block_tokens ", o.kv_block_tokens,
                                                     " differs from the model's KV block of ",
                                                     model->kv_block_tokens(), " tokens"));
    if (o.kv_blocks > model->kv_blocks_total())
      return absl::InvalidArgumentError(absl::StrCat("kv_blocks ", o.kv_blocks,
                                                     " exceeds the model's KV cache of ",
                                                     model->kv_blocks_total(), " blocks"));
    if (o.kv_blocks == 0) o.kv_blocks = model->kv_blocks_total();
  }
  if (o.kv_blocks == 0) {
    // In 128 bits: max_batch x max_seq_len can pass int64 for absurd settings.
    // Rounded per request, as each reserves whole blocks: max_batch requests
    // of the full context fit together.
    const __int128 blocks =
        static_cast<__int128>(o.max_batch) *
        ((static_cast<__int128>(max_seq) + o.kv_block_tokens - 1) / o.kv_block_tokens);
    if (blocks > (__int128{1} << 40))
      return absl::InvalidArgumentError(absl::StrCat(
          "max_batch ", o.max_batch, " x max_seq_len ", max_seq, " tokens is more KV cache than ",
          "any machine holds; lower the batch or the context"));
    o.kv_blocks = static_cast<int64_t>(blocks);
  }
  if (o.kv_blocks < 1)
    return absl::InvalidArgumentError(absl::StrCat("kv_blocks must be >= 1, got ", o.kv_blocks));
  std::unique_ptr<Engine::Metrics> metrics;
  if (o.metrics != nullptr) {
    ASSIGN_OR_RETURN(metrics, Metrics::Register(*o.metrics));
  }
  std::unique_ptr<Engine> e(new Engine(model, tokenizer, o));
  e->metrics_ = std::move(metrics);
  // A cache smaller than one context bounds every request's context too.
  e->max_seq_len_ = static_cast<int64_t>(
      std::min<__int128>(max_seq, static_cast<__int128>(o.kv_blocks) * o.kv_block_tokens));
  for (int64_t id : model->config().eos_token_ids) e->eos_ids_.push_back(static_cast<int32_t>(id));
  e->stats_.kv_blocks_total = o.kv_blocks;
  if (e->metrics_) e->PublishGauges();
  e->thread_ = std::thread([p = e.get()] { p->Loop(); });
  return e;
}

Engine::~Engine() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<RequestFootprint> CheckGenerateRequest(const RequestLimits& l, GenerateRequest* r) {
  GenerateRequest& req = *r;
  const int64_t V = l.vocab_size;
  if (l.kv_block_tokens <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("request limits: kv_block_tokens must be > 0, got ", l.kv_block_tokens));
  if (req.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < req.prompt.size(); ++i)
    if (req.prompt[i] < 0 || req.prompt[i] >= V)
      return absl::InvalidArgumentError(absl::StrCat("prompt token id ", req.prompt[i],
                                                     " at position ", i,
                                                     " is outside the vocabulary [0, ", V, ")"));
  if (req.max_tokens < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must be >= 1, got ", req.max_tokens));
  const int64_t prompt_len = static_cast<int64_t>(req.prompt.size());
  if (prompt_len >= l.max_context)
    return absl::InvalidArgumentError(
        absl::StrCat("prompt has ", prompt_len, " tokens; the context holds ", l.max_context,
                     l.context_is_kv_bound ? " (the KV cache's size)" : "",
                     " (prompt plus at least one generated token)"));
  // Generation stops at the context length (finish reason "length").
  req.max_tokens =
      static_cast<int32_t>(std::min<int64_t>(req.max_tokens, l.max_context - prompt_len));
  RETURN_IF_ERROR(ValidateSamplingParams(req.sampling));
  if (req.logprobs < -1 || req.logprobs > kMaxTopLogprobs)
    return absl::InvalidArgumentError(
        absl::StrCat("logprobs: ", req.logprobs, " outside [-1, ", kMaxTopLogprobs, "]"));
  // Bounded: every stop token and string is checked after each new token.
  if (req.stop_token_ids.size() > kMaxStopTokenIds)
    return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: ", req.stop_token_ids.size(),
                                                   " ids; at most ", kMaxStopTokenIds));
  for (int32_t t : req.stop_token_ids)
    if (t < 0 || t >= V)
      return absl::InvalidArgumentError(
          absl::StrCat("stop_token_ids: ", t, " is outside the vocabulary [0, ", V, ")"));
  if (req.stop_strings.size() > kMaxStopStrings)
    return absl::InvalidArgumentError(
        absl::StrCat("stop: ", req.stop_strings.size(), " strings; at most ", kMaxStopStrings));
  RequestFootprint f;
  for (size_t i = 0; i < req.stop_strings.size(); ++i) {
    const std::string& s = req.stop_strings[i];
    if (s.empty()) return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is empty"));
    if (s.size() > kMaxStopStringBytes)
      return absl::InvalidArgumentError(
          absl::StrCat("stop[", i, "]: ", s.size(), " bytes; at most ", kMaxStopStringBytes));
    size_t held = 0;
    if (SanitizeUtf8(s, false, &held) != s)
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is not valid UTF-8"));
    f.longest_stop = std::max(f.longest_stop, s.size());
  }
  if (!req.stop_strings.empty() && !l.has_tokenizer)
    return absl::InvalidArgumentError("stop: stop strings need a tokenizer; this engine has none");
  f.kv_blocks = (prompt_len + req.max_tokens + l.kv_block_tokens - 1) / l.kv_block_tokens;
  if (f.kv_blocks > l.kv_blocks)
    return absl::InvalidArgumentError(absl::StrCat("prompt + max_tokens need ", f.kv_blocks,
                                                   " KV blocks; the cache has ", l.kv_blocks));
  return f;
}

absl::StatusOr<uint64_t> Engine::Submit(GenerateRequest req, Callback cb) {
  RequestLimits limits;
  limits.vocab_size = model_->config().vocab_size;
  limits.max_context = max_seq_len_;
  limits.context_is_kv_bound = max_seq_len_ < model_->options().max_seq_len;
  limits.kv_blocks = options_.kv_blocks;
  limits.kv_block_tokens = options_.kv_block_tokens;
  limits.has_tokenizer = tokenizer_ != nullptr;
  ASSIGN_OR_RETURN(const RequestFootprint f, CheckGenerateRequest(limits, &req));
  auto r = std::make_unique<Request>();
  r->req = std::move(req);
  r->cb = std::move(cb);
  r->blocks = f.kv_blocks;
  r->stop_holdback = f.longest_stop > 0 ? f.longest_stop - 1 : 0;
  r->submitted = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  if (shutting_down_)
    return absl::UnavailableError("engine is shutting down; not accepting requests");
  if (static_cast<int64_t>(waiting_.size()) >= options_.max_queue) {
    ++stats_.rejected;
    if (metrics_) metrics_->rejected->Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("request queue is full (", options_.max_queue, " waiting); retry later"));
  }
  r->id = next_id_++;
  const uint64_t id = r->id;
  waiting_.push_back(std::move(r));
  stats_.waiting = static_cast<int64_t>(waiting_.size());
  if (metrics_) PublishGauges();
  cv_.notify_all();
  return id;
}

void Engine::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  cancels_.push_back(id);
  cv_.notify_all();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void Engine::Shutdown(absl::Duration drain) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!shutting_down_) {
      shutting_down_ = true;
      drain_deadline_ = absl::Now() + drain;
    } else {
      drain_deadline_ = std::min(drain_deadline_, absl::Now() + drain);
    }
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void Engine::ReleaseBlocks(Request& r) {
  if (!r.holds_blocks) return;
  stats_.kv_blocks_used -= r.blocks;
  --stats_.running;
  r.holds_blocks = false;
  if (metrics_) PublishGauges();
}

void Engine::PublishGauges() {
  metrics_->waiting->Set(static_cast<double>(stats_.waiting));
  metrics_->running->Set(static_cast<double>(stats_.running));
  metrics_->kv_used->Set(static_cast<double>(stats_.kv_blocks_used));
  metrics_->kv_total->Set(static_cast<double>(stats_.kv_blocks_total));
}

void Engine::Finish(Request& r, FinishReason reason, absl::Status status) {
  if (r.done) return;
  r.done = true;
  GenerateEvent ev;
  ev.request_id = r.id;
  ev.token_ids = std::move(r.unsent_ids);
  ev.logprobs = std::move(r.unsent_logprobs);
  if (r.decoder) r.text += r.decoder->Finish();
  ev.text = r.text.substr(std::min(r.text_sent, r.text.size()));
  r.text_sent = r.text.size();
  ev.finish = reason;
  ev.status = std::move(status);
  if (reason == FinishReason::kStopString) ev.stop_string = r.stop_matched;
  ev.prompt_tokens = static_cast<int64_t>(r.req.prompt.size());
  ev.completion_tokens = static_cast<int64_t>(r.output.size());
  const absl::Time now = absl::Now();
  const absl::Time admitted = r.admitted == absl::Time() ? now : r.admitted;
  ev.queue_ms = Ms(admitted - r.submitted);
  ev.prefill_ms = r.prefill_ms;
  ev.decode_ms = r.decode_ms;
  ev.time_to_first_token_ms = r.first_token == absl::Time() ? 0 : Ms(r.first_token - r.submitted);
  if (metrics_) {
    metrics_->finished[static_cast<int>(reason)]->Increment();
    metrics_->e2e->Observe(absl::ToDoubleSeconds(now - r.submitted));
  }
  r.seq.reset();  // frees the KV storage now
  {
    // Accounting is settled before the final event, so a client that sees
    // the end of its request also sees its blocks returned.
    std::lock_guard<std::mutex> lock(mu_);
    ReleaseBlocks(r);
    ++stats_.completed;
  }
  if (r.cb) r.cb(ev);
}

// Appends a sampled token; checks stop conditions; emits what can be emitted.
void Engine::EmitToken(Request& r, int32_t token) {
  const bool first = r.first_token == absl::Time();
  if (first || metrics_) {
    const absl::Time now = absl::Now();
    if (first) r.first_token = now;
    if (metrics_) {
      if (first)
        metrics_->ttft->Observe(absl::ToDoubleSeconds(now - r.submitted));
      else
        metrics_->itl->Observe(absl::ToDoubleSeconds(now - r.last_token));
      metrics_->generation_tokens->Increment();
    }
    r.last_token = now;
  }
  r.output.push_back(token);
  r.unsent_ids.push_back(token);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.tokens_generated;
  }
  if (r.decoder) {
    auto piece = r.decoder->Push(token);
    if (piece.ok()) r.text += *piece;
  }
  const bool is_stop_token =
      std::find(r.req.stop_token_ids.begin(), r.req.stop_token_ids.end(), token) !=
          r.req.stop_token_ids.end() ||
      (!r.req.ignore_eos && std::find(eos_ids_.begin(), eos_ids_.end(), token) != eos_ids_.end());
  if (!r.req.stop_strings.empty()) {
    const size_t from = r.text_sent > r.stop_holdback ? r.text_sent - r.stop_holdback : 0;
    size_t cut = std::string::npos;
    for (const std::string& s : r.req.stop_strings) {
      const size_t at = r.text.find(s, from);
      if (at < cut) {
        cut = at;
        r.stop_matched = s;
      }
    }
    if (cut != std::string::npos) {
      r.text.resize(cut);  // the stop string and what follows are not returned
      if (r.decoder)
        r.decoder = std::make_unique<StreamDecoder>(*tokenizer_, true);  // drop held bytes
      Finish(r, FinishReason::kStopString, absl::OkStatus());
      return;
    }
  }
  if (is_stop_token) return Finish(r, FinishReason::kStopToken, absl::OkStatus());
  if (static_cast<int64_t>(r.output.size()) >= r.req.max_tokens)
    return Finish(r, FinishReason::kLength, absl::OkStatus());
  // Hold back a possible stop-string prefix, on a UTF-8 character boundary.
  size_t safe = r.text.size() > r.stop_holdback ? r.text.size() - r.stop_holdback : 0;
  while (safe > r.text_sent && safe < r.text.size() &&
         (static_cast<uint8_t>(r.text[safe]) & 0xc0) == 0x80)
    --safe;
  GenerateEvent ev;
  ev.request_id = r.id;
  ev.token_ids = std::move(r.unsent_ids);
  r.unsent_ids.clear();
  ev.logprobs = std::move(r.unsent_logprobs);
  r.unsent_logprobs.clear();
  if (safe > r.text_sent) {
    ev.text = r.text.substr(r.text_sent, safe - r.text_sent);
    r.text_sent = safe;
  }
  if (r.cb) r.cb(ev);
}

// Samples the next token from the logits of the request's last forward pass
// and emits it; unless that ends the request, the token goes into the next
// step's batch.
void Engine::SampleNext(Request& r) {
  const absl::StatusOr<int32_t> token = r.sampler->Sample(r.logits, r.req.prompt, r.output);
  if (!token.ok()) {
    Finish(r, FinishReason::kError, token.status());
    return;
  }
  if (r.req.logprobs >= 0) r.unsent_logprobs.push_back(LogprobOf(r.logits, *token, r.req.logprobs));
  EmitToken(r, *token);
  if (!r.done) r.pending = *token;
}

void Engine::Step() {
  struct Entry {
    Request* r;
    int64_t prefill;  // prompt tokens in this step; 0: one decode token
  };
  std::vector<Entry> entries;
  // Prompt chunks, oldest request first, up to prefill_chunk tokens in all.
  int64_t budget = options_.prefill_chunk;
  for (auto& r : running_) {
    const int64_t P = static_cast<int64_t>(r->req.prompt.size());
    if (budget == 0) break;
    if (r->done || r->prefilled >= P) continue;
    const int64_t n = std::min(budget, P - r->prefilled);
    entries.push_back({r.get(), n});
    budget -= n;
  }
  // Every request with a sampled token not yet in its cache gives that token.
  for (auto& r : running_)
    if (!r->done && r->pending >= 0) entries.push_back({r.get(), 0});
  if (entries.empty()) return;
  std::vector<ForwardStep> steps;
  steps.reserve(entries.size());
  for (const Entry& e : entries) {
    Request& r = *e.r;
    ForwardStep st;
    st.seq = r.seq.get();
    st.tokens = e.prefill > 0 ? absl::MakeConstSpan(r.req.prompt.data() + r.prefilled,
                                                    static_cast<size_t>(e.prefill))
                              : absl::MakeConstSpan(&r.pending, 1);
    st.mode = LogitsMode::kLast;
    st.logits = &r.logits;
    steps.push_back(st);
  }
  auto run = [&](absl::Span<const ForwardStep> s, PassKind kind) {
    const absl::Time t0 = absl::Now();
    absl::Status st = model_->ForwardBatch(s);
    const absl::Duration took = absl::Now() - t0;
    if (metrics_) metrics_->pass[kind]->Observe(absl::ToDoubleSeconds(took));
    return std::make_pair(st, Ms(took));
  };
  auto settle = [&](const Entry& e, const absl::Status& st, double ms) {
    Request& r = *e.r;
    if (!st.ok()) return Finish(r, FinishReason::kError, st);
    if (e.prefill > 0) {
      if (metrics_) metrics_->prompt_tokens->Increment(static_cast<double>(e.prefill));
      r.prefill_ms += ms;
      r.prefilled += e.prefill;
      if (r.prefilled == static_cast<int64_t>(r.req.prompt.size())) SampleNext(r);
    } else {
      r.decode_ms += ms;
      r.pending = -1;
      SampleNext(r);
    }
  };
  const bool any_prefill = entries.front().prefill > 0;  // prompt chunks come first
  const bool any_decode = entries.back().prefill == 0;
  auto [status, ms] = run(steps, any_prefill && any_decode ? kMixedPass
                                 : any_prefill             ? kPrefillPass
                                                           : kDecodePass);
  if (status.ok() || steps.size() == 1 || !StepSpecific(status)) {
    for (const Entry& e : entries) settle(e, status, ms);
    return;
  }
  // A failed batch changed no Sequence: each step again on its own, until a
  // step fails for everyone's reason (then the rest fail with it unrun).
  for (size_t i = 0; i < entries.size(); ++i) {
    auto [st, one_ms] =
        run(absl::MakeConstSpan(&steps[i], 1), entries[i].prefill > 0 ? kPrefillPass : kDecodePass);
    settle(entries[i], st, one_ms);
    if (!st.ok() && !StepSpecific(st)) {
      for (size_t j = i + 1; j < entries.size(); ++j) settle(entries[j], st, 0);
      return;
    }
  }
}

void Engine::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<Request>> ended;  // finished while waiting: callbacks after unlock
    std::vector<std::unique_ptr<Request>> leaving;  // running ones ending now: likewise
    std::vector<std::pair<Request*, FinishReason>> to_finish;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const absl::Time now = absl::Now();
      for (uint64_t id : cancels_) {
        for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
          if ((*it)->id == id) {
            (*it)->cancelled = true;
            break;
          }
        }
        for (auto& r : running_)
          if (r->id == id) r->cancelled = true;
      }
      cancels_.clear();
      const bool drain_over = shutting_down_ && now >= drain_deadline_;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        Request& r = **it;
        if (r.cancelled || drain_over || now >= r.req.deadline) {
          r.shut_out = drain_over && !r.cancelled;
          ended.push_back(std::move(*it));
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      // Running requests that end now (shut out, deadline, cancel) leave
      // before admission: their slots and blocks go to this pass's
      // newcomers, not to the one after.
      if (drain_over)
        for (auto& r : running_) r->shut_out = r->shut_out || !r->cancelled;
      for (auto it = running_.begin(); it != running_.end();) {
        Request& r = **it;
        if (r.shut_out || now >= r.req.deadline || r.cancelled) {
          ReleaseBlocks(r);
          leaving.push_back(std::move(*it));
          it = running_.erase(it);
        } else {
          ++it;
        }
      }
      while (!waiting_.empty() && static_cast<int>(running_.size()) < options_.max_batch &&
             stats_.kv_blocks_used + waiting_.front()->blocks <= options_.kv_blocks) {
        std::unique_ptr<Request> r = std::move(waiting_.front());
        waiting_.pop_front();
        stats_.kv_blocks_used += r->blocks;
        ++stats_.running;
        r->holds_blocks = true;
        r->admitted = now;
        if (metrics_) metrics_->queue->Observe(absl::ToDoubleSeconds(now - r->submitted));
        running_.push_back(std::move(r));
      }
      stats_.waiting = static_cast<int64_t>(waiting_.size());
      if (metrics_) PublishGauges();
      if (running_.empty() && ended.empty() && leaving.empty()) {
        if (shutting_down_ && waiting_.empty()) break;
        cv_.wait_for(lock, std::chrono::milliseconds(20));
        continue;
      }
    }
    // A deadline that has passed wins over a cancel: the gRPC layer cancels
    // a call when its deadline passes, and that is still the deadline.
    const absl::Time ended_at = absl::Now();
    auto end_all = [&](std::vector<std::unique_ptr<Request>>& rs, const char* deadline_msg) {
      for (auto& r : rs) {
        if (r->shut_out)
          Finish(*r, FinishReason::kCancelled, ShutOutStatus());
        else if (ended_at >= r->req.deadline || !r->cancelled)
          Finish(*r, FinishReason::kDeadline, absl::DeadlineExceededError(deadline_msg));
        else
          Finish(*r, FinishReason::kCancelled, absl::CancelledError("request cancelled"));
      }
      rs.clear();
    };
    end_all(ended, "deadline passed while queued");
    end_all(leaving, "deadline passed during generation");

    // New admissions get their state here, off the lock.
    for (auto& r : running_) {
      if (r->seq) continue;
      r->seq = model_->NewSequence();
      r->sampler = std::make_unique<Sampler>(r->req.sampling,
                                             options_.seed ^ (r->id * 0x9e3779b97f4a7c15ull));
      if (tokenizer_)
        r->decoder = std::make_unique<StreamDecoder>(*tokenizer_, /*skip_special_tokens=*/true);
    }
    Step();
    running_.erase(
        std::remove_if(running_.begin(), running_.end(), [](const auto& r) { return r->done; }),
        running_.end());
  }
}

}  // namespace hmoe
