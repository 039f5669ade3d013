#include "gpu_worker/transport/grpc_client.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/grpc_auth.h"
#include "common/transport/grpc_moe_wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/expert.grpc.pb.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace hmoe {
namespace pb = ::hmoe::expert::v1;

namespace {
// Our channel settings: unlimited messages; retry a lost shard quickly (50
// ms, backing off to 500 ms), but give each connection attempt 2 s to finish
// its handshake: gRPC uses the "min reconnect backoff" as the minimum connect
// timeout, and at 50 ms a service just resumed from a stall (its listen
// backlog full of stale attempts) could not be reached for seconds on a
// loaded machine.
grpc::ChannelArguments ExpertChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  return args;
}
std::shared_ptr<grpc::ChannelCredentials> OrInsecure(
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return credentials ? std::move(credentials) : grpc::InsecureChannelCredentials();
}
}  // namespace

std::shared_ptr<grpc::Channel> MakeExpertChannel(
    const std::string& target, std::shared_ptr<const AuthTokens> auth_tokens,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return CreateChannelWithTokens(target, OrInsecure(std::move(credentials)), ExpertChannelArgs(),
                                 std::move(auth_tokens));
}

std::shared_ptr<grpc::Channel> MakeExpertChannel(
    const std::string& target, const std::string& auth_token,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return CreateChannelWithToken(target, OrInsecure(std::move(credentials)), ExpertChannelArgs(),
                                auth_token);
}

absl::Duration ControlBudget(absl::Time deadline, absl::Duration own, bool* capped) {
  const absl::Duration left = deadline - absl::Now();
  *capped = left < own;
  return std::max(std::min(left, own), absl::ZeroDuration());
}

absl::Status ControlFailure(const absl::Status& st, bool capped, const std::string& what) {
  if (st.code() != absl::StatusCode::kDeadlineExceeded)
    return absl::Status(st.code(), absl::StrCat(what, ": ", std::string(st.message())));
  if (capped) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": ", std::string(st.message()), " (the call's deadline)"));
  }
  return absl::UnavailableError(absl::StrCat(what, ": ", std::string(st.message())));
}

bool IsServiceRefusal(absl::StatusCode code) {
  return code == absl::StatusCode::kUnauthenticated ||
         code == absl::StatusCode::kPermissionDenied ||
         code == absl::StatusCode::kResourceExhausted;
}

absl::Status SetupFailure(const absl::Status& st) {
  if (st.ok() || absl::IsDeadlineExceeded(st) || IsServiceRefusal(st.code())) return st;
  return absl::UnavailableError(st.message());
}

namespace {
void SetDeadline(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::microseconds(absl::ToInt64Microseconds(timeout)));
}
}  // namespace

struct ControlClient::Stubs {
  std::unique_ptr<pb::ExpertControl::Stub> control;
  std::unique_ptr<::grpc::health::v1::Health::Stub> health;
};

ControlClient::ControlClient(std::shared_ptr<grpc::Channel> channel) : stubs_(new Stubs) {
  stubs_->control = pb::ExpertControl::NewStub(channel);
  stubs_->health = ::grpc::health::v1::Health::NewStub(channel);
}
ControlClient::~ControlClient() = default;

absl::StatusOr<ShardInfo> ControlClient::Describe(absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  pb::ShardDescription d;
  grpc::Status st = stubs_->control->Describe(&ctx, pb::DescribeRequest(), &d);
  if (!st.ok()) return FromGrpcStatus(st);
  return FromShardDescription(d);
}

absl::StatusOr<ShardStats> ControlClient::Stats(absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  pb::Stats s;
  grpc::Status st = stubs_->control->GetStats(&ctx, pb::StatsRequest(), &s);
  if (!st.ok()) return FromGrpcStatus(st);
  ShardStats r;
  r.requests = s.requests();
  r.failed = s.failed();
  r.invalid = s.invalid();
  r.tokens = s.tokens();
  r.compute_ns = s.compute_ns();
  r.in_flight = s.in_flight();
  r.shm_sessions = s.shm_sessions();
  r.shm_discarded = s.shm_discarded();
  r.ucx_endpoints = s.ucx_endpoints();
  r.ucx_peer_failures = s.ucx_peer_failures();
  r.grpc_streams = s.grpc_streams();
  return r;
}

Health ControlClient::Check(const std::string& service, absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  ::grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  ::grpc::health::v1::HealthCheckResponse resp;
  grpc::Status st = stubs_->health->Check(&ctx, req, &resp);
  if (!st.ok()) return Health::kNotServing;
  return resp.status() == ::grpc::health::v1::HealthCheckResponse::SERVING ? Health::kServing
                                                                           : Health::kNotServing;
}

absl::StatusOr<uint64_t> ControlClient::AttachShm(const std::string& path, int64_t pid,
                                                  uint64_t nonce, absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  pb::AttachShmRequest req;
  req.set_path(path);
  req.set_client_pid(pid);
  req.set_nonce(nonce);
  pb::AttachShmResponse resp;
  grpc::Status st = stubs_->control->AttachShm(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  return resp.epoch();
}

absl::StatusOr<std::string> ControlClient::UcxConnect(const std::string& client_address,
                                                      uint64_t client_id, absl::Duration timeout) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout);
  pb::UcxConnectRequest req;
  req.set_client_worker_address(client_address);
  req.set_client_id(client_id);
  pb::UcxConnectResponse resp;
  grpc::Status st = stubs_->control->UcxConnect(&ctx, req, &resp);
  if (!st.ok()) return FromGrpcStatus(st);
  return resp.server_worker_address();
}

// ---- data plane --------------------------------------------------------------

struct GrpcStreamClient::Stream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> rw;
  std::thread reader, writer;
  bool ended = false;   // mu_: the reader has seen the stream finish
  bool verify = false;  // the writer checks the service before its first write
  absl::Status failed;  // mu_: the check's verdict; the reader ends the calls with it
};

struct GrpcStreamClient::Outgoing {
  uint64_t id = 0;
  uint64_t bytes = 0;
  absl::Time deadline;
  grpc::ByteBuffer req;  // a MoeRequest (grpc_moe_wire.h)
};

GrpcStreamClient::GrpcStreamClient(std::shared_ptr<grpc::Channel> channel, int64_t hidden,
                                   uint64_t max_queued_bytes, std::optional<ReconnectCheck> check)
    : channel_(std::move(channel)),
      hidden_(hidden),
      max_queued_bytes_(max_queued_bytes),
      check_(std::move(check)) {}

GrpcStreamClient::~GrpcStreamClient() {
  std::unique_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    s = std::move(stream_);
    if (s) s->ctx.TryCancel();  // unblocks a Read and a Write in progress
    writer_cv_.notify_all();
  }
  if (s) {
    s->reader.join();
    s->writer.join();
  }
}

absl::Status GrpcStreamClient::EnsureStream(std::unique_lock<std::mutex>& lock) {
  while (broken_) {
    if (stream_) {
      // The old reader has failed every pending call; both threads are exiting.
      std::unique_ptr<Stream> old = std::move(stream_);
      lock.unlock();
      old->ctx.TryCancel();  // ended already; makes sure no Write is left blocked
      old->reader.join();
      old->writer.join();
      lock.lock();
      continue;  // another Submit may have opened a stream meanwhile
    }
    auto s = std::make_unique<Stream>();
    // Corked: the stream's opening goes out with its first Write, on the
    // writer thread. Uncorked, opening would wait here (under mu_) for a
    // connection to a service that accepts TCP but never answers.
    s->ctx.set_initial_metadata_corked(true);
    // On raw byte buffers (grpc_moe_wire.h): the generated stub would copy
    // each request twice more and each answer once more.
    const grpc::internal::RpcMethod method(MoeMethodName(),
                                           grpc::internal::RpcMethod::BIDI_STREAMING);
    s->rw.reset(
        grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
            channel_.get(), method, &s->ctx));
    if (!s->rw) return absl::UnavailableError("expert service: cannot open the MoE stream");
    Stream* raw = s.get();
    raw->verify = check_.has_value() && check_->control != nullptr;
    stream_ = std::move(s);
    broken_ = false;
    raw->reader = std::thread(&GrpcStreamClient::ReadLoop, this, raw);
    raw->writer = std::thread(&GrpcStreamClient::WriteLoop, this, raw);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> GrpcStreamClient::Submit(const MoeCall& call, float* out,
                                                  absl::Time deadline) {
  // A protobuf message holds under 2 GiB.
  RETURN_IF_ERROR(CheckMoeCallBytes(call, (uint64_t{1} << 31) - 4096, "grpc"));
  auto o = std::make_unique<Outgoing>();
  o->id = next_id_.fetch_add(1);
  o->req = EncodeMoeRequest(o->id, call);
  o->bytes = o->req.Length();
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        "expert service (grpc): the call's deadline passed before it was sent");
  }
  const auto until = absl::ToChronoTime(deadline);
  std::unique_lock<std::mutex> lock(mu_);
  auto room = [&] { return queued_bytes_ == 0 || queued_bytes_ + o->bytes <= max_queued_bytes_; };
  while (true) {
    if (stopping_) return absl::CancelledError("expert service (grpc): client shutting down");
    absl::Status st = EnsureStream(lock);
    if (!st.ok()) return st;
    if (room()) break;
    // The writer is stuck behind a service that does not read: wait for room.
    if (cv_.wait_until(lock, until) == std::cv_status::timeout && !room()) {
      return absl::DeadlineExceededError(
          absl::StrCat("expert service (grpc): send queue full (", queued_bytes_,
                       " bytes the stream has not taken) until the deadline"));
    }
  }
  const uint64_t id = o->id;
  Pending& p = pending_[id];
  p.out = out;
  p.elems = static_cast<int64_t>(call.tokens > 0 ? call.tokens : 0) * hidden_;
  o->deadline = deadline;
  queued_bytes_ += o->bytes;
  outbox_.push_back(std::move(o));
  writer_cv_.notify_one();
  return id;
}

bool GrpcStreamClient::CheckStream(Stream* s, const Outgoing& first,
                                   std::unique_lock<std::mutex>& lock) {
  bool capped = false;
  const absl::Duration budget = ControlBudget(first.deadline, absl::Seconds(2), &capped);
  lock.unlock();
  absl::StatusOr<ShardInfo> now = check_->control->Describe(budget);
  lock.lock();
  absl::Status bad;
  if (!now.ok()) {
    bad = SetupFailure(
        ControlFailure(now.status(), capped, "grpc: describe before the MoE stream's first call"));
  } else {
    bad = CheckServesTheSame(check_->info, *now, "grpc");
  }
  if (bad.ok()) return true;
  // Nothing was written on this stream. Its reader ends every call waiting
  // on it with `bad` once the cancel reaches it (and marks it broken, so the
  // next Submit opens, and checks, another).
  s->failed = std::move(bad);
  s->ctx.TryCancel();
  return false;
}

void GrpcStreamClient::WriteLoop(Stream* s) {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    writer_cv_.wait(lock, [&] { return stopping_ || s->ended || !outbox_.empty(); });
    if (stopping_ || s->ended) return;
    if (s->verify) {
      if (!CheckStream(s, *outbox_.front(), lock)) return;
      s->verify = false;
      if (stopping_ || s->ended || outbox_.empty()) continue;
    }
    std::unique_ptr<Outgoing> o = std::move(outbox_.front());
    outbox_.pop_front();
    queued_bytes_ -= o->bytes;
    cv_.notify_all();
    auto it = pending_.find(o->id);
    if (it == pending_.end() || it->second.done) continue;  // abandoned: not sent
    lock.unlock();
    const bool ok = s->rw->Write(o->req);
    lock.lock();
    if (!ok) {
      // The stream is closing; the reader fails everything else still pending.
      it = pending_.find(o->id);
      if (it != pending_.end() && !it->second.done) {
        it->second.done = true;
        it->second.status = absl::UnavailableError("expert service: MoE stream closed");
        cv_.notify_all();
      }
      return;
    }
  }
}

void GrpcStreamClient::ReadLoop(Stream* s) {
  grpc::ByteBuffer in;
  pb::MoeResponse head;
  // An answer's `out` goes straight into its caller's buffer (under mu_:
  // Wait may abandon the call meanwhile) when it is the answer expected.
  auto sink = [&](const pb::MoeResponse& h, uint64_t bytes) -> void* {
    auto it = pending_.find(h.request_id());
    if (it == pending_.end() || it->second.done) return nullptr;
    const Pending& p = it->second;
    return MoeResponseStatus(h, bytes, p.elems * 4).ok() ? p.out : nullptr;
  };
  while (s->rw->Read(&in)) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t got = 0;
    if (absl::Status d = DecodeMoeResponse(&in, &head, &got, sink); !d.ok()) {
      // A service that sends garbage is broken: end the stream, failing
      // every call on it with why.
      s->failed = std::move(d);
      s->ctx.TryCancel();
      break;
    }
    auto it = pending_.find(head.request_id());
    if (it == pending_.end() || it->second.done) continue;  // abandoned after a deadline
    Pending& p = it->second;
    p.status = MoeResponseStatus(head, got, p.elems * 4);
    p.done = true;
    cv_.notify_all();
  }
  grpc::Status st = s->rw->Finish();
  std::lock_guard<std::mutex> lock(mu_);
  s->ended = true;
  broken_ = true;
  // The service's refusals (a token it does not accept, its stream cap, a
  // request over its size cap) keep their code; any other end of the stream
  // is the service going away.
  const auto code = static_cast<absl::StatusCode>(st.error_code());
  const bool refused = IsServiceRefusal(code);
  for (auto& [id, p] : pending_) {
    if (!p.done) {
      p.done = true;
      p.status = !s->failed.ok() ? s->failed
                                 : absl::Status(refused ? code : absl::StatusCode::kUnavailable,
                                                absl::StrCat("expert service: MoE stream ended: ",
                                                             st.error_message()));
    }
  }
  // Everything still queued was for this stream and has just failed.
  outbox_.clear();
  queued_bytes_ = 0;
  cv_.notify_all();
  writer_cv_.notify_all();
}

absl::Status GrpcStreamClient::Wait(uint64_t handle, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = pending_.find(handle);
  if (it == pending_.end()) return absl::InvalidArgumentError("unknown handle");
  const auto until = absl::ToChronoTime(deadline);
  while (!it->second.done) {
    if (cv_.wait_until(lock, until) == std::cv_status::timeout && !it->second.done) {
      pending_.erase(it);
      return absl::DeadlineExceededError("expert service (grpc): no answer before the deadline");
    }
  }
  absl::Status st = it->second.status;
  pending_.erase(it);
  return st;
}

}  // namespace hmoe
