#include "expert_service/server/grpc_services.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/transport/grpc_auth.h"
#include "common/transport/grpc_messages.h"
#include "common/transport/grpc_moe_wire.h"
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

// The buffers a Moe stream computes its answers into, lent to gRPC as the
// answers' `out` slices (sent without a copy) and taken back when gRPC lets
// go of a slice, on whatever thread and perhaps after the stream has ended:
// each lent slice holds the pool alive. Reusing buffers spares a large
// answer the page faults of fresh memory.
class OutBuffers : public std::enable_shared_from_this<OutBuffers> {
 public:
  ~OutBuffers() {
    for (const Buffer& b : free_) std::free(b.data);
  }
  // A slice of `bytes` over a 64-byte aligned buffer; *data is where to write.
  grpc::Slice Lend(size_t bytes, void** data) {
    Buffer b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = std::find_if(free_.begin(), free_.end(),
                             [&](const Buffer& f) { return f.capacity >= bytes; });
      if (it != free_.end()) {
        b = *it;
        free_.erase(it);
      }
    }
    if (b.data == nullptr) {
      b.capacity = std::max<size_t>((bytes + 63) / 64 * 64, 64);
      b.data = std::aligned_alloc(64, b.capacity);
      if (b.data == nullptr) throw std::bad_alloc();
    }
    *data = b.data;
    auto* lease = new Lease{shared_from_this(), b};
    return grpc::Slice(b.data, bytes, &OutBuffers::Return, lease);
  }

 private:
  static constexpr size_t kKeep = 4;  // buffers kept for reuse at most
  struct Buffer {
    void* data = nullptr;
    size_t capacity = 0;
  };
  struct Lease {
    std::shared_ptr<OutBuffers> pool;
    Buffer buffer;
  };
  static void Return(void* p) {
    std::unique_ptr<Lease> lease(static_cast<Lease*>(p));
    OutBuffers& pool = *lease->pool;
    std::lock_guard<std::mutex> lock(pool.mu_);
    if (pool.free_.size() < kKeep) {
      pool.free_.push_back(lease->buffer);
    } else {
      std::free(lease->buffer.data);
    }
  }
  std::mutex mu_;
  std::vector<Buffer> free_;
};

// ExpertData/Moe on raw byte buffers, parsed here: the generated sync
// handler's Read returns false for a message that does not parse just as
// for the client's half-close, so such a stream ended OK and the requests
// after it went unanswered. Here it ends INVALID_ARGUMENT naming the
// message. The method is registered under the generated service's name.
class DataService final : public grpc::Service {
 public:
  explicit DataService(ServiceState* s) : s_(s) {
    using Stream = grpc::ServerReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>;
    AddMethod(new grpc::internal::RpcServiceMethod(
        MoeMethodName(), grpc::internal::RpcMethod::BIDI_STREAMING,
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
    auto buffers = std::make_shared<OutBuffers>();
    std::vector<float> f32;  // an answer converted to bf16 is computed here
    grpc::ByteBuffer in;
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
      grpc::Slice out;  // the answer's `out`
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
        const size_t elems =
            static_cast<size_t>(std::clamp<int64_t>(call.tokens, 0, info.max_tokens) * info.hidden);
        const bool bf16 = req.output() == pb::OUTPUT_BF16;
        void* data = nullptr;
        float* y = nullptr;
        if (bf16) {
          f32.resize(elems);
          y = f32.data();
        } else {
          out = buffers->Lend(elems * 4, &data);
          y = static_cast<float*>(data);
        }
        st = shard->Handle(call, y, &ns);
        if (!st.ok()) {
          out = grpc::Slice();
        } else {
          resp.set_tokens(call.tokens);
          resp.set_hidden(info.hidden);
          resp.set_compute_ns(ns);
          resp.set_output(req.output());
          if (bf16) {
            out = buffers->Lend(elems * 2, &data);
            auto* p = static_cast<uint16_t*>(data);
            for (size_t i = 0; i < elems; ++i) p[i] = F32ToBf16(f32[i]);
          }
        }
      }
      resp.set_code(static_cast<int>(st.code()));
      resp.set_message(std::string(st.message()));
      const grpc::ByteBuffer reply = EncodeMoeResponse(resp, out);
      if (!rw->Write(reply)) break;
    }
    s_->streams.fetch_sub(1);
    return end;
  }

 private:
  ServiceState* s_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeControlService(ServiceState* state) {
  return std::make_unique<ControlService>(state);
}
std::unique_ptr<grpc::Service> MakeDataService(ServiceState* state) {
  return std::make_unique<DataService>(state);
}

}  // namespace hmoe
