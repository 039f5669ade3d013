// The gRPC front end of the worker: hmoe.api.v1.Generation over an Engine.
// Thin: validation that needs the tokenizer, request mapping, streaming, and
// cancellation (client cancel or deadline -> Engine::Cancel, KV freed at once).
#pragma once

#include <memory>
#include <string>

#include "common/auth_token.h"
#include "common/text/chat_template.h"
#include "gpu_worker/engine/engine.h"
#include "proto/api.grpc.pb.h"

namespace hmoe {

class GenerationService final : public api::v1::Generation::Service {
 public:
  // All borrowed; `tokenizer` may be null (then only prompt_ids work).
  // `auth_tokens` non-null and on: every call must carry one of the tokens
  // in force (common/transport/grpc_auth.h), else UNAUTHENTICATED.
  // ModelInfo reports `model_dir`'s last component only: clients are not
  // shown the server's paths.
  GenerationService(Engine* engine, const Model* model, const Tokenizer* tokenizer,
                    std::string model_dir, std::string experts_backend,
                    std::shared_ptr<const AuthTokens> auth_tokens = nullptr);

  grpc::Status Generate(grpc::ServerContext* ctx, const api::v1::GenerateRequest* req,
                        grpc::ServerWriter<api::v1::GenerateResponse>* writer) override;
  grpc::Status Tokenize(grpc::ServerContext* ctx, const api::v1::TokenizeRequest* req,
                        api::v1::TokenizeResponse* resp) override;
  grpc::Status Detokenize(grpc::ServerContext* ctx, const api::v1::DetokenizeRequest* req,
                          api::v1::DetokenizeResponse* resp) override;
  grpc::Status ModelInfo(grpc::ServerContext* ctx, const api::v1::ModelInfoRequest* req,
                         api::v1::ModelInfoResponse* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const api::v1::StatsRequest* req,
                     api::v1::StatsResponse* resp) override;

  // Why there is no tokenizer, for the errors of text calls when it is null
  // (default: "this model has no tokenizer.json").
  void set_no_tokenizer_reason(std::string why) { no_tokenizer_ = std::move(why); }
  // The chat template for GenerateRequest.chat (borrowed; null: chat
  // requests are INVALID_ARGUMENT with `why_not`).
  void set_chat_template(const ChatTemplate* chat, std::string why_not) {
    chat_ = chat;
    no_chat_ = std::move(why_not);
  }

  // Builds the engine request from the API message (INVALID_ARGUMENT naming
  // the field). Public for tests.
  absl::StatusOr<GenerateRequest> ToEngineRequest(const api::v1::GenerateRequest& req) const;
  // GenerateRequest.chat's prompt tokens (INVALID_ARGUMENT naming the field).
  absl::StatusOr<std::vector<int32_t>> ChatPromptIds(const api::v1::Chat& chat) const;

 private:
  Engine* engine_;
  const Model* model_;
  const Tokenizer* tokenizer_;
  std::string model_dir_;
  std::string experts_backend_;
  std::string no_tokenizer_ = "this model has no tokenizer.json";
  const ChatTemplate* chat_ = nullptr;
  std::string no_chat_ = "this model has no chat template";
  std::shared_ptr<const AuthTokens> auth_tokens_;  // never null
  grpc::Status Authorize(const grpc::ServerContext* ctx) const;
};

}  // namespace hmoe
