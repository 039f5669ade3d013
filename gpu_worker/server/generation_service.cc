#include "gpu_worker/server/generation_service.h"

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/status.h"
#include "common/transport/grpc_auth.h"
#include "common/transport/grpc_status.h"
#include "common/weight_map.h"

namespace hmoe {
namespace {

// A directory's last component ("/models/ds3/" -> "ds3").
std::string DirectoryName(const std::string& dir) {
  std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

GenerationService::GenerationService(Engine* engine, const Model* model, const Tokenizer* tokenizer,
                                     std::string model_dir, std::string experts_backend,
                                     std::shared_ptr<const AuthTokens> auth_tokens)
    : engine_(engine),
      model_(model),
      tokenizer_(tokenizer),
      model_dir_(DirectoryName(model_dir)),
      experts_backend_(std::move(experts_backend)),
      auth_tokens_(auth_tokens ? std::move(auth_tokens) : std::make_shared<const AuthTokens>()) {}

grpc::Status GenerationService::Authorize(const grpc::ServerContext* ctx) const {
  return CheckBearer(
      *ctx, *auth_tokens_,
      "hmoe: --token-file or $HMOE_TOKEN_FILE; the C++ client: ClientOptions::auth_token");
}

absl::StatusOr<GenerateRequest> GenerationService::ToEngineRequest(
    const api::v1::GenerateRequest& req) const {
  GenerateRequest out;
  switch (req.input_case()) {
    case api::v1::GenerateRequest::kPrompt: {
      if (req.prompt().empty()) return absl::InvalidArgumentError("prompt is empty");
      if (tokenizer_ == nullptr)
        return absl::InvalidArgumentError(
            absl::StrCat("prompt: ", no_tokenizer_, "; send prompt_ids"));
      auto ids = tokenizer_->Encode(req.prompt(), req.add_special_tokens());
      if (!ids.ok()) return Annotate(ids.status(), "prompt");
      out.prompt = std::move(*ids);
      break;
    }
    case api::v1::GenerateRequest::kPromptIds:
      out.prompt.assign(req.prompt_ids().ids().begin(), req.prompt_ids().ids().end());
      break;
    case api::v1::GenerateRequest::kChat: {
      auto ids = ChatPromptIds(req.chat());
      if (!ids.ok()) return ids.status();
      out.prompt = std::move(*ids);
      break;
    }
    default:
      return absl::InvalidArgumentError("prompt is empty: set prompt or prompt_ids");
  }
  const auto& s = req.sampling();
  if (s.has_temperature()) out.sampling.temperature = s.temperature();
  if (s.has_top_k()) out.sampling.top_k = s.top_k();
  if (s.has_top_p()) out.sampling.top_p = s.top_p();
  if (s.has_min_p()) out.sampling.min_p = s.min_p();
  if (s.has_repetition_penalty()) out.sampling.repetition_penalty = s.repetition_penalty();
  if (s.has_presence_penalty()) out.sampling.presence_penalty = s.presence_penalty();
  if (s.has_frequency_penalty()) out.sampling.frequency_penalty = s.frequency_penalty();
  if (s.has_seed()) {
    out.sampling.has_seed = true;
    out.sampling.seed = s.seed();
  }
  out.max_tokens = req.max_tokens();
  out.stop_token_ids.assign(req.stop_token_ids().begin(), req.stop_token_ids().end());
  out.stop_strings.assign(req.stop().begin(), req.stop().end());
  out.ignore_eos = req.ignore_eos();
  return out;
}

absl::StatusOr<std::vector<int32_t>> GenerationService::ChatPromptIds(
    const api::v1::Chat& chat) const {
  using Json = nlohmann::ordered_json;
  if (chat_ == nullptr) return absl::InvalidArgumentError(absl::StrCat("chat: ", no_chat_));
  if (tokenizer_ == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("chat: ", no_tokenizer_));
  if (chat.messages().empty()) return absl::InvalidArgumentError("chat.messages: empty");
  auto parse = [](const std::string& text, const std::string& field,
                  bool object) -> absl::StatusOr<Json> {
    if (absl::Status s = CheckJsonDepth(text, kMaxClientJsonDepth, field); !s.ok()) return s;
    Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || (object ? !j.is_object() : !j.is_array())) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": not a JSON ", object ? "object" : "array"));
    }
    return j;
  };
  Json messages = Json::array();
  for (int i = 0; i < chat.messages_size(); ++i) {
    const api::v1::ChatMessage& m = chat.messages(i);
    const std::string p = absl::StrCat("chat.messages[", i, "]");
    if (m.role().empty()) return absl::InvalidArgumentError(p + ".role: empty");
    Json j = {{"role", m.role()}, {"content", m.content()}};
    if (!m.name().empty()) j["name"] = m.name();
    if (!m.tool_call_id().empty()) j["tool_call_id"] = m.tool_call_id();
    if (!m.reasoning_content().empty()) j["reasoning_content"] = m.reasoning_content();
    if (!m.tool_calls_json().empty()) {
      auto calls = parse(m.tool_calls_json(), p + ".tool_calls_json", false);
      if (!calls.ok()) return calls.status();
      j["tool_calls"] = std::move(*calls);
    }
    messages.push_back(std::move(j));
  }
  ChatRenderOptions ro;
  ro.add_generation_prompt = !chat.has_add_generation_prompt() || chat.add_generation_prompt();
  if (!chat.tools_json().empty()) {
    auto tools = parse(chat.tools_json(), "chat.tools_json", false);
    if (!tools.ok()) return tools.status();
    ro.tools = std::move(*tools);
  }
  if (!chat.template_kwargs_json().empty()) {
    auto kw = parse(chat.template_kwargs_json(), "chat.template_kwargs_json", true);
    if (!kw.ok()) return kw.status();
    ro.extra_context = std::move(*kw);
  }
  // Text that is not UTF-8 fails the tokenizer, named "chat".
  auto prompt = RenderChatPrompt(*chat_, *tokenizer_, messages, ro);
  if (!prompt.ok()) return Annotate(prompt.status(), "chat");
  return std::move(prompt->ids);
}

namespace {

api::v1::FinishReason ToApi(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return api::v1::FINISH_REASON_LENGTH;
    case FinishReason::kStopToken:
      return api::v1::FINISH_REASON_STOP;
    case FinishReason::kStopString:
      return api::v1::FINISH_REASON_STOP_STRING;
    default:
      return api::v1::FINISH_REASON_UNSPECIFIED;
  }
}

// Events from the engine thread to the RPC thread.
struct EventQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<GenerateEvent> events;
};

}  // namespace

grpc::Status GenerationService::Generate(grpc::ServerContext* ctx,
                                         const api::v1::GenerateRequest* req,
                                         grpc::ServerWriter<api::v1::GenerateResponse>* writer) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  const absl::Time start = absl::Now();
  auto er = ToEngineRequest(*req);
  if (!er.ok()) return ToGrpcStatus(er.status());
  const auto deadline = ctx->deadline();
  if (deadline != std::chrono::system_clock::time_point::max())
    er->deadline = absl::FromChrono(deadline);
  auto queue = std::make_shared<EventQueue>();
  auto id = engine_->Submit(std::move(*er), [queue](const GenerateEvent& ev) {
    std::lock_guard<std::mutex> lock(queue->mu);
    queue->events.push_back(ev);
    queue->cv.notify_all();
  });
  if (!id.ok()) return ToGrpcStatus(id.status());
  bool cancelled = false;
  for (;;) {
    std::deque<GenerateEvent> batch;
    {
      std::unique_lock<std::mutex> lock(queue->mu);
      queue->cv.wait_for(lock, std::chrono::milliseconds(20),
                         [&] { return !queue->events.empty(); });
      batch.swap(queue->events);
    }
    if (!cancelled && ctx->IsCancelled()) {
      engine_->Cancel(*id);  // frees the KV blocks at the next scheduler step
      cancelled = true;
    }
    for (GenerateEvent& ev : batch) {
      if (ev.finish == FinishReason::kCancelled || ev.finish == FinishReason::kDeadline ||
          ev.finish == FinishReason::kError)
        return ToGrpcStatus(ev.status.ok() ? absl::InternalError("request failed") : ev.status);
      api::v1::GenerateResponse resp;
      resp.set_text(ev.text);
      for (int32_t t : ev.token_ids) resp.add_token_ids(t);
      resp.set_finish_reason(ToApi(ev.finish));
      const bool last = ev.finish != FinishReason::kNone;
      if (last) {
        resp.mutable_usage()->set_prompt_tokens(ev.prompt_tokens);
        resp.mutable_usage()->set_completion_tokens(ev.completion_tokens);
        auto* t = resp.mutable_timings();
        t->set_queue_ms(ev.queue_ms);
        t->set_prefill_ms(ev.prefill_ms);
        t->set_decode_ms(ev.decode_ms);
        t->set_time_to_first_token_ms(ev.time_to_first_token_ms);
        t->set_total_ms(absl::ToDoubleMilliseconds(absl::Now() - start));
      }
      if (!cancelled && !writer->Write(resp)) {
        engine_->Cancel(*id);  // client gone
        cancelled = true;
      }
      if (last)
        return cancelled ? grpc::Status(grpc::StatusCode::CANCELLED, "client went away")
                         : grpc::Status::OK;
    }
  }
}

grpc::Status GenerationService::Tokenize(grpc::ServerContext* ctx,
                                         const api::v1::TokenizeRequest* req,
                                         api::v1::TokenizeResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (tokenizer_ == nullptr) return ToGrpcStatus(absl::FailedPreconditionError(no_tokenizer_));
  auto ids = tokenizer_->Encode(req->text(), req->add_special_tokens());
  if (!ids.ok()) return ToGrpcStatus(Annotate(ids.status(), "text"));
  for (int32_t t : *ids) resp->add_ids(t);
  return grpc::Status::OK;
}

grpc::Status GenerationService::Detokenize(grpc::ServerContext* ctx,
                                           const api::v1::DetokenizeRequest* req,
                                           api::v1::DetokenizeResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  if (tokenizer_ == nullptr) return ToGrpcStatus(absl::FailedPreconditionError(no_tokenizer_));
  std::vector<int32_t> ids(req->ids().begin(), req->ids().end());
  auto text = tokenizer_->Decode(ids, req->skip_special_tokens());
  if (!text.ok()) return ToGrpcStatus(Annotate(text.status(), "ids"));
  resp->set_text(*text);
  return grpc::Status::OK;
}

grpc::Status GenerationService::ModelInfo(grpc::ServerContext* ctx,
                                          const api::v1::ModelInfoRequest*,
                                          api::v1::ModelInfoResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  const ModelConfig& c = model_->config();
  resp->set_model_type(c.model_type);
  resp->set_model_dir(model_dir_);
  resp->set_vocab_size(c.vocab_size);
  resp->set_hidden_size(c.hidden_size);
  resp->set_num_layers(c.num_layers);
  resp->set_num_moe_layers(c.num_moe_layers());
  resp->set_num_experts(c.moe.num_experts);
  resp->set_experts_per_token(c.moe.experts_per_token);
  resp->set_max_context(engine_->max_context());
  const ParamCounts p = CountParameters(c);
  resp->set_total_params(p.total);
  resp->set_active_params(p.active);
  for (int64_t e : c.eos_token_ids) resp->add_eos_token_ids(static_cast<int32_t>(e));
  if (c.bos_token_id) resp->set_bos_token_id(static_cast<int32_t>(*c.bos_token_id));
  resp->set_experts_backend(experts_backend_);
  resp->set_max_batch(engine_->options().max_batch);
  resp->set_has_chat_template(chat_ != nullptr);
  return grpc::Status::OK;
}

grpc::Status GenerationService::Stats(grpc::ServerContext* ctx, const api::v1::StatsRequest*,
                                      api::v1::StatsResponse* resp) {
  if (grpc::Status a = Authorize(ctx); !a.ok()) return a;
  const EngineStats s = engine_->stats();
  resp->set_kv_blocks_total(s.kv_blocks_total);
  resp->set_kv_blocks_used(s.kv_blocks_used);
  resp->set_kv_block_tokens(engine_->options().kv_block_tokens);
  resp->set_running(s.running);
  resp->set_waiting(s.waiting);
  resp->set_completed(s.completed);
  resp->set_rejected(s.rejected);
  resp->set_tokens_generated(s.tokens_generated);
  const RoutingTable r = model_->routing_stats();
  resp->set_model_type(model_->config().model_type);
  resp->set_num_experts(r.num_experts);
  resp->set_experts_per_token(r.experts_per_token);
  for (const RoutingTable::Layer& l : r.layers) {
    api::v1::LayerRouting* out = resp->add_routing();
    out->set_layer(l.layer);
    for (uint64_t c : l.tokens) out->add_tokens(c);
  }
  return grpc::Status::OK;
}

}  // namespace hmoe
