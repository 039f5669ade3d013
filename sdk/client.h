// hmoe C++ client: blocking and streaming calls to hmoe-gpu-worker
// (hmoe.api.v1.Generation) plus grpc.health.v1. Errors come back as
// absl::Status with the server's code and message.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/transport/grpc_tls.h"
#include "proto/api.grpc.pb.h"

namespace hmoe {

struct ClientOptions {
  std::string target = "127.0.0.1:50051";
  absl::Duration connect_timeout = absl::Seconds(10);
  // Sent with every call (the worker's --auth-token-file; common/auth_token.h
  // reads token files); empty: none.
  std::string auth_token;
  // TLS (the worker's --tls-cert-file): CA to verify it, client certificate
  // for mutual TLS; plaintext when none is set.
  TlsClientFiles tls;
};

struct GenerateResult {
  std::string text;
  std::vector<int32_t> token_ids;
  api::v1::FinishReason finish_reason = api::v1::FINISH_REASON_UNSPECIFIED;
  api::v1::Usage usage;
  api::v1::Timings timings;
  double wall_ms = 0;  // measured by the client
  double first_chunk_ms = 0;
};

class Client {
 public:
  // Waits up to connect_timeout for the channel (UNAVAILABLE if it never connects).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // Streams: `on_chunk` sees every message (return false to cancel the
  // request: CANCELLED, unless that was the final message, then the whole
  // result). `deadline` (InfiniteFuture: none) becomes the RPC deadline.
  absl::StatusOr<GenerateResult> Generate(
      const api::v1::GenerateRequest& request,
      const std::function<bool(const api::v1::GenerateResponse&)>& on_chunk = nullptr,
      absl::Time deadline = absl::InfiniteFuture());
  absl::StatusOr<std::vector<int32_t>> Tokenize(const std::string& text,
                                                bool add_special_tokens = false);
  absl::StatusOr<std::string> Detokenize(const std::vector<int32_t>& ids,
                                         bool skip_special_tokens = false);
  absl::StatusOr<api::v1::ModelInfoResponse> ModelInfo();
  absl::StatusOr<api::v1::StatsResponse> Stats();
  // grpc.health.v1 status of `service` ("" = the server as a whole): true if SERVING.
  absl::StatusOr<bool> Healthy(const std::string& service = "");

 private:
  explicit Client(std::shared_ptr<grpc::Channel> channel);
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<api::v1::Generation::Stub> stub_;
};

}  // namespace hmoe
