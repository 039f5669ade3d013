#include "expert_service/server/grpc_services.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/transport/grpc_auth.h"
#include "common/transport/grpc_client.h"
#include "common/transport/grpc_status.h"
#include "grpcpp/impl/rpc_service_method.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/method_handler.h"
#include "proto/expert.grpc.pb.h"

namespace hmoe {

namespace pb = ::hmoe::expert::v1;

grpc::Status ServiceState::DataPlaneDown(bool enabled, const char* name) const {
  if (enabled && load_state.load() == pb::LoadStatus::LOADING)
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat(name, ": the expert service is still loading; retry"));
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, absl::StrCat(name, " off"));
}
grpc::Status ServiceState::Authorize(const grpc::ServerContext* ctx) const {
  return CheckBearer(*ctx, *auth_tokens,
                     "the worker's --expert-auth-token-file sets the expert service's token");
}

namespace {

class ControlService final : public pb::ExpertControl::Service {
 public:
  explicit ControlService(ServiceState* s) : s_(s) {}

  grpc::Status Describe(grpc::ServerContext* ctx, const pb::DescribeRequest*,
                        pb::ShardDescription* d) override {
    if (grpc::Status a = s_->Authorize(ctx); !a.ok()) return a;
    ExpertShard* shard = s_->shard.load();
    if (!shard) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "weights still loading");
    ShardInfo i = shard->info();
    i.shm_available = s_->shm.load() != nullptr;
    i.ucx_available = s_->ucx.load() != nullptr;
    i.pid = ::getpid();
    ToShardDescription(i, d);
    d->set_instance(s_->instance);
    return grpc::Status::OK;
  }

  grpc::Status GetLoadStatus(grpc::ServerContext* ctx, const pb::LoadStatusRequest*,
                             pb::LoadStatus* r) override {
    if (grpc::Status a = s_->Authorize(ctx); !a.ok()) return a;
    r->set_state(static_cast<pb::LoadStatus::State>(s_->load_state.load()));
    r->set_layers_loaded(s_->progress.layers_loaded);
    r->set_layers_total(s_->progress.layers_total);
    r->set_weight_bytes(s_->progress.weight_bytes);
    if (s_->load_state.load() != pb::LoadStatus::LOADING) {
      r->set_load_seconds(s_->load_seconds);
      r->set_error(s_->load_error);
    }
    return grpc::Status::OK;
  }

  grpc::Status GetStats(grpc::ServerContext* ctx, const pb::StatsRequest*, pb::Stats* r) override {
    if (grpc::Status a = s_->Authorize(ctx); !a.ok()) return a;
    if (ExpertShard* shard = s_->shard.load()) {
      const auto& c = shard->counters();
      r->set_requests(c.requests);
      r->set_failed(c.failed);
      r->set_invalid(c.invalid);
      r->set_tokens(c.tokens);
      r->set_compute_ns(c.compute_ns);
      r->set_in_flight(c.in_flight);
    }
    if (ShmServer* shm = s_->shm.load()) {
      r->set_shm_sessions(shm->sessions());
      r->set_shm_discarded(shm->discarded());
    }
    if (UcxServer* ucx = s_->ucx.load()) {
      r->set_ucx_endpoints(ucx->endpoints());
      r->set_ucx_peer_failures(ucx->peer_failures());
    }
    r->set_grpc_streams(s_->streams);
    return grpc::Status::OK;
  }

  grpc::Status AttachShm(grpc::ServerContext* ctx, const pb::AttachShmRequest* req,
                         pb::AttachShmResponse* r) override {
    if (grpc::Status a = s_->Authorize(ctx); !a.ok()) return a;
    ShmServer* shm = s_->shm.load();
    if (shm == nullptr) return s_->DataPlaneDown(s_->shm_enabled, "shared memory");
    auto epoch = shm->Attach(req->path(), req->client_pid(), req->nonce());
    if (!epoch.ok()) return ToGrpcStatus(epoch.status());
    r->set_epoch(*epoch);
    return grpc::Status::OK;
  }

  grpc::Status UcxConnect(grpc::ServerContext* ctx, const pb::UcxConnectRequest* req,
                          pb::UcxConnectResponse* r) override {
    if (grpc::Status a = s_->Authorize(ctx); !a.ok()) return a;
    UcxServer* ucx = s_->ucx.load();
    if (ucx == nullptr) return s_->DataPlaneDown(s_->ucx_enabled, "UCX");
    auto addr = ucx->Connect(req->client_worker_address(), req->client_id(),
                             [ctx] { return ctx->IsCancelled(); });
    if (!addr.ok()) return ToGrpcStatus(addr.status());
    r->set_server_worker_address(*addr);
    return grpc::Status::OK;
  }

 private:
  ServiceState* s_;
};

// ExpertData/Moe on raw byte buffers, parsed here: the generated sync
// handler's Read returns false for a message that does not parse just as
// for the client's half-close, so such a stream ended OK and the requests
// after it went unanswered. Here it ends INVALID_ARGUMENT naming the
// message. The method is registered under the generated service's name.
class DataService final : public grpc::Service {
 public:
  explicit DataService(ServiceState* s)
      : s_(s), method_(absl::StrCat("/", pb::ExpertData::service_full_name(), "/Moe")) {
    using Stream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
    AddMethod(new grpc::internal::RpcServiceMethod(
        method_.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING,
        new grpc::internal::BidiStreamingHandler<DataService, grpc::ByteBuffer, grpc::ByteBuffer>(
            [](DataService* self, grpc::ServerContext* ctx, Stream* rw) {
              return self->Moe(ctx, rw);
            },
            this)));
  }

  grpc::Status Moe(grpc::ServerContext* ctx,
                   grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* rw) {
    if (grpc::Status a = s_->Authorize(ctx); !a.ok()) return a;
    // Counted only while under the cap: a refused stream never inflates it.
    const uint64_t cap = static_cast<uint64_t>(s_->max_peers);
    uint64_t open = s_->streams.load();
    do {
      if (open >= cap) {
        return grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("expert service: ", open, " gRPC MoE streams open, the service's cap (",
                         cap, ", --max-peers)"));
      }
    } while (!s_->streams.compare_exchange_weak(open, open + 1));
    pb::MoeRequest req;
    pb::MoeResponse resp;
    std::vector<float> out;
    grpc::ByteBuffer in, reply;
    grpc::Status end = grpc::Status::OK;
    for (uint64_t n = 1; rw->Read(&in); ++n) {
      const size_t bytes = in.Length();
      if (grpc::Status p = grpc::SerializationTraits<pb::MoeRequest>::Deserialize(&in, &req);
          !p.ok()) {
        end = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                           absl::StrCat("expert service: message ", n, " of the MoE stream (",
                                        bytes, " bytes) is not a hmoe.expert.v1.MoeRequest (",
                                        p.error_message(), "); the stream ends here"));
        break;
      }
      resp.Clear();
      resp.set_request_id(req.request_id());
      ExpertShard* shard = s_->shard.load();
      absl::Status st;
      uint64_t ns = 0;
      if (!shard) {
        st = absl::UnavailableError("expert service: weights still loading");
      } else if (!pb::OutputType_IsValid(req.output())) {
        st = absl::InvalidArgumentError(
            absl::StrCat("expert service: MoeRequest.output = ", req.output(),
                         " is not an OutputType (0 OUTPUT_F32, 1 OUTPUT_BF16)"));
      } else {
        const ShardInfo& info = shard->info();
        const MoeCall call = MoeCallOf(req);
        const int64_t t = std::clamp<int64_t>(call.tokens, 0, info.max_tokens);
        out.resize(static_cast<size_t>(t * info.hidden));
        st = shard->Handle(call, out.data(), &ns);
        if (st.ok()) {
          resp.set_tokens(call.tokens);
          resp.set_hidden(info.hidden);
          resp.set_compute_ns(ns);
          if (req.output() == pb::OUTPUT_BF16) {
            std::string b(out.size() * 2, '\0');
            auto* p = reinterpret_cast<uint16_t*>(b.data());
            for (size_t i = 0; i < out.size(); ++i) p[i] = F32ToBf16(out[i]);
            resp.set_out(std::move(b));
            resp.set_output(pb::OUTPUT_BF16);
          } else {
            resp.set_out(out.data(), out.size() * 4);
          }
        }
      }
      resp.set_code(static_cast<int>(st.code()));
      resp.set_message(std::string(st.message()));
      bool own = false;
      reply.Clear();  // Serialize wants an empty buffer
      if (grpc::Status w =
              grpc::SerializationTraits<pb::MoeResponse>::Serialize(resp, &reply, &own);
          !w.ok()) {
        end = grpc::Status(grpc::StatusCode::INTERNAL,
                           absl::StrCat("expert service: a MoeResponse did not serialize (",
                                        w.error_message(), ")"));
        break;
      }
      if (!rw->Write(reply)) break;
    }
    s_->streams.fetch_sub(1);
    return end;
  }

 private:
  ServiceState* s_;
  const std::string method_;  // "/hmoe.expert.v1.ExpertData/Moe", outlives the method
};

}  // namespace

std::unique_ptr<grpc::Service> MakeControlService(ServiceState* state) {
  return std::make_unique<ControlService>(state);
}
std::unique_ptr<grpc::Service> MakeDataService(ServiceState* state) {
  return std::make_unique<DataService>(state);
}

}  // namespace hmoe
