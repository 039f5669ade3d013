#include "sdk/client.h"

#include "absl/strings/str_cat.h"
#include "common/transport/grpc_auth.h"
#include "common/transport/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace hmoe {

Client::Client(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)), stub_(api::v1::Generation::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& o) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto creds = ChannelCredentialsFrom(o.tls);
  if (!creds.ok()) return creds.status();
  auto channel = CreateChannelWithToken(o.target, *creds, args, o.auth_token);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + o.connect_timeout)))
    return absl::UnavailableError(absl::StrCat("cannot connect to ", o.target, " within ",
                                               absl::FormatDuration(o.connect_timeout)));
  return std::unique_ptr<Client>(new Client(std::move(channel)));
}

absl::StatusOr<GenerateResult> Client::Generate(
    const api::v1::GenerateRequest& request,
    const std::function<bool(const api::v1::GenerateResponse&)>& on_chunk, absl::Time deadline) {
  grpc::ClientContext ctx;
  if (deadline != absl::InfiniteFuture()) ctx.set_deadline(absl::ToChronoTime(deadline));
  const absl::Time start = absl::Now();
  auto reader = stub_->Generate(&ctx, request);
  GenerateResult result;
  api::v1::GenerateResponse chunk;
  bool first = true, stopped = false;
  while (reader->Read(&chunk)) {
    if (first) {
      result.first_chunk_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
      first = false;
    }
    result.text += chunk.text();
    result.token_ids.insert(result.token_ids.end(), chunk.token_ids().begin(),
                            chunk.token_ids().end());
    if (!api::v1::FinishReason_IsValid(chunk.finish_reason())) {
      ctx.TryCancel();
      reader->Finish();
      return absl::DataLossError(absl::StrCat("worker: GenerateResponse.finish_reason = ",
                                              chunk.finish_reason(), " is not a FinishReason"));
    }
    if (chunk.finish_reason() != api::v1::FINISH_REASON_UNSPECIFIED) {
      result.finish_reason = chunk.finish_reason();
      result.usage = chunk.usage();
      result.timings = chunk.timings();
    }
    if (on_chunk && !on_chunk(chunk)) {
      ctx.TryCancel();
      stopped = true;
      break;
    }
  }
  grpc::Status s = reader->Finish();
  result.wall_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  if (stopped) {
    // Whether Finish saw our cancel or the server's OK is a race: decide by
    // what arrived. The final chunk came: the result is whole.
    if (result.finish_reason != api::v1::FINISH_REASON_UNSPECIFIED) return result;
    return absl::CancelledError(
        absl::StrCat("cancelled by the caller after ", result.token_ids.size(), " tokens"));
  }
  if (!s.ok()) return FromGrpcStatus(s);
  return result;
}

absl::StatusOr<std::vector<int32_t>> Client::Tokenize(const std::string& text,
                                                      bool add_special_tokens) {
  grpc::ClientContext ctx;
  api::v1::TokenizeRequest req;
  req.set_text(text);
  req.set_add_special_tokens(add_special_tokens);
  api::v1::TokenizeResponse resp;
  grpc::Status s = stub_->Tokenize(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return std::vector<int32_t>(resp.ids().begin(), resp.ids().end());
}

absl::StatusOr<std::string> Client::Detokenize(const std::vector<int32_t>& ids,
                                               bool skip_special_tokens) {
  grpc::ClientContext ctx;
  api::v1::DetokenizeRequest req;
  for (int32_t t : ids) req.add_ids(t);
  req.set_skip_special_tokens(skip_special_tokens);
  api::v1::DetokenizeResponse resp;
  grpc::Status s = stub_->Detokenize(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp.text();
}

absl::StatusOr<api::v1::ModelInfoResponse> Client::ModelInfo() {
  grpc::ClientContext ctx;
  api::v1::ModelInfoResponse resp;
  grpc::Status s = stub_->ModelInfo(&ctx, api::v1::ModelInfoRequest(), &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<api::v1::StatsResponse> Client::Stats() {
  grpc::ClientContext ctx;
  api::v1::StatsResponse resp;
  grpc::Status s = stub_->Stats(&ctx, api::v1::StatsRequest(), &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<bool> Client::Healthy(const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

}  // namespace hmoe
