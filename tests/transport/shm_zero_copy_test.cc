// The shared-memory client's zero-copy API: requests written and answers read
// in place in the slot give exactly what Submit/Wait give; slots are held until
// Release; with all held by its own handles, Acquire refuses at once.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "gpu_worker/transport/grpc_client.h"
#include "gpu_worker/transport/shm_client.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"
#include "tests/transport/service_process.h"
#include "tests/transport/test_util.h"

namespace hmoe {
namespace {

absl::Time Soon() { return absl::Now() + absl::Seconds(10); }

// Every slot is held by this client's own handles (nothing at the service
// would free one): Acquire says so at once, RESOURCE_EXHAUSTED, without
// waiting out its deadline.
void ExpectNoFreeSlot(ShmClient& shm, int32_t top_k) {
  const absl::Time t0 = absl::Now();
  auto none = shm.Acquire(1, top_k, t0 + absl::Seconds(10));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
  EXPECT_NE(none.status().message().find("held by this client's handles"), absl::string_view::npos)
      << none.status();
}

TEST(ShmZeroCopy, InPlaceEqualsSubmitWaitAndSlotsAreHeldUntilRelease) {
  testing::TempDir dir;
  testing::ServiceProcess proc;
  ASSERT_TRUE(
      proc.Start({"--model-dir=" + testing::FixturesDir() + "/deepseek_v3_tiny", "--max-tokens=16"},
                 dir.file("port")));
  auto control = std::make_shared<ControlClient>(MakeExpertChannel(proc.target()));
  auto info = control->Describe();
  ASSERT_TRUE(info.ok()) << info.status();
  ShmClientOptions so;
  so.slots = 2;
  auto client = ShmClient::Create(control, *info, so);
  ASSERT_TRUE(client.ok()) << client.status();
  ShmClient& shm = **client;
  {  // The segment is a memfd sealed against shrinking: truncating it under
     // the service's mapping (SIGBUS there) is refused by the kernel.
    int sealed = 0;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      const std::string target = std::filesystem::read_symlink(e.path(), ec).string();
      if (ec || target.rfind("/memfd:hmoe-shm", 0) != 0) continue;
      const int fd = std::stoi(e.path().filename().string());
      EXPECT_NE(fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK, 0);
      EXPECT_NE(ftruncate(fd, 0), 0);
      EXPECT_EQ(errno, EPERM);
      ++sealed;
    }
    EXPECT_EQ(sealed, 1) << "expected one hmoe-shm memfd in this process";
  }

  auto rc = testing::MakeRandomCall(*info, info->moe_layers[0], 5, 7);
  const MoeCall& call = rc.call();
  std::vector<float> want(static_cast<size_t>(call.tokens * info->hidden));
  auto h = shm.Submit(call, want.data(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(shm.Wait(*h, absl::Now() + absl::Seconds(10)).ok());

  auto a = shm.Acquire(call.tokens, call.top_k, Soon());
  ASSERT_TRUE(a.ok()) << a.status();
  std::memcpy(a->hidden, call.hidden, call.hidden_bytes);
  std::memcpy(a->ids, call.ids, call.ids_bytes);
  std::memcpy(a->weights, call.weights, call.weights_bytes);
  // Both slots taken (one committed, one only acquired): a third is refused.
  auto b = shm.Acquire(1, call.top_k, Soon());
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectNoFreeSlot(shm, call.top_k);
  ASSERT_TRUE(shm.Commit(a->handle, call.layer).ok());
  auto answer = shm.WaitInPlace(a->handle, absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(answer.ok()) << answer.status();
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ((*answer)[i], want[i]) << i;  // bit-identical
  ExpectNoFreeSlot(shm, call.top_k);
  shm.Release(a->handle);
  shm.Release(b->handle);  // never committed: released all the same
  auto c = shm.Acquire(1, call.top_k, Soon());
  EXPECT_TRUE(c.ok()) << c.status();
  shm.Release(c->handle);

  EXPECT_EQ(shm.Commit(987654, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shm.WaitInPlace(987654, absl::Now()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shm.Acquire(info->max_tokens + 100, call.top_k, Soon()).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A server-side rejection comes back from WaitInPlace and frees the slot.
  auto bad = shm.Acquire(1, call.top_k, Soon());
  ASSERT_TRUE(bad.ok());
  std::memset(bad->hidden, 0, static_cast<size_t>(info->hidden) * 2);
  for (int j = 0; j < call.top_k; ++j) {
    bad->ids[j] = static_cast<int32_t>(info->num_experts + 1);  // out of range
    bad->weights[j] = 1.0f;
  }
  ASSERT_TRUE(shm.Commit(bad->handle, call.layer).ok());
  auto refused = shm.WaitInPlace(bad->handle, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  auto d = shm.Acquire(1, call.top_k, Soon()), e = shm.Acquire(1, call.top_k, Soon());
  EXPECT_TRUE(d.ok() && e.ok());  // both slots free again
}

}  // namespace
}  // namespace hmoe
