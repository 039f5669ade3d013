// Bearer tokens on gRPC (common/auth_token.h has the token files): a client
// channel that sends `authorization: Bearer <token>` with every call, and the
// server-side check each of our handlers runs first; both follow a reload of
// their AuthTokens. Header-only, like
// grpc_status.h, so thin clients (sdk/) use it without the transports.
// grpc.health.v1 stays open (it tells SERVING / NOT_SERVING, nothing else).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/auth_token.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/client_interceptor.h"
#include "grpcpp/support/status.h"

namespace hmoe {

inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr absl::string_view kBearerPrefix = "Bearer ";

namespace internal {

class BearerInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    if (m->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      m->GetSendInitialMetadata()->emplace(kAuthMetadataKey, value_);
    }
    m->Proceed();
  }

 private:
  const std::string value_;
};

class BearerInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::shared_ptr<const AuthTokens> tokens)
      : tokens_(std::move(tokens)) {}
  // Each call takes the token in force when it starts.
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(absl::StrCat(kBearerPrefix, tokens_->first()));
  }

 private:
  const std::shared_ptr<const AuthTokens> tokens_;
};

}  // namespace internal

// A channel whose every call carries the first of `tokens` in force when the
// call starts (none when null or off).
inline std::shared_ptr<grpc::Channel> CreateChannelWithTokens(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& creds,
    const grpc::ChannelArguments& args, std::shared_ptr<const AuthTokens> tokens) {
  if (tokens == nullptr || !tokens->enabled())
    return grpc::CreateCustomChannel(target, creds, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> f;
  f.push_back(std::make_unique<internal::BearerInterceptorFactory>(std::move(tokens)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(target, creds, args, std::move(f));
}

// A channel whose every call carries `token` (none when empty).
inline std::shared_ptr<grpc::Channel> CreateChannelWithToken(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& creds,
    const grpc::ChannelArguments& args, absl::string_view token) {
  return CreateChannelWithTokens(target, creds, args,
                                 token.empty() ? nullptr
                                               : std::make_shared<const AuthTokens>(
                                                     std::vector<std::string>{std::string(token)}));
}

// OK when auth is off or the call's metadata carries exactly one
// `authorization: Bearer <token>` with a token in force; else
// UNAUTHENTICATED, saying which (`hint` names the client's flag that sets
// the token).
inline grpc::Status CheckBearer(const grpc::ServerContextBase& ctx, const AuthTokens& tokens,
                                absl::string_view hint) {
  if (!tokens.enabled()) return grpc::Status::OK;
  const auto& md = ctx.client_metadata();
  const auto [lo, hi] = md.equal_range(kAuthMetadataKey);
  if (lo == hi) {
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        absl::StrCat("this server requires a token and the call sent none (", hint, ")"));
  }
  if (std::next(lo) != hi) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "the call sent more than one authorization value");
  }
  const absl::string_view v(lo->second.data(), lo->second.size());
  // The scheme is case-insensitive (RFC 7235); the token is not.
  if (!absl::StartsWithIgnoreCase(v, kBearerPrefix) ||
      !tokens.Accepts(v.substr(kBearerPrefix.size()))) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        absl::StrCat("the call's token does not match this server's (", hint, ")"));
  }
  return grpc::Status::OK;
}

}  // namespace hmoe
