// The shared-memory client against a service it cannot trust to keep the
// segment's header intact, and one whose shared-memory server stops while the
// process lives on: an in-process ShmServer behind an in-process control
// plane.
#include "gpu_worker/transport/shm_client.h"

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/transport/grpc_messages.h"
#include "common/transport/grpc_status.h"
#include "expert_service/transport/shm_server.h"
#include "gpu_worker/transport/grpc_client.h"
#include "gtest/gtest.h"
#include "proto/expert.grpc.pb.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

namespace pb = ::hmoe::expert::v1;

// Describe (the handler's shard, this pid) and AttachShm in process, in
// front of whichever ShmServer is set (none: "shared memory off", as the
// service says).
class Control final : public pb::ExpertControl::Service {
 public:
  grpc::Status Describe(grpc::ServerContext*, const pb::DescribeRequest*,
                        pb::ShardDescription* d) override {
    ShardInfo i = info != nullptr ? *info : ShardInfo();
    i.pid = ::getpid();
    ToShardDescription(i, d);
    return grpc::Status::OK;
  }
  grpc::Status AttachShm(grpc::ServerContext*, const pb::AttachShmRequest* req,
                         pb::AttachShmResponse* r) override {
    ShmServer* shm = server.load();
    if (shm == nullptr) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "shm off");
    auto epoch = shm->Attach(req->path(), req->client_pid(), req->nonce());
    if (!epoch.ok()) return ToGrpcStatus(epoch.status());
    r->set_epoch(*epoch);
    return grpc::Status::OK;
  }
  std::atomic<ShmServer*> server{nullptr};
  const ShardInfo* info = nullptr;
};

// One call of `tokens` rows; the answer must be row t = t + 1.
absl::Status OneCall(ShmClient& client, const ShardInfo& info, int32_t tokens,
                     absl::Duration timeout) {
  auto rc = testing::MakeRandomCall(info, info.moe_layers[0], tokens, 7);
  std::vector<float> out(static_cast<size_t>(tokens * info.hidden), -1.f);
  auto h = client.Submit(rc.call(), out.data(), absl::Now() + timeout);
  if (!h.ok()) return h.status();
  RETURN_IF_ERROR(client.Wait(*h, absl::Now() + timeout));
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i] != static_cast<float>(i / static_cast<size_t>(info.hidden) + 1))
      return absl::InternalError(absl::StrCat("out[", i, "] = ", out[i]));
  }
  return absl::OkStatus();
}

struct Rig {
  testing::RowHandler handler;
  std::unique_ptr<ShmServer> shm = std::make_unique<ShmServer>(&handler);
  Control control;
  std::unique_ptr<grpc::Server> grpc_server;
  std::unique_ptr<ShmClient> client;

  absl::Status Start() {
    control.server.store(shm.get());
    control.info = &handler.info();
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&control);
    grpc_server = b.BuildAndStart();
    if (grpc_server == nullptr || port == 0) return absl::InternalError("no control server");
    auto c = ShmClient::Create(
        std::make_shared<ControlClient>(MakeExpertChannel(absl::StrCat("127.0.0.1:", port))),
        handler.info());
    if (!c.ok()) return c.status();
    client = std::move(*c);
    return OneCall(*client, handler.info(), 3, absl::Seconds(10));
  }
  ~Rig() {
    client.reset();
    if (grpc_server) grpc_server->Shutdown();
  }
};

// The header is writable by the service; the client reads its own copy of
// the geometry it wrote (before: a rewritten num_slots overran the client's
// slot table, a moved resp_offset made it read the answer elsewhere, a zero
// req_capacity refused every call).
TEST(ShmClient, AHeaderRewrittenByTheServiceDoesNotMoveTheClientsSlots) {
  Rig rig;
  absl::Status started = rig.Start();
  ASSERT_TRUE(started.ok()) << started;
  auto* h = static_cast<ShmHeader*>(rig.client->segment());
  ASSERT_NE(h, nullptr);
  h->num_slots = 4096;
  h->slot_bytes = 64;
  h->req_capacity = 0;
  h->resp_offset -= 64;
  h->resp_capacity = ~uint64_t{0};
  for (int i = 0; i < 6; ++i) {  // more calls than slots: every slot reused
    absl::Status st = OneCall(*rig.client, rig.handler.info(), 1 + i % 8, absl::Seconds(10));
    EXPECT_TRUE(st.ok()) << i << ": " << st;
  }
}

// The fd of this process's shm segment (a memfd named hmoe-shm), or -1.
int SegmentFd() {
  for (int fd = 0; fd < 1024; ++fd) {
    char link[256];
    const ssize_t n =
        ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), link, sizeof(link) - 1);
    if (n > 0 && std::string_view(link, static_cast<size_t>(n)).find("memfd:hmoe-shm") !=
                     std::string_view::npos)
      return fd;
  }
  return -1;
}

// Another server attaching the segment (it rewrites the header's epoch and
// answers slots with its own): the client gives that segment up and attaches
// a fresh one, so calls go on succeeding (before: every later call failed
// DATA_LOSS "slot answered for another request/epoch" for good).
TEST(ShmClient, ASegmentAttachedByAnotherServerIsReplaced) {
  Rig rig;
  absl::Status started = rig.Start();
  ASSERT_TRUE(started.ok()) << started;
  auto* h = static_cast<ShmHeader*>(rig.client->segment());
  ASSERT_NE(h, nullptr);
  const int fd = SegmentFd();
  ASSERT_GE(fd, 0);
  testing::RowHandler other_handler;
  ShmServer other(&other_handler);
  auto epoch = other.Attach(absl::StrCat("/proc/", ::getpid(), "/fd/", fd), ::getpid(), h->nonce);
  ASSERT_TRUE(epoch.ok()) << epoch.status();
  for (int i = 0; i < 50; ++i) {
    absl::Status st = OneCall(*rig.client, rig.handler.info(), 1 + i % 4, absl::Seconds(10));
    ASSERT_TRUE(st.ok()) << i << ": " << st;
  }
}

// Byte sizes that wrap around 2^64 are refused before anything is copied
// (before: the capacity check wrapped too and memcpy ran off the segment).
TEST(ShmClient, ByteSizesThatWrapAreRefused) {
  Rig rig;
  absl::Status started = rig.Start();
  ASSERT_TRUE(started.ok()) << started;
  const ShardInfo& info = rig.handler.info();
  auto rc = testing::MakeRandomCall(info, info.moe_layers[0], 1, 3);
  MoeCall call = rc.call();
  call.hidden_bytes = 64;
  call.weights_bytes = ~uint64_t{0} - 63;
  std::vector<float> out(static_cast<size_t>(info.hidden));
  auto h = rig.client->Submit(call, out.data(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  call = rc.call();
  call.ids_bytes = ~uint64_t{0} - 10;
  h = rig.client->Submit(call, out.data(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_TRUE(OneCall(*rig.client, info, 2, absl::Seconds(10)).ok());
}

// The service's shared-memory server stops (the process lives on; it marks
// the segment closed): the next call fails UNAVAILABLE at once (before: it
// was sent into the closed segment and waited out its deadline), and the
// re-attach a service without shared memory refuses is UNAVAILABLE too
// (before: its FAILED_PRECONDITION reached the caller as such).
TEST(ShmClient, AClosedSegmentAndARefusedReattachAreUnavailable) {
  Rig rig;
  absl::Status started = rig.Start();
  ASSERT_TRUE(started.ok()) << started;
  rig.control.server.store(nullptr);
  rig.shm.reset();
  const absl::Time t0 = absl::Now();
  absl::Status st = OneCall(*rig.client, rig.handler.info(), 2, absl::Seconds(5));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(3)) << st;
  // Shared memory back: served again.
  rig.shm = std::make_unique<ShmServer>(&rig.handler);
  rig.control.server.store(rig.shm.get());
  st = OneCall(*rig.client, rig.handler.info(), 2, absl::Seconds(5));
  EXPECT_TRUE(st.ok()) << st;
}

// A handler that holds each call until released (a call in flight).
class HeldHandler final : public MoeHandler {
 public:
  const ShardInfo& info() const override { return rows_.info(); }
  absl::Status Handle(const MoeCall& call, float* out, uint64_t* ns) override {
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    lock.unlock();
    return rows_.Handle(call, out, ns);
  }
  void WaitEntered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return entered_; });
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  testing::RowHandler rows_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, released_ = false;
};

// The service's shm server stops while a call is in flight (it marks the
// segment closed, then waits for its serving thread): the waiting client
// fails UNAVAILABLE within its futex clamp, not at its deadline.
TEST(ShmClient, ACallInFlightWhenTheSegmentClosesIsUnavailable) {
  HeldHandler held;
  auto shm = std::make_unique<ShmServer>(&held);
  Control control;
  control.server.store(shm.get());
  control.info = &held.info();
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(&control);
  auto grpc_server = b.BuildAndStart();
  ASSERT_NE(grpc_server, nullptr);
  auto client = ShmClient::Create(
      std::make_shared<ControlClient>(MakeExpertChannel(absl::StrCat("127.0.0.1:", port))),
      held.info());
  ASSERT_TRUE(client.ok()) << client.status();
  const ShardInfo& info = held.info();
  auto rc = testing::MakeRandomCall(info, info.moe_layers[0], 2, 5);
  std::vector<float> out(static_cast<size_t>(2 * info.hidden));
  auto h = (*client)->Submit(rc.call(), out.data(), absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(h.ok()) << h.status();
  held.WaitEntered();
  control.server.store(nullptr);
  std::thread stopper([&] { shm.reset(); });  // closes, then waits for the held call
  const absl::Time t0 = absl::Now();
  const absl::Status st = (*client)->Wait(*h, absl::Now() + absl::Seconds(20));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(st.message().find("closed the segment"), std::string_view::npos) << st;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5)) << st;
  held.Release();
  stopper.join();
  client->reset();
  grpc_server->Shutdown();
}

}  // namespace
}  // namespace hmoe
